// A step's journal as a timeline: each record as it arrives, and beside them
// the live previews of model calls, each replaced by its record once
// committed, or kept and marked when abandoned.
//
// A record may hold more than one entry: the model response or the tool
// result stored just before its kind's, named by `leading` (a leading entry), and the
// claim of a dispatch handed over with the commit before it, `leading_claim`
// (the hand-over), ahead of both. Each entry is shown as a record of its own, with the
// record's sequence, in the order stored.
//
// What the timeline works out from the records:
// - which claim fenced which: a claim fences the holder before it when that
//   holder had not committed (its dispatch was still open);
// - a tool intent's fate: running until its result, then returned, failed, or
//   interrupted (started by a holder that did not finish it) with the partial
//   output that holder wrote;
// - a parallel group (the tool calls of one model response, run at once) is
//   one entry, its calls in the response's order, each with its own fate; an
//   intent is named by its record's sequence and its index in that record.

import { badge, fill, h, jsonBlock, short, when } from "./dom.js";
import { forkButton } from "./fork.js";

export class Timeline {
  constructor(records, live, where = null) {
    this.where = where; // { run, step }: each record gets a "fork from here"
    this.list = records; // <ol> of records (and abandoned previews)
    this.live = live; // <ol> of previews in flight
    this.seen = new Map(); // seq -> element
    this.models = new Map(); // seq -> the element of the record's model response
    this.intents = new Map(); // "seq.index" of an intent -> { el, name }
    this.holder = null; // the last claim whose writer has not committed: { writer, seq, el }
    this.iteration = null;
    this.streams = new Map(); // stream id -> preview
    this.recordOf = new Map(); // model record seq -> stream id, committed before the record came
    this.ended = null; // the step's end, once the journal said so
  }

  // ---- records ----------------------------------------------------------------

  record(rec) {
    if (this.seen.has(rec.seq)) return;
    if (rec.iteration !== this.iteration) {
      this.iteration = rec.iteration;
      this.list.append(h("li", { class: "iter", "data-iteration": rec.iteration }, `Iteration ${rec.iteration}`));
    }
    if (rec.leading_claim) this._entry({ ...rec, kind: "claim", claim: rec.leading_claim, leading: null, part: true });
    if (rec.leading) {
      const kind = rec.leading.replace(/^leading_/, "");
      this._entry({ ...rec, kind, [kind]: rec[rec.leading], leading: null, part: true });
    }
    this._entry(rec);
    const stream = this.recordOf.get(rec.seq);
    if (stream !== undefined) this._replace(stream, rec.seq);
  }

  /** One entry of a record; the record's first entry stands for its sequence. */
  _entry(rec) {
    const body = this[`_${rec.kind}`]?.(rec) ?? jsonBlock(rec[rec.kind]);
    const el = h(
      "li",
      { class: `rec k-${rec.kind}`, "data-seq": rec.seq, "data-kind": rec.kind, "data-writer": rec.writer },
      h(
        "div",
        { class: "rec-head" },
        h("span", { class: "seq" }, `#${rec.seq}`),
        h("span", { class: "kind" }, KIND[rec.kind] ?? rec.kind),
        h("span", { class: "who" }, `it ${rec.iteration} · attempt ${rec.attempt} · writer `, short(rec.writer)),
        when(rec.time),
      ),
      h("div", { class: "rec-body" }, body),
    );
    if (this.where && forkable(rec)) {
      el.querySelector(".rec-head").append(forkButton(this.where.run, this.where.step, rec.seq, el));
    }
    if (!this.seen.has(rec.seq)) this.seen.set(rec.seq, el);
    if (rec.kind === "model") this.models.set(rec.seq, el);
    this.list.append(el);
    this[`_after_${rec.kind}`]?.(rec, el);
  }

  _claim(rec) {
    const c = rec.claim;
    const parts = [h("span", {}, `Claimed by writer `, short(rec.writer), ` (worker ${c.worker_id || "?"}, delivery ${c.delivery})`)];
    const fenced = this.holder && this.holder.writer !== rec.writer ? this.holder : null;
    if (fenced) {
      parts.push(
        h("p", { class: "fence", "data-fenced-writer": fenced.writer, "data-fenced-claim": fenced.seq }, badge("fenced", "fenced"), " this claim fenced writer ", short(fenced.writer), ` (claim #${fenced.seq}), which had not committed`),
      );
      fenced.el.classList.add("fenced");
      fenced.el
        .querySelector(".rec-body")
        .append(h("p", { class: "fenced-by", "data-fenced-by": rec.seq }, badge("fenced", "fenced"), ` fenced by claim #${rec.seq} of writer `, short(rec.writer)));
    }
    return parts;
  }

  _fork(rec) {
    const f = rec.fork;
    return h(
      "p",
      { class: "forked" },
      `The ${f.copied} records before this one are copies of run `,
      h("a", { href: `#/runs/${encodeURIComponent(f.run_id)}/steps/${encodeURIComponent(f.step_id)}` }, short(f.run_id, 12)),
      `'s records of step ${f.step_id} through #${f.at_seq}; the step resumes here.`,
    );
  }

  _after_claim(rec, el) {
    this.holder = { writer: rec.writer, seq: rec.seq, el };
  }

  _model(rec) {
    const response = rec.model.response;
    // The answer's text, when the response has one, above the whole response.
    const text = typeof response === "string" ? response : typeof response?.text === "string" ? response.text : "";
    return [
      h("p", {}, `Model response (call position ${rec.model.position})`),
      text ? h("blockquote", { class: "model-text" }, text) : null,
      typeof response === "string" ? null : jsonBlock(response, "response"),
    ];
  }

  _tool_intent(rec) {
    const t = rec.tool_intent;
    const replay = t.replay === "safe" ? "safe" : "unsafe";
    return [
      h("p", {}, "Tool ", h("strong", { class: "tool-name" }, t.name), ` (call position ${t.position}) `, badge(replay, replay), " ", h("span", { class: "tool-state" }, badge("running", "running"))),
      t.honours_seq ? h("p", { class: "hint" }, `Honours intent #${t.honours_seq} of an earlier attempt: it is not run again.`) : null,
      t.digest && !t.approval ? h("p", { class: "hint approval-asked" }, "Needs approval of digest ", h("code", {}, t.digest)) : null,
      t.approval
        ? h(
            "p",
            { class: "hint approval-given" },
            badge(t.approval.approved ? "approved" : "denied", t.approval.approved ? "completed" : "failed"),
            ` by ${t.approval.approver || "someone"} for call ${t.approval.call}`,
            t.approval.edited ? " with edited arguments" : "",
            t.approval.reason ? `: ${t.approval.reason}` : "",
          )
        : null,
      jsonBlock(t.input, "input"),
      h("div", { class: "so-far", hidden: true }, h("p", { class: "hint" }, "Output so far:"), h("pre", { class: "partial" })),
    ];
  }

  _after_tool_intent(rec, el) {
    this.intents.set(`${rec.seq}.0`, { el, name: rec.tool_intent.name, label: `#${rec.seq}` });
  }

  _tool_intents(rec) {
    const g = rec.tool_intents;
    const calls = g.intents.map((t, index) => {
      const replay = t.replay === "safe" ? "safe" : "unsafe";
      return h(
        "li",
        { class: "group-call", "data-index": index, "data-position": t.position },
        h("p", {}, "Tool ", h("strong", { class: "tool-name" }, t.name), ` (call position ${t.position}) `, badge(replay, replay), " ", h("span", { class: "tool-state" }, badge("running", "running"))),
        t.honours_seq ? h("p", { class: "hint" }, `Honours intent #${t.honours_seq} of an earlier attempt: it is not run again.`) : null,
        jsonBlock(t.input, "input"),
        h("div", { class: "so-far", hidden: true }, h("p", { class: "hint" }, "Output so far:"), h("pre", { class: "partial" })),
      );
    });
    const part = g.intents.length < g.group_size ? ` (${g.intents.length} of them in this record)` : "";
    return [
      h("p", {}, badge("parallel", "parallel"), ` ${g.group_size} tool calls of one model response, run at once from call position ${g.group_position}${part}`),
      h("ol", { class: "group-calls" }, ...calls),
    ];
  }

  _after_tool_intents(rec, el) {
    el.querySelectorAll(".group-call").forEach((call, index) => {
      const { name, position } = rec.tool_intents.intents[index];
      this.intents.set(`${rec.seq}.${index}`, { el: call, name, label: `#${rec.seq}, call position ${position}` });
    });
  }

  _tool_output(rec) {
    const o = rec.tool_output;
    const intent = this.intents.get(`${o.intent_seq}.${o.intent_index ?? 0}`);
    if (intent) {
      intent.el.querySelector(".so-far").hidden = false;
      intent.el.querySelector(".partial").textContent += o.chunk;
    }
    const label = intent ? `${intent.name} (${intent.label})` : `#${o.intent_seq}`;
    return [h("p", {}, `Partial output of ${label}: `), h("pre", { class: "chunk" }, o.chunk)];
  }

  _tool_result(rec) {
    const r = rec.tool_result;
    const intent = this.intents.get(`${r.intent_seq}.${r.intent_index ?? 0}`);
    const name = intent ? intent.name : "tool";
    const label = intent ? intent.label : `#${r.intent_seq}`;
    let state;
    let body;
    if (r.awaiting_approval) {
      state = badge("awaiting approval", "waiting");
      body = [h("p", {}, `${name} (#${r.intent_seq}) waits for approval; it did not run.`)];
    } else if (r.interrupted) {
      state = badge("interrupted", "interrupted");
      body = [
        h("p", {}, badge("interrupted", "interrupted"), ` ${name} (${label}) was started by a holder that did not finish it; it is not run again.`),
        h("p", {}, "Partial output it wrote:"),
        h("pre", { class: "partial-output" }, r.partial || "(none)"),
      ];
    } else if (r.error) {
      state = badge("tool error", "failed");
      body = [h("p", {}, `${name} (${label}) failed: `), h("pre", { class: "error-text" }, r.error)];
    } else {
      state = badge("returned", "completed");
      body = [h("p", {}, `${name} (${label}) returned`), jsonBlock(r.output, "output")];
    }
    if (intent) fill(intent.el.querySelector(".tool-state"), state, ` → #${rec.seq}`);
    return body;
  }

  _input_placed(rec) {
    const p = rec.input_placed;
    return [
      h("p", {}, `${p.mode === "follow_up" ? "Follow-up" : "Steer"} input `, h("code", { class: "request-id" }, p.request_id), ` placed (call position ${p.position})`, p.carried ? " · carried from an earlier attempt" : ""),
      jsonBlock(p.content, "content"),
    ];
  }

  _commit(rec) {
    const c = rec.commit;
    const out = [h("p", {}, "Commit: ", badge(c.action, `a-${c.action}`))];
    if (c.wait_delay) out.push(h("p", {}, `then wait ${c.wait_delay}`));
    if (c.wait_until) out.push(h("p", {}, "then wait until ", when(c.wait_until)));
    if (c.wait_until_input) out.push(h("p", {}, "then wait for an input"));
    if (c.pause) out.push(h("p", {}, `pause ${c.pause}`));
    if (c.error) out.push(h("pre", { class: "error-text" }, c.reason ? `${c.reason}: ${c.error}` : c.error));
    if (c.action === "continue" || c.action === "complete") out.push(jsonBlock(c.output, "output"));
    if (c.state_delta) {
      // The state chain: the state as what this turn changed of the one before.
      const d = c.state_delta;
      out.push(h("p", { class: "state-delta" }, `state: the first ${d.keep} bytes of the one before, then ${d.tail.length} characters (${d.size} bytes in all; delta ${d.depth} after its snapshot)`));
      out.push(h("pre", { class: "state-tail" }, d.tail));
    } else if (c.has_state) out.push(jsonBlock(c.state, "state"));
    return out;
  }

  _after_commit(rec) {
    if (this.holder && this.holder.writer === rec.writer) this.holder = null;
  }

  end(data) {
    this.ended = h("li", { class: "rec k-end", id: "step-end" }, "Step finished: ", badge(data.step_status), ` · run ${data.run_status}`);
    this.list.append(this.ended);
  }

  /** No more preview events will come: a preview still streaming was never recorded. */
  settle() {
    for (const [id, p] of [...this.streams]) {
      if (p.el.dataset.state === "streaming") this._abandon(id, "the step ended before it was recorded");
    }
  }

  // ---- live previews ----------------------------------------------------------

  _preview(ev) {
    const id = ev.stream ?? `${ev.writer}.${ev.position}`;
    let p = this.streams.get(id);
    if (p) return p;
    const text = h("pre", { class: "tokens" });
    const state = h("span", { class: "stream-state" }, badge("streaming", "streaming"));
    const el = h(
      "li",
      { class: "rec k-stream", "data-stream": id, "data-state": "streaming" },
      h(
        "div",
        { class: "rec-head" },
        h("span", { class: "kind" }, "model call, live"),
        h("span", { class: "who" }, `it ${ev.iteration} · attempt ${ev.attempt} · position ${ev.position} · writer `, short(ev.writer)),
        state,
      ),
      ev.retry_of ? h("p", { class: "hint" }, "retry of the abandoned stream ", short(ev.retry_of, 20)) : null,
      text,
    );
    p = { id, el, text, state };
    this.streams.set(id, p);
    this.live.append(el);
    return p;
  }

  stream(type, ev) {
    if (type === "token") {
      const p = this._preview(ev);
      p.text.textContent += ev.text ?? JSON.stringify(ev.json);
    } else if (type === "gap") {
      this._preview(ev).text.append(h("span", { class: "gap" }, ` [${ev.dropped} chunk(s) not shown] `));
    } else if (type === "committed") {
      const id = ev.stream ?? `${ev.writer}.${ev.position}`;
      if (!this.streams.has(id)) return; // a late reader: the record says it all
      if (this.seen.has(ev.record_seq)) this._replace(id, ev.record_seq);
      else {
        this.recordOf.set(ev.record_seq, id);
        const p = this.streams.get(id);
        p.el.dataset.state = "committed";
        fill(p.state, badge(`committed as #${ev.record_seq}`, "completed"));
      }
    } else if (type === "abandoned") {
      const id = ev.stream ?? `${ev.writer}.${ev.position}`;
      if (this.streams.has(id)) this._abandon(id, ev.reason === "superseded" ? "its writer was fenced by a new claim" : "the model call failed");
    }
  }

  _replace(id, seq) {
    const p = this.streams.get(id);
    this.recordOf.delete(seq);
    if (!p) return;
    this.streams.delete(id);
    p.el.remove();
    // The model entry, which a claim stored with it may precede (a hand-over or a riding claim).
    const rec = this.models.get(seq) ?? this.seen.get(seq);
    rec.classList.add("from-stream");
    rec.querySelector(".rec-body").prepend(h("p", { class: "hint replaced" }, `Streamed live (${p.text.textContent.length} characters); this record replaced the preview.`));
  }

  _abandon(id, why) {
    const p = this.streams.get(id);
    this.streams.delete(id);
    p.el.dataset.state = "abandoned";
    p.el.classList.add("abandoned");
    fill(p.state, badge("abandoned", "abandoned"));
    p.el.append(h("p", { class: "hint" }, `Abandoned: ${why}. A preview is not a record; this text was not recorded.`));
    // It stays, in order, among the records (before the step's end).
    if (this.ended) this.list.insertBefore(p.el, this.ended);
    else this.list.append(p.el);
  }
}

// A record a run can resume after: its last entry (a record's leading entries
// are copied with it), neither a cancel nor a commit that ends the step or its
// attempt.
function forkable(rec) {
  if (rec.part || rec.kind === "cancel") return false;
  return rec.kind !== "commit" || rec.commit.action === "continue";
}

const KIND = {
  claim: "claim",
  model: "model call",
  tool_intent: "tool intent",
  tool_intents: "parallel tool calls",
  tool_output: "tool output",
  tool_result: "tool result",
  input_placed: "input placed",
  commit: "commit",
  fork: "fork",
};
