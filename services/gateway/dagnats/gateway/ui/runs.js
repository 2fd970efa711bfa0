// The runs: a live list (GET /runs/events) filtered by workflow and status,
// and a form that starts a run with a JSON input.

import { ApiError, follow, get, path, post } from "./api.js";
import { badge, cell, fill, h, say, short, when } from "./dom.js";

const STATUSES = ["running", "completed", "failed", "cancelled"];

export function runsPage(view, filter, crumbs) {
  crumbs(h("span", {}, "Runs"));
  const runs = new Map();
  const workflowPick = h("select", { id: "filter-workflow", "aria-label": "workflow" }, h("option", { value: "" }, "every workflow"));
  const statusPick = h(
    "select",
    { id: "filter-status", "aria-label": "status" },
    h("option", { value: "" }, "any status"),
    STATUSES.map((s) => h("option", { value: s }, s)),
  );
  statusPick.value = filter.status;
  const live = h("span", { class: "live-state", id: "runs-live" }, "connecting…");
  const listMsg = h("p", { class: "msg", hidden: true });
  const body = h("tbody", { id: "runs-body" });
  const table = h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      { class: "runs" },
      h("thead", {}, h("tr", {}, ["Run", "Workflow", "Status", "Steps", "Started", "Finished"].map((t) => h("th", {}, t)))),
      body,
    ),
  );
  const empty = h("p", { class: "empty", id: "runs-empty", hidden: true }, "No runs match.");

  const form = startForm(workflowPick, filter);
  fill(
    view,
    form.el,
    h(
      "section",
      { class: "panel" },
      h("div", { class: "bar" }, h("h2", {}, "Runs"), workflowPick, statusPick, live),
      listMsg,
      table,
      empty,
    ),
  );

  const refilter = () => {
    const q = new URLSearchParams();
    if (workflowPick.value) q.set("workflow", workflowPick.value);
    if (statusPick.value) q.set("status", statusPick.value);
    location.hash = `#/runs${q.toString() ? "?" + q : ""}`;
  };
  workflowPick.addEventListener("change", refilter);
  statusPick.addEventListener("change", refilter);

  const draw = () => {
    const rows = [...runs.values()].sort((a, b) => (b.created_at ?? "").localeCompare(a.created_at ?? ""));
    fill(body, rows.map(runRow));
    empty.hidden = rows.length > 0;
  };
  const q = new URLSearchParams();
  if (filter.workflow) q.set("workflow", filter.workflow);
  if (filter.status) q.set("status", filter.status);
  const stream = follow(`/runs/events?${q}`, {
    event(type, data) {
      if (type === "runs") {
        runs.clear();
        for (const run of data.runs) runs.set(run.run_id, run);
      } else if (type === "change") {
        for (const run of data.runs) runs.set(run.run_id, run);
        for (const id of data.removed) runs.delete(id);
      } else if (type === "error") {
        say(listMsg, "error", `The engine cannot be reached: ${data.message}`);
        return;
      }
      listMsg.hidden = true;
      draw();
    },
    state(s, detail) {
      live.textContent = { live: "live", reconnecting: "reconnecting…", failed: "stopped" }[s] ?? s;
      live.dataset.state = s;
      if (s === "failed" && detail instanceof ApiError && detail.status !== 401) say(listMsg, "error", detail.text);
    },
  });
  return () => {
    stream.close();
    form.stop();
  };
}

function runRow(run) {
  const steps = (run.steps ?? []).map((s) =>
    h("span", { class: "step-chip" }, `${s.step_id} `, badge(s.status), s.iteration ? ` it ${s.iteration}` : ""),
  );
  return h(
    "tr",
    { "data-run-id": run.run_id, "data-status": run.status },
    cell("Run", {}, h("a", { href: `#${path("runs", run.run_id)}` }, short(run.run_id, 12))),
    cell("Workflow", {}, run.workflow),
    cell("Status", { class: "status" }, badge(run.status)),
    cell("Steps", { class: "steps" }, steps),
    cell("Started", {}, when(run.created_at)),
    cell("Finished", {}, when(run.finished_at)),
  );
}

/** The form that starts a run; fills the workflow filter too. */
function startForm(workflowPick, filter) {
  const pick = h("select", { id: "start-workflow", required: true, "aria-label": "workflow to start" });
  const input = h("textarea", { id: "start-input", rows: 2, spellcheck: "false", placeholder: '{"question": "hello"}' });
  const msg = h("p", { id: "start-msg", class: "msg", hidden: true, role: "status" });
  const button = h("button", { type: "submit", id: "start-run" }, "Start run");
  let alive = true;

  const el = h(
    "form",
    {
      class: "panel start",
      id: "start-form",
      onsubmit: async (e) => {
        e.preventDefault();
        let value = null;
        const text = input.value.trim();
        if (text) {
          try {
            value = JSON.parse(text);
          } catch (err) {
            say(msg, "error", `The input is not valid JSON: ${err.message}. Nothing was sent.`);
            return;
          }
        }
        if (!pick.value) {
          say(msg, "error", "Choose a workflow first.");
          return;
        }
        button.disabled = true;
        try {
          const run = await post("/runs", { workflow: pick.value, input: value });
          say(msg, "ok", "Started run ", h("a", { href: `#${path("runs", run.run_id)}`, id: "started-run" }, run.run_id), ".");
        } catch (err) {
          if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Not started: ${err.text}`);
        } finally {
          button.disabled = false;
        }
      },
    },
    h("h2", {}, "Start a run"),
    h("div", { class: "row" }, h("label", { for: "start-workflow" }, "Workflow"), pick),
    h("label", { for: "start-input" }, "Input (JSON; empty is null)"),
    input,
    h("div", { class: "row" }, button),
    msg,
  );

  get("/workflows")
    .then(({ workflows }) => {
      if (!alive) return;
      const names = workflows.map((w) => w.name);
      fill(pick, names.map((n) => h("option", { value: n }, n)));
      if (filter.workflow && !names.includes(filter.workflow)) names.push(filter.workflow);
      for (const n of names) workflowPick.append(h("option", { value: n }, n));
      workflowPick.value = filter.workflow;
      if (filter.workflow) pick.value = filter.workflow;
      if (!names.length) say(msg, "info", "No workflow is registered yet (dagnats workflow apply FILE).");
    })
    .catch((err) => {
      if (alive && err instanceof ApiError && err.status !== 401) say(msg, "error", `Workflows: ${err.text}`);
    });
  return { el, stop: () => (alive = false) };
}
