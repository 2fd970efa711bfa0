// The agent: one turn of a tool-using agent per iteration of an agent_loop
// step, journaled, as in tests/workers/matrix_worker.py and the spec's
// handler. The model is scripted; charge_card is unsafe (running it twice
// would charge twice), lookup_order safe. With `parallel`, the model asks for
// both in one response and they run at once, as one parallel group.

import { appendFileSync, writeFileSync } from 'node:fs';
import { PermanentError } from './lib/errors.js';
import { Replay } from './lib/journal.js';
import { log } from './lib/worker.js';

// One turn: claim the journal, load the conversation, ask the model, run the
// tool it picks and continue, or complete with its answer.
export function agentTurn({ model, tools }) {
  return async function turn(tc) {
    const j = await tc.journal(); // claims the step; fences earlier holders
    const history = tc.loadCheckpoint() ?? [tc.input];
    // Recorded, reused after a crash; its tokens stream to readers while it runs.
    const reply = await j.streamedModel((stream) => model(history, stream));
    if ('answer' in reply) {
      log(`${tc.runId}: answer ${JSON.stringify(reply.answer)}`);
      tc.checkpoint([...history, { reply }]);
      await tc.complete(reply.answer); // commits; the journal publishes the event
      return;
    }
    if (reply.tools) {
      // The calls of one response, at once; every intent stored before any starts.
      const calls = reply.tools.map(({ tool: name, input }) => {
        const tool = tools[name];
        if (!tool) throw new PermanentError(`the model asked for an unknown tool: ${name}`);
        return { call: { name, input }, replay: tool.replay, fn: tool.run };
      });
      const results = await j.tools(calls);
      const outcomes = results.map(({ output, error, interrupted, partial }, i) => {
        log(`${tc.runId}: ${reply.tools[i].tool} ${interrupted ? 'interrupted' : 'done'}`);
        return { output, error, interrupted, partial };
      });
      tc.checkpoint([...history, { reply, outcomes }]);
      await tc.continue({ tools: reply.tools.map((t) => t.tool) });
      return;
    }
    const tool = tools[reply.tool];
    if (!tool) throw new PermanentError(`the model asked for an unknown tool: ${reply.tool}`);
    // A call an earlier holder started and did not finish comes back
    // `interrupted` (with the partial output it reported) instead of running.
    const result = await j.tool({ name: reply.tool, input: reply.input }, tool.replay, tool.run);
    const { output, error, interrupted, partial } = result;
    const outcome = interrupted ? `interrupted, partial output ${JSON.stringify(partial)}` : 'done';
    log(`${tc.runId}: ${reply.tool} ${outcome}${result.replayed ? ' (from the journal)' : ''}`);
    tc.checkpoint([...history, { reply, output, error, interrupted, partial }]);
    await tc.continue({ tool: reply.tool, interrupted });
  };
}

// What a model would say: charge the order, then answer. A pure function of
// the conversation, so every process answers the same. Each request appends a
// line to `callsFile`, so a test can tell a reused response from a new request.
// It streams its reply's text `tokenChars` characters a token, all at once:
// faster than any link drains them.
export function scriptedModel({ callsFile, tokenChars = 8, parallel = false } = {}) {
  return async (history, stream) => {
    const turns = history.filter((entry) => entry?.reply).length;
    if (callsFile) appendFileSync(callsFile, `turn ${turns}\n`);
    const { order = 'A-1001', amount_cents = 4200 } = history[0] ?? {};
    const charge = { tool: 'charge_card', input: { order, amount_cents } };
    const lookup = { tool: 'lookup_order', input: { order } };
    const reply =
      turns > 0
        ? { answer: `Order ${order}: payment submitted.` }
        : parallel
          ? { tools: [lookup, charge] }
          : charge;
    // A real model streams its tokens; this one streams its reply's JSON text.
    const text = JSON.stringify(reply);
    for (let i = 0; i < text.length; i += tokenChars) stream?.put(text.slice(i, i + tokenChars));
    return reply;
  };
}

// The unsafe tool. Each start appends a line to `startsFile` before anything
// else, outside the journal, so a test can count starts. With `hangMarker`,
// the first start (the one that creates the marker file) reports partial
// output and then hangs, so a test can kill the process inside the tool.
export function chargeCard({ startsFile, hangMarker } = {}) {
  return {
    replay: Replay.UNSAFE,
    async run({ call, report, signal }) {
      if (startsFile) appendFileSync(startsFile, `${call.name} ${call.key}\n`);
      const { order, amount_cents } = call.input;
      await report(`charging ${amount_cents} cents for order ${order};`);
      if (hangMarker && createOnce(hangMarker)) {
        log(`${call.key}: hanging inside ${call.name} (HANG_IN_TOOL_MARKER)`);
        await aborted(signal); // until killed, or the run is cancelled
      }
      // A real payment API would take call.key as its idempotency key.
      return { charged: true, order, amount_cents, charge_id: call.key };
    },
  };
}

// The safe tool: reads the order. Each start appends a line to `startsFile`.
export function lookupOrder({ startsFile } = {}) {
  return {
    replay: Replay.SAFE,
    async run({ call }) {
      if (startsFile) appendFileSync(startsFile, `${call.name} ${call.key}\n`);
      return { order: call.input.order, status: 'open' };
    },
  };
}

function createOnce(path) {
  try {
    writeFileSync(path, `${process.pid}\n`, { flag: 'wx' });
    return true;
  } catch (err) {
    if (err.code === 'EEXIST') return false;
    throw err;
  }
}

function aborted(signal) {
  return new Promise((_, reject) => {
    signal.addEventListener('abort', () => reject(signal.reason), { once: true });
  });
}
