// A run's usage (GET /runs/{id}/usage): what its model calls spent, for the
// run and each step: tokens and cost, and how many calls were kept, retried,
// (an attempt a retry replaced) and fenced (a holder the fence stopped).

import { ApiError, get, path } from "./api.js";
import { cell, fill, h, say } from "./dom.js";

export function usagePanel(runId) {
  const body = h("div", { id: "usage" });
  const refresh = async () => {
    try {
      fill(body, usageTable(await get(`${path("runs", runId)}/usage`)));
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(body, "error", `No usage: ${err.text}`);
    }
  };
  const section = h(
    "section",
    { class: "panel" },
    h("div", { class: "bar" }, h("h2", {}, "Usage"), h("button", { type: "button", id: "usage-refresh", onclick: () => refresh() }, "Refresh")),
    body,
  );
  return { section, refresh };
}

function usageTable(usage) {
  const heads = ["", "Calls", "Input", "Cached", "Output", "Cost", "Kept", "Retried", "Fenced", "Copied"];
  const row = (label, id, split) =>
    h(
      "tr",
      { "data-usage": id },
      cell("", {}, label),
      cell("Calls", { class: "calls" }, String(split.spent.calls)),
      cell("Input", { class: "input" }, String(split.spent.input_tokens)),
      cell("Cached", { class: "cached" }, String(split.spent.cached_tokens)),
      cell("Output", { class: "output" }, String(split.spent.output_tokens)),
      cell("Cost", { class: "cost" }, split.spent.cost ? String(split.spent.cost) : ""),
      cell("Kept", { class: "kept" }, String(split.kept.calls)),
      cell("Retried", { class: "retried" }, String(split.retried.calls)),
      cell("Fenced", { class: "fenced" }, String(split.fenced.calls)),
      cell("Copied", { class: "copied" }, String(split.copied.calls)),
    );
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      { class: "usage" },
      h("thead", {}, h("tr", {}, heads.map((t) => h("th", {}, t)))),
      h("tbody", {}, row("Run", "run", usage.total), usage.steps.map((s) => row(`step ${s.step_id}`, s.step_id, s))),
    ),
  );
}
