// Runs the example agent (./agent.js) in a worker until SIGINT or SIGTERM.
//
//   node main.js [task-type]
//
// Settings come from the environment:
//   DAGNATS_ENGINE       engine address; else the one in .dagnats/dev.json of
//                        the current directory (written by `dagnats dev`);
//                        else 127.0.0.1:7233
//   DAGNATS_TASK_TYPE    task type to poll for, when not given as an argument
//                        (default node-agent)
//   TOOL_STARTS_FILE     append a line per start of the unsafe tool here
//   MODEL_CALLS_FILE     append a line per model request here
//   MODEL_TOKEN_CHARS    characters per streamed token of the model (default 8)
//   MODEL_PARALLEL       1: the model asks for lookup_order and charge_card in
//                        one response, run at once (a parallel group)
//   HANG_IN_TOOL_MARKER  the first start of the tool creates this file and
//                        hangs (later starts, in any process, do not)
//   WORKER_CONCURRENCY   most handlers at once (default 4)
//   WORKER_POLL_WAIT     seconds one poll waits for tasks (default 5)
//   DAGNATS_TOKEN        bearer token with the worker role, when the engine
//                        needs credentials
//   DAGNATS_TLS_CA       PEM CA of the engine's certificate: connect with TLS
//   DAGNATS_TLS_CERT     PEM client certificate and its key, for mTLS
//   DAGNATS_TLS_KEY

import { readFileSync } from 'node:fs';
import { agentTurn, chargeCard, lookupOrder, scriptedModel } from './agent.js';
import { Worker, log } from './lib/worker.js';

const env = process.env;
const taskType = process.argv[2] || env.DAGNATS_TASK_TYPE || 'node-agent';
const target = env.DAGNATS_ENGINE || devEngine() || '127.0.0.1:7233';

const turn = agentTurn({
  model: scriptedModel({
    callsFile: env.MODEL_CALLS_FILE,
    tokenChars: Number(env.MODEL_TOKEN_CHARS || 8),
    parallel: env.MODEL_PARALLEL === '1',
  }),
  tools: {
    charge_card: chargeCard({
      startsFile: env.TOOL_STARTS_FILE,
      hangMarker: env.HANG_IN_TOOL_MARKER,
    }),
    lookup_order: lookupOrder({ startsFile: env.TOOL_STARTS_FILE }),
  },
});
const worker = new Worker(target, {
  handlers: { [taskType]: turn },
  concurrency: Number(env.WORKER_CONCURRENCY || 4),
  pollWait: Number(env.WORKER_POLL_WAIT || 5),
});

for (const signal of ['SIGINT', 'SIGTERM']) {
  process.once(signal, async () => {
    log(`${signal}: stopping`);
    await worker.stop({ grace: 10 });
    process.exit(0);
  });
}

log(`engine ${target}`);
await worker.run();

function devEngine() {
  try {
    return JSON.parse(readFileSync('.dagnats/dev.json', 'utf8')).engine;
  } catch {
    return undefined;
  }
}
