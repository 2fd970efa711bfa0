// A step's tool calls waiting for approval: each with its tool, arguments and
// digest (GET .../approvals), and Approve / Deny buttons that send the digest
// shown (POST .../approvals): an approval is bound to the arguments the
// approver saw, and the gateway refuses it (409, with the reason) if the
// call waits with others. The list is read again when the journal shows a
// tool call, and after each decision.

import { ApiError, call, get, path } from "./api.js";
import { fill, h, jsonBlock, say } from "./dom.js";

export function approvalsPanel(runId, stepId) {
  const base = `${path("runs", runId, "steps", stepId)}/approvals`;
  const controller = new AbortController();
  const rows = h("ul", { class: "approvals", id: "approvals-list" });
  const msg = h("p", { class: "msg", id: "approval-msg", hidden: true, role: "status" });
  const none = h("p", { class: "hint", id: "approvals-none" }, "No tool call waits for approval.");

  const decide = async (item, decision, reason, buttons) => {
    for (const b of buttons) b.disabled = true;
    try {
      await call("POST", base, { body: { call: item.call, digest: item.digest, decision, reason, approver: "console" } });
      say(msg, "ok", `${decision === "approve" ? "Approved" : "Denied"} ${item.tool} (${item.call}).`);
      await refresh();
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Not decided: ${err.text}`);
      for (const b of buttons) b.disabled = false;
    }
  };

  const card = (item) => {
    const reason = h("input", { type: "text", class: "reason", placeholder: "reason (a denial's reaches the model)", "aria-label": "reason" });
    const approve = h("button", { type: "button", class: "approve" }, "Approve");
    const deny = h("button", { type: "button", class: "deny" }, "Deny");
    approve.onclick = () => decide(item, "approve", reason.value, [approve, deny]);
    deny.onclick = () => decide(item, "deny", reason.value, [approve, deny]);
    return h(
      "li",
      { class: "approval", "data-call": item.call, "data-digest": item.digest },
      h("div", { class: "input-head" }, h("strong", { class: "tool" }, item.tool), h("code", { class: "call" }, item.call)),
      jsonBlock(item.args, "arguments"),
      h("p", { class: "hint" }, "digest ", h("code", { class: "digest" }, item.digest)),
      h("div", { class: "row" }, reason, approve, deny),
    );
  };

  const refresh = async () => {
    try {
      const { approvals } = await get(base, { signal: controller.signal });
      fill(rows, ...approvals.map(card));
      none.hidden = approvals.length > 0;
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Approvals: ${err.text}`);
    }
  };

  const el = h("section", { class: "panel approvals", id: "approvals" }, h("h2", {}, "Approvals"), none, msg, rows);
  refresh();
  return { el, refresh, stop: () => controller.abort() };
}
