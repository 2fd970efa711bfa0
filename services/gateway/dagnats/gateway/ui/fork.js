// Forking a run from a record of a step's journal, and two runs side by side.
//
// The timeline's "fork from here" opens a small form under its record: the
// settings to change (one name=value a line, such as model=b), a steering
// input, another input. Sent, it POSTs /runs/<run>/fork and opens the new run.
//
//   #/runs/<a>/diff/<b>   two runs' journals from their common prefix
//                         (GET /runs/<a>/diff/<b>): per step, the entries in
//                         common, the rest side by side, and the outcomes.

import { ApiError, get, path, post } from "./api.js";
import { badge, fill, h, jsonBlock, say, short } from "./dom.js";

/** The form that forks run `runId` after the record `seq` of step `stepId`. */
export function forkForm(runId, stepId, seq) {
  const msg = h("p", { class: "msg", hidden: true });
  const settings = h("textarea", { name: "settings", rows: 2, placeholder: "model=b", class: "fork-settings" });
  const steer = h("input", { name: "steer", placeholder: "a steering message (optional)", class: "fork-steer" });
  const input = h("textarea", { name: "input", rows: 2, placeholder: "another input as JSON (optional)", class: "fork-input" });
  const form = h(
    "form",
    { class: "fork-form", "data-seq": seq },
    h("p", { class: "hint" }, `A new run whose journal of ${stepId} starts with a copy of this one's records through #${seq}: nothing before it runs again.`),
    h("label", {}, "Settings ", settings),
    h("label", {}, "Steer ", steer),
    h("label", {}, "Input ", input),
    h("button", { type: "submit", class: "fork-submit" }, "Fork"),
    msg,
  );
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const body = { step_id: stepId, at_seq: seq, settings: {} };
    for (const line of settings.value.split("\n").map((l) => l.trim()).filter(Boolean)) {
      const at = line.indexOf("=");
      if (at < 1) return say(msg, "error", `A setting is name=value, not "${line}".`);
      body.settings[line.slice(0, at).trim()] = line.slice(at + 1).trim();
    }
    if (steer.value.trim()) body.steer = steer.value.trim();
    if (input.value.trim()) {
      try {
        body.input = JSON.parse(input.value);
      } catch {
        return say(msg, "error", "The input is not JSON: nothing was sent.");
      }
    }
    form.querySelector("button").disabled = true;
    try {
      const run = await post(`${path("runs", runId)}/fork`, body);
      location.hash = `#${path("runs", run.run_id)}`;
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) say(msg, "error", `Not forked: ${err.text}`);
      form.querySelector("button").disabled = false;
    }
  });
  return form;
}

/** A button that opens (or closes) the fork form under `el`. */
export function forkButton(runId, stepId, seq, el) {
  let form = null;
  return h(
    "button",
    {
      type: "button",
      class: "fork-here link",
      title: "start a new run from this record",
      onclick: () => {
        if (form) {
          form.remove();
          form = null;
          return;
        }
        form = forkForm(runId, stepId, seq);
        el.append(form);
      },
    },
    "fork from here",
  );
}

/** Where a forked run came from, with a link to its diff against the source. */
export function forkedFrom(run) {
  const o = run.forked_from;
  if (!o) return null;
  return [
    h("dt", {}, "Forked from"),
    h(
      "dd",
      { id: "forked-from" },
      h("a", { href: `#${path("runs", o.run_id)}` }, short(o.run_id, 12)),
      ` step ${o.step_id} at #${o.at_seq} · `,
      h("a", { href: `#${path("runs", run.run_id)}/diff/${encodeURIComponent(o.run_id)}`, id: "diff-source" }, "diff with the source"),
    ),
  ];
}

/** A small form that opens the diff of run `runId` with another run. */
export function diffControls(runId) {
  const other = h("input", { id: "diff-other", placeholder: "another run's id", size: 34, "aria-label": "another run's id" });
  const msg = h("span", { class: "msg", hidden: true });
  const form = h("form", { class: "diff-with" }, "Compare with run ", other, " ", h("button", { type: "submit", id: "diff-go" }, "Diff"), " ", msg);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const id = other.value.trim();
    if (!/^[0-9a-f]{32}$/.test(id)) return say(msg, "error", "A run id is 32 lowercase hex characters.");
    location.hash = `#${path("runs", runId)}/diff/${id}`;
  });
  return form;
}

/** A run's settings, when it has any. */
export function settingsFacts(run) {
  return Object.keys(run.settings ?? {}).length ? [h("dt", {}, "Settings"), h("dd", { id: "run-settings" }, settingsText(run.settings))] : null;
}

export function settingsText(settings) {
  return Object.entries(settings ?? {})
    .map(([k, v]) => `${k}=${v}`)
    .join(", ");
}

export function diffPage(view, { run: a, other: b }, crumbs) {
  crumbs(h("a", { href: "#/runs" }, "Runs"), " / ", h("a", { href: `#${path("runs", a)}` }, "run ", short(a, 12)), " / ", h("span", {}, "diff with "), short(b, 12));
  const body = h("div", { id: "diff" }, h("p", { class: "hint" }, "reading both journals…"));
  fill(view, h("section", { class: "panel" }, h("h1", {}, "Two runs side by side"), body));
  let live = true;
  get(`${path("runs", a)}/diff/${encodeURIComponent(b)}`)
    .then((d) => live && fill(body, diffView(d)))
    .catch((err) => live && err instanceof ApiError && err.status !== 401 && say(body, "error", err.text));
  return () => {
    live = false;
  };
}

function diffView(d) {
  const side = (name, id) => h("th", {}, `${name}: `, h("a", { href: `#${path("runs", id)}` }, short(id, 12)));
  const cellOf = (entry) =>
    entry ? h("td", { class: `diff-cell k-${entry.kind}` }, h("span", { class: "seq" }, `#${entry.seq}`), " ", entry.text) : h("td", { class: "diff-cell none" }, "—");
  const outcome = (o) => [badge(o.status), o.error ? h("span", { class: "error-text" }, ` ${o.error}`) : jsonBlock(o.output, "Output")];
  return [
    ...d.steps.map((s) =>
      h(
        "section",
        { class: "diff-step", "data-step": s.step },
        h("h2", {}, `Step ${s.step}`),
        h("p", { class: "hint diff-common" }, `${s.common} ${s.common === 1 ? "entry" : "entries"} in common`, s.same ? " — the same" : ""),
        s.rows.length
          ? h(
              "table",
              { class: "diff" },
              h("thead", {}, h("tr", {}, side("a", d.a), side("b", d.b))),
              h("tbody", {}, ...s.rows.map((r) => h("tr", {}, cellOf(r.a), cellOf(r.b)))),
            )
          : null,
      ),
    ),
    h(
      "section",
      { class: "diff-outcome" },
      h("h2", {}, "Outcome", d.outcome.same ? " (the same)" : ""),
      h("table", { class: "diff" }, h("tbody", {}, h("tr", {}, h("td", { id: "outcome-a" }, outcome(d.outcome.a)), h("td", { id: "outcome-b" }, outcome(d.outcome.b))))),
    ),
  ];
}
