// The journal handle a handler gets from `await tc.journal()`, as in
// sdk/dagnats/sdk/_journal.py.
//
// Every decision (reuse a recorded response, run a tool, record
// `interrupted`, honour an earlier attempt's unsafe intent) is made by the
// journal service's replay rules (services/journal/dagnats/journal/replay.py);
// this module only carries calls and results, counts positions and threads
// the writer token.
//
// Invariants:
// - Positions count every journaled call of the dispatch from 0, model and
//   tool calls alike, in the order the handler makes them.
// - One call at a time: calls are matched by position, so a second call while
//   one is running throws ConcurrentJournalUse instead of recording a race.
//   The calls of one model response run at once as one call, `tools`: a
//   parallel group, one position per call in the response's order.
// - Every write carries the WriterToken the previous write returned. Journal
//   RPCs, the heartbeat's CheckTail included, go out one at a time so that none
//   carries a token an earlier one of ours has already outdated.
// - After Fenced the handle writes nothing more.

import { ConcurrentJournalUse, DagnatsError, Fenced, describe } from './errors.js';
import { decode, encode } from './rpc.js';

// Whether running a tool twice is harmless.
export const Replay = Object.freeze({
  SAFE: 'REPLAY_SAFE', // a read, or a write keyed on the call's idempotency key
  UNSAFE: 'REPLAY_UNSAFE', // send a message, charge a card
});

export class Journal {
  #rpc;
  #token;
  #signal; // the handler's: cancels model and tool calls when it stops
  #position = 0;
  #busy = false;
  #fenced = false;
  #queue = Promise.resolve();

  constructor(rpc, token, signal) {
    this.#rpc = rpc;
    this.#token = token;
    this.#signal = signal;
  }

  get fenced() {
    return this.#fenced;
  }

  // The response recorded at this position, or `await fn()` recorded. A failed
  // `fn` records nothing: the error propagates.
  async model(fn) {
    return this.#turn(async (position) => {
      const begin = await this.#send('beginModel', (token) => ({ token, position }));
      if (begin.recorded) return decode(begin.response);
      const response = await fn();
      const data = encode(response);
      await this.#send('recordModel', (token) => ({ token, position, response: data }));
      return response;
    });
  }

  // As `model`, with a live preview: `fn(stream)` puts its tokens with
  // `stream.put(chunk)` (text, or any JSON value) while it runs. Readers see
  // them, then `committed` once the response is recorded, or `abandoned` when
  // `fn` fails (sdk/dagnats/sdk/_stream.py).
  async streamedModel(fn) {
    return this.#turn(async (position) => {
      const begin = await this.#send('beginModel', (token) => ({ token, position }));
      if (begin.recorded) return decode(begin.response);
      const live = this.#rpc.putStream(this.#token, position);
      let response;
      try {
        response = await fn(live);
      } catch (err) {
        await live.close({ abandon: true });
        throw err;
      }
      const data = encode(response);
      await live.close(); // every chunk is published before the record's marker
      await this.#send('recordModel', (token) => ({ token, position, response: data }));
      return response;
    });
  }

  // Runs a tool call durably: intent before, result after. `fn({ call, report,
  // signal })` returns the tool's output (JSON); `call.key` is
  // `{run}.{step}.{iteration}.{position}`, the same on every delivery: pass it
  // to systems that deduplicate. `report(text)` records partial output. An
  // error thrown by `fn` is the tool's own error, part of the result.
  //
  // Returns { output, error, interrupted, partial, replayed }.
  async tool(call, replay, fn) {
    return this.#turn(async (position) => {
      const { run_id, step_id, iteration } = this.#token;
      const keyed = { ...call, key: `${run_id}.${step_id}.${iteration}.${position}` };
      const input = encode(call.input);
      const begin = await this.#send('beginTool', (token) => ({
        token,
        position,
        name: call.name,
        input,
        replay,
      }));
      if (!begin.run) return { ...resultOf(begin.result), replayed: true };
      return this.#run(keyed, begin.intent_seq, fn);
    });
  }

  // Runs the tool calls of one model response at once: a parallel group.
  // `calls` is [{ call, replay, fn }] in the response's order; they take that
  // many positions. Every intent is stored (one BeginTools) before any call
  // starts, each result as its call finishes; the results come back in the
  // order of `calls`, each as `tool` returns it. On a replay each call follows
  // the rules of one call alone; another group at the position is a
  // ReplayMismatch. A call's thrown error is its own result; a signal
  // (Fenced, the run cancelled) stops the group.
  async tools(calls) {
    if (calls.length === 0) return [];
    return this.#turn(async (first) => {
      this.#position += calls.length - 1;
      const specs = calls.map(({ call, replay }) => ({
        name: call.name,
        input: encode(call.input),
        replay,
      }));
      const begun = await this.#send('beginTools', (token) => ({
        token,
        position: first,
        calls: specs,
      }));
      return Promise.all(
        calls.map(({ call, fn }, i) => {
          const answer = begun.calls[i];
          if (!answer.run) return { ...resultOf(answer.result), replayed: true };
          const keyed = { ...call, key: answer.key };
          return this.#run(keyed, answer.intent_seq, fn, answer.intent_index ?? 0);
        }),
      );
    });
  }

  async #run(call, intentSeq, fn, intentIndex = 0) {
    const at = { intent_seq: intentSeq, intent_index: intentIndex };
    const report = (chunk) => this.#send('toolOutput', (token) => ({ token, ...at, chunk }));
    let value;
    let error = '';
    try {
      value = await fn({ call, report, signal: this.#signal });
    } catch (err) {
      // Stopped (run cancelled, or fenced while reporting): nothing to record,
      // as when Python cancels the handler's task.
      if (this.#signal.aborted || err instanceof Fenced) throw err;
      error = describe(err);
    }
    let output = null;
    let invalid = null;
    if (!error) {
      try {
        output = encode(value);
      } catch (err) {
        invalid = err;
        error = `tool output is not JSON: ${err.message}`;
      }
    }
    try {
      await this.#send('finishTool', (token) => ({ token, ...at, output, error }));
    } catch (err) {
      if (!(err instanceof DagnatsError) || err.code !== 'record_too_large') throw err;
      // The tool ran and its output cannot be stored: answer its intent with
      // that error (a retry honours it rather than run an unsafe tool again),
      // then throw: every delivery would be refused the same way.
      const refused = `tool result not recorded: ${err.message}`;
      await this.#send('finishTool', (token) => ({ token, ...at, error: refused }));
      throw err;
    }
    if (invalid) throw invalid;
    return { output: decode(output), error, interrupted: false, partial: '', replayed: false };
  }

  // Throws Fenced unless this holder still owns the step (before a heartbeat).
  async checkTail(signal) {
    await this.#send('checkTail', (token) => ({ token }), signal);
  }

  // Stores the dispatch's commit; returns its sequence (a string).
  // Stores the commit; with the task's lease, the service then settles the task.
  async commit(commit, lease = '') {
    const done = await this.#send('commit', (token) => ({ token, commit, lease }), null);
    return done.commit_seq;
  }

  async #turn(body) {
    if (this.#busy) throw new ConcurrentJournalUse();
    this.#busy = true;
    const position = this.#position++;
    try {
      return await body(position);
    } finally {
      this.#busy = false;
    }
  }

  // One journal RPC, after the previous one finished, with the latest token;
  // a returned token replaces it. `signal` defaults to the handler's.
  async #send(method, build, signal = this.#signal) {
    const previous = this.#queue;
    let release;
    this.#queue = new Promise((resolve) => (release = resolve));
    try {
      await previous;
      if (this.#fenced) throw new Fenced(`${this.#where()}: fenced earlier; writing nothing`);
      const request = build(this.#token);
      const response = await this.#rpc.call(method, request, { signal: signal ?? undefined });
      if (response.token) this.#token = response.token;
      return response;
    } catch (err) {
      if (err instanceof Fenced) this.#fenced = true;
      throw err;
    } finally {
      release();
    }
  }

  #where() {
    return `journal.${this.#token.run_id}.${this.#token.step_id}`;
  }
}

function resultOf(result) {
  return {
    output: decode(result.output),
    error: result.error,
    interrupted: result.interrupted,
    partial: result.partial,
  };
}
