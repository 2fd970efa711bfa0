// A run: its steps (status, iteration, attempt, waits, child runs), live over
// GET /runs/{id}/events; cancel; the audit of its journal (journal check).

import { ApiError, follow, get, path, post } from "./api.js";
import { badge, cell, fill, h, jsonBlock, say, short, when } from "./dom.js";
import { diffControls, forkedFrom, settingsFacts } from "./fork.js";
import { usagePanel } from "./usage.js";

export function runPage(view, { run: runId }, crumbs) {
  crumbs(h("a", { href: "#/runs" }, "Runs"), " / ", h("span", {}, "run "), short(runId, 12));
  const head = h("div", { class: "run-head", id: "run-head" });
  const msg = h("p", { class: "msg", id: "run-msg", hidden: true });
  const steps = h("tbody", { id: "steps-body" });
  const check = h("div", { id: "check" });
  const actions = h("div", { class: "actions", id: "run-actions", hidden: true });
  const commits = new Map(); // step -> {key, commit}: the wait a waiting step was given
  let current = null;
  let checked = "";
  const usage = usagePanel(runId);
  fill(actions, cancelControls(runId, msg));

  fill(
    view,
    h("section", { class: "panel" }, head, actions, msg, diffControls(runId)),
    h(
      "section",
      { class: "panel" },
      h("h2", {}, "Steps"),
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          { class: "steps" },
          h(
            "thead",
            {},
            h(
              "tr",
              {},
              ["Step", "Status", "Iteration", "Attempt", "Wait", "Child run", "Started", "Finished", "Error"].map((t) =>
                h("th", {}, t),
              ),
            ),
          ),
          steps,
        ),
      ),
    ),
    usage.section,
    h("section", { class: "panel" }, h("div", { class: "bar" }, h("h2", {}, "Journal check"), h("button", { type: "button", id: "check-again", onclick: () => audit() }, "Check again")), check),
  );

  const audit = async () => {
    fill(check, h("p", { class: "hint" }, "checking…"));
    try {
      fill(check, checkResult(await get(`${path("runs", runId)}/journal/check`)));
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(check, "error", `The check failed: ${err.text}`);
    }
  };

  const draw = (run) => {
    current = run;
    fill(head, runHead(run));
    actions.hidden = run.status !== "running";
    fill(steps, run.steps.map((s) => stepRow(run, s, commits.get(s.step_id))));
    for (const s of run.steps) lookUpWait(run, s);
    // Audit once on arrival and again when the run has ended.
    const state = run.status === "running" ? "running" : "ended";
    if (checked !== state) {
      checked = state;
      audit();
      usage.refresh();
    }
  };

  // A waiting step's wait (delay, until, an input) is in its last commit.
  const lookUpWait = async (run, step) => {
    if (step.status !== "waiting") return;
    const key = `${step.iteration}.${step.attempt}.${step.wake_at ?? ""}`;
    if (commits.get(step.step_id)?.key === key) return;
    commits.set(step.step_id, { key, commit: null });
    const commit = await lastCommit(run.run_id, step.step_id).catch(() => null);
    commits.set(step.step_id, { key, commit });
    if (current) fill(steps, current.steps.map((s) => stepRow(current, s, commits.get(s.step_id))));
  };

  const stream = follow(`${path("runs", runId)}/events`, {
    event(type, data) {
      if (type === "run") draw(data);
      else if (type === "error") say(msg, "error", `The engine cannot be reached: ${data.message}`);
    },
    state(s, detail) {
      if (s === "failed" && detail instanceof ApiError && detail.status !== 401) say(msg, "error", detail.text);
    },
  });
  return () => stream.close();
}

function runHead(run) {
  return [
    h("h1", {}, "Run ", h("code", { class: "id", id: "run-id" }, run.run_id), " ", h("span", { id: "run-status" }, badge(run.status))),
    h(
      "dl",
      { class: "facts" },
      h("dt", {}, "Workflow"),
      h("dd", {}, h("a", { href: `#/runs?workflow=${encodeURIComponent(run.workflow)}` }, run.workflow)),
      h("dt", {}, "Started"),
      h("dd", {}, when(run.created_at)),
      run.finished_at ? [h("dt", {}, "Finished"), h("dd", {}, when(run.finished_at))] : null,
      run.parent_run_id
        ? [
            h("dt", {}, "Parent"),
            h("dd", {}, h("a", { href: `#${path("runs", run.parent_run_id)}` }, short(run.parent_run_id, 12)), ` step ${run.parent_step_id}`),
          ]
        : null,
      run.idempotency_key ? [h("dt", {}, "Idempotency key"), h("dd", {}, run.idempotency_key)] : null,
      forkedFrom(run),
      settingsFacts(run),
      run.budget ? [h("dt", {}, "Budget"), h("dd", { id: "run-budget" }, budgetText(run.budget))] : null,
      run.error ? [h("dt", {}, "Error"), h("dd", { class: "error-text", id: "run-error" }, run.error)] : null,
    ),
    jsonBlock(run.input, "Input"),
    run.status === "completed" ? jsonBlock(run.output, "Output") : null,
  ];
}

function budgetText(budget) {
  const bounds = [budget.tokens ? `${budget.tokens} tokens` : null, budget.cost ? `cost ${budget.cost}` : null];
  return `${bounds.filter(Boolean).join(", ")}; ${budget.policy === "pause" ? "pauses" : "fails"} when spent`;
}

function cancelControls(runId, msg) {
  const confirm = h(
    "span",
    { class: "confirm", hidden: true },
    "Cancel this run and its child runs? ",
    h(
      "button",
      {
        type: "button",
        class: "danger",
        id: "cancel-confirm",
        onclick: async (e) => {
          e.target.disabled = true;
          try {
            await post(`${path("runs", runId)}/cancel`, { reason: "cancelled from the console" });
            say(msg, "ok", "Cancelled.");
          } catch (err) {
            if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Not cancelled: ${err.text}`);
            e.target.disabled = false;
          }
        },
      },
      "Yes, cancel it",
    ),
    " ",
    h("button", { type: "button", onclick: () => ((confirm.hidden = true), (open.hidden = false)) }, "No"),
  );
  const open = h("button", { type: "button", class: "danger", id: "cancel-run", onclick: () => ((confirm.hidden = false), (open.hidden = true)) }, "Cancel run");
  return [open, confirm];
}

function stepRow(run, step, wait) {
  const journal = `#${path("runs", run.run_id, "steps", step.step_id)}`;
  return h(
    "tr",
    { "data-step-id": step.step_id, "data-status": step.status, "data-build": step.build_id ?? "" },
    cell("Step", {}, h("a", { href: journal, class: "step-link" }, step.step_id)),
    cell("Status", { class: "status" }, badge(step.status)),
    cell("Iteration", { class: "iteration" }, String(step.iteration ?? 0)),
    cell("Attempt", { class: "attempt" }, String(step.attempt ?? 0)),
    cell("Wait", { class: "wait" }, waitText(step, wait?.commit)),
    cell("Child run", { class: "child" }, step.child_run_id ? h("a", { href: `#${path("runs", step.child_run_id)}` }, short(step.child_run_id, 12)) : ""),
    cell("Started", {}, when(step.started_at)),
    cell("Finished", {}, when(step.finished_at)),
    cell("Error", { class: "error-text" }, step.error ?? ""),
  );
}

/** What a waiting step waits for: a delay, a time, an input; from its state and last commit. */
export function waitText(step, commit) {
  if (step.status === "running" && step.waiting_for_build) {
    // Its task waits for a worker of its build: `dagnats run upgrade` moves it.
    return h("span", { "data-wait": "build" }, `waiting for build ${step.build_id}`);
  }
  if (step.status !== "waiting") return "";
  const parts = [];
  const wake = step.wake_at ? when(step.wake_at) : null;
  const c = commit?.commit;
  if (c?.action === "continue" && c.wait_delay) parts.push(`delay ${c.wait_delay}`);
  else if (c?.action === "continue" && c.wait_until) parts.push("until ", when(c.wait_until));
  else if (c?.action === "pause") parts.push(`pause ${c.pause ?? ""}`);
  else if (c?.action === "fail") parts.push("retry backoff");
  if (step.waiting_for_input) parts.push(parts.length ? ", or until an input" : "until an input");
  if (wake && !(c?.action === "continue" && c.wait_until)) parts.push(parts.length ? " · wakes " : "wakes ", wake);
  return h("span", { "data-wait": step.waiting_for_input ? "input" : "time" }, parts);
}

/** The step's last commit record, read page by page; null when there is none. */
async function lastCommit(runId, stepId) {
  let from = 0;
  let last = null;
  for (;;) {
    const page = await get(`${path("runs", runId, "steps", stepId)}/journal?from=${from}&limit=1000`);
    for (const r of page.records) if (r.kind === "commit") last = r;
    if (page.records.length < 1000) return last;
    from = page.next;
  }
}

function checkResult(result) {
  const violations = result.violations ?? [];
  const summary = `${result.steps} step(s), ${result.records} record(s) checked`;
  if (!violations.length) {
    return h("p", { class: "msg msg-ok", id: "check-result", "data-sound": "true" }, `Sound: no violations. ${summary}.`);
  }
  return [
    h("p", { class: "msg msg-error", id: "check-result", "data-sound": "false" }, `${violations.length} violation(s). ${summary}.`),
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        {},
        h("thead", {}, h("tr", {}, ["Step", "Record", "Rule", "What is wrong"].map((t) => h("th", {}, t)))),
        h(
          "tbody",
          {},
          violations.map((v) =>
            h("tr", {}, cell("Step", {}, v.step_id), cell("Record", {}, v.seq ? `#${v.seq}` : ""), cell("Rule", {}, h("code", {}, v.rule)), cell("What is wrong", {}, v.message)),
          ),
        ),
      ),
    ),
  ];
}
