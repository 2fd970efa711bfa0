// A step: its journal as a live timeline (GET .../journal?follow=1), the live
// token stream of its model calls (GET .../stream), its state from the run's
// events, and its inputs.

import { ApiError, follow, path } from "./api.js";
import { badge, fill, h, say, short } from "./dom.js";
import { approvalsPanel } from "./approvals.js";
import { inputsPanel } from "./inputs.js";
import { waitText } from "./run.js";
import { Timeline } from "./timeline.js";

// How long the token stream stays open after the journal's end.
const TOKENS_LINGER_MS = 3000;

export function stepPage(view, { run: runId, step: stepId }, crumbs) {
  const runLink = `#${path("runs", runId)}`;
  crumbs(h("a", { href: "#/runs" }, "Runs"), " / ", h("a", { href: runLink }, "run ", short(runId, 12)), " / ", h("span", {}, `step ${stepId}`));
  const state = h("span", { id: "step-status" });
  const facts = h("span", { class: "hint", id: "step-facts" });
  const msg = h("p", { class: "msg", id: "step-msg", hidden: true });
  const journalState = h("span", { class: "live-state", id: "journal-live", title: "the journal's records" }, "connecting…");
  const tokensState = h("span", { class: "live-state", id: "tokens-live", title: "the live token stream" }, "tokens: connecting…");
  const records = h("ol", { class: "timeline", id: "timeline" });
  const live = h("ol", { class: "timeline live", id: "live" });
  const timeline = new Timeline(records, live, { run: runId, step: stepId });
  const inputs = inputsPanel(runId, stepId);
  const approvals = approvalsPanel(runId, stepId);
  let linger = null;

  fill(
    view,
    h("section", { class: "panel" }, h("h1", {}, `Step ${stepId} `, state), facts, msg),
    h(
      "div",
      { class: "split" },
      h(
        "section",
        { class: "panel journal" },
        h("div", { class: "bar" }, h("h2", {}, "Journal"), journalState, tokensState),
        records,
        live,
      ),
      h("div", { class: "side" }, approvals.el, inputs.el),
    ),
  );

  const failed = (s, detail) => {
    if (s === "failed" && detail instanceof ApiError && detail.status !== 401) say(msg, "error", detail.text);
  };
  const stepBase = path("runs", runId, "steps", stepId);
  const tokens = follow(
    `${stepBase}/stream`,
    {
      event: (type, data) => timeline.stream(type, data),
      state(s, detail) {
        tokensState.textContent = `tokens: ${{ live: "live", reconnecting: "reconnecting…", failed: "stopped" }[s] ?? s}`;
        tokensState.dataset.state = s;
        failed(s, detail);
      },
    },
    { resume: true },
  );
  const journal = follow(
    `${stepBase}/journal?follow=1`,
    {
      event(type, data) {
        if (type === "record") {
          timeline.record(data);
          if (data.kind === "input_placed") inputs.placed(data.input_placed.request_id);
          if (data.kind === "tool_intent" || data.kind === "commit") approvals.refresh();
        } else if (type === "end") {
          timeline.end(data);
          // The tokens come on another connection and may trail the journal:
          // the last call's preview events can still be on their way.
          linger = setTimeout(() => {
            tokens.close();
            timeline.settle();
            tokensState.textContent = "tokens: finished";
            tokensState.dataset.state = "ended";
          }, TOKENS_LINGER_MS);
        } else if (type === "error") say(msg, "error", `The journal cannot be read: ${data.message}`);
      },
      state(s, detail) {
        journalState.textContent = { live: "live", reconnecting: "reconnecting…", ended: "finished", failed: "stopped" }[s] ?? s;
        journalState.dataset.state = s;
        failed(s, detail);
      },
    },
    { resume: true },
  );
  const run = follow(`${path("runs", runId)}/events`, {
    event(type, data) {
      if (type !== "run") return;
      const step = data.steps.find((s) => s.step_id === stepId);
      if (!step) return;
      fill(state, badge(step.status));
      const wait = waitText(step, null);
      fill(facts, `iteration ${step.iteration} · attempt ${step.attempt} · run `, badge(data.status), wait ? [" · ", wait] : "");
    },
    state: failed,
  });
  return () => {
    clearTimeout(linger);
    tokens.close();
    journal.close();
    run.close();
    inputs.stop();
    approvals.stop();
  };
}
