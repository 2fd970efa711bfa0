// A step's inputs: submit a steer or follow-up input, see each input's status
// change live (a long poll per input, GET ...?wait=30s&if_status=<last seen>,
// answered by the inputs service as the status changes), withdraw a queued one.

import { ApiError, call, del, get, path } from "./api.js";
import { badge, h, jsonBlock, say } from "./dom.js";

const FINAL = new Set(["done", "unanswered", "withdrawn", "dropped", "expired"]);

export function inputsPanel(runId, stepId) {
  const base = `${path("runs", runId, "steps", stepId)}/inputs`;
  const controller = new AbortController();
  const inputs = new Map(); // request id -> { item, history, row }
  const rows = h("ul", { class: "inputs", id: "inputs-list" });
  const msg = h("p", { class: "msg", id: "input-msg", hidden: true, role: "status" });
  const mode = h("select", { id: "input-mode", "aria-label": "mode" }, h("option", { value: "steer" }, "steer"), h("option", { value: "follow_up" }, "follow-up"));
  const content = h("textarea", { id: "input-content", rows: 2, spellcheck: "false", placeholder: "use celsius" });
  const asJson = h("input", { type: "checkbox", id: "input-json" });
  const send = h("button", { type: "submit", id: "input-submit" }, "Submit");

  const draw = (entry) => {
    const { item, history } = entry;
    const withdraw =
      item.status === "queued"
        ? h("button", { type: "button", class: "withdraw", onclick: () => withdrawIt(item.request_id) }, "Withdraw")
        : null;
    const card = h(
      "li",
      { class: "input", "data-request-id": item.request_id, "data-status": item.status },
      h(
        "div",
        { class: "input-head" },
        h("span", { class: "status" }, badge(item.status)),
        h("span", {}, item.mode === "follow_up" ? "follow-up" : "steer"),
        h("code", { class: "request-id" }, item.request_id),
        withdraw,
      ),
      jsonBlock(item.content),
      h(
        "p",
        { class: "hint" },
        "seen: ",
        h("span", { class: "history" }, history.join(" → ")),
        item.placed_by ? ` · placed by iteration ${item.placed_iteration}, attempt ${item.placed_attempt}` : "",
      ),
      item.reason ? h("p", { class: "hint reason" }, item.reason) : null,
    );
    if (entry.row) entry.row.replaceWith(card);
    else rows.prepend(card);
    entry.row = card;
  };

  const update = (item) => {
    let entry = inputs.get(item.request_id);
    const fresh = !entry;
    if (fresh) {
      entry = { item, history: [item.status], row: null };
      inputs.set(item.request_id, entry);
    } else {
      entry.item = item;
      if (entry.history.at(-1) !== item.status) entry.history.push(item.status);
    }
    draw(entry);
    if (fresh) watch(item.request_id);
  };

  const watch = async (rid) => {
    const one = `${base}/${encodeURIComponent(rid)}`;
    while (!controller.signal.aborted) {
      const seen = inputs.get(rid).item.status;
      if (FINAL.has(seen)) return;
      try {
        update(await get(`${one}?wait=30s&if_status=${seen}`, { signal: controller.signal }));
      } catch (err) {
        if (err.name === "AbortError" || err.status === 401) return;
        say(msg, "error", `Input ${rid}: ${err.text ?? err.message}`);
        await new Promise((resolve) => setTimeout(resolve, 1000));
      }
    }
  };

  const withdrawIt = async (rid) => {
    try {
      await del(`${base}/${encodeURIComponent(rid)}`);
      update(await get(`${base}/${encodeURIComponent(rid)}`));
      say(msg, "ok", `Withdrew ${rid}.`);
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Not withdrawn: ${err.text}`);
    }
  };

  const refresh = async () => {
    try {
      const { inputs: items } = await get(base, { signal: controller.signal });
      items.sort((a, b) => (a.created_at ?? "").localeCompare(b.created_at ?? ""));
      for (const item of items) update(item);
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Inputs: ${err.text}`);
    }
  };

  const el = h(
    "section",
    { class: "panel inputs", id: "inputs" },
    h("h2", {}, "Inputs"),
    h(
      "form",
      {
        id: "input-form",
        onsubmit: async (e) => {
          e.preventDefault();
          const text = content.value.trim();
          if (!text) {
            say(msg, "error", "Write the input first.");
            return;
          }
          let value = text;
          if (asJson.checked) {
            try {
              value = JSON.parse(text);
            } catch (err) {
              say(msg, "error", `The input is not valid JSON: ${err.message}. Nothing was sent.`);
              return;
            }
          }
          const requestId = `console-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
          send.disabled = true;
          try {
            const item = await call("POST", base, { body: { request_id: requestId, mode: mode.value, content: value } });
            update(item);
            content.value = "";
            say(msg, "ok", `Submitted ${requestId}.`);
          } catch (err) {
            if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Not submitted: ${err.text}`);
          } finally {
            send.disabled = false;
          }
        },
      },
      h("div", { class: "row" }, h("label", { for: "input-mode" }, "Mode"), mode, h("label", { class: "check" }, asJson, " content is JSON")),
      h("label", { for: "input-content" }, "Content"),
      content,
      h("div", { class: "row" }, send),
    ),
    msg,
    rows,
  );
  refresh();
  return {
    el,
    /** A placed input the panel may not know (submitted elsewhere). */
    placed(rid) {
      if (!inputs.has(rid)) refresh();
    },
    stop: () => controller.abort(),
  };
}
