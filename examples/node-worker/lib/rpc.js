// The one place the worker speaks gRPC, as sdk/dagnats/sdk/_rpc.py is for the
// Python SDK. It loads the contracts from the repository's proto/ directory at
// start-up (no generated code), opens one channel to the engine (which also
// serves the journal), and turns every failed call into an error from
// ./errors.js, so nothing else sees a gRPC status.
//
// Invariants:
// - Every call carries a deadline.
// - UNAVAILABLE and RESOURCE_EXHAUSTED are retried with jittered exponential
//   backoff, and DEADLINE_EXCEEDED too for calls that are safe to repeat; when
//   the tries run out the caller gets Unavailable. Any other status is a
//   domain error and is never retried.
// - ABORTED (error code "fenced") becomes Fenced: a successor holds the step.
// - A call given an AbortSignal is cancelled when the signal fires, and rejects
//   with the signal's reason.
//
// Messages keep the proto's field names (run_id, journal_seq, ...); 64-bit
// integers are strings, enums are their names, bytes are Buffers.

import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';
import { DagnatsError, Fenced, Unavailable } from './errors.js';

const PROTO_ROOT = fileURLToPath(new URL('../../../proto/', import.meta.url));
const definition = protoLoader.loadSync(
  ['dagnats/engine/v1/engine.proto', 'dagnats/journal/v1/journal.proto'],
  {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // the proto's field names: run_id, journal_seq, ...
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true, // a oneof's name holds the field that is set: response.outcome === 'settled'
  },
);
const { dagnats } = grpc.loadPackageDefinition(definition);

// Method -> [service, RPC, safe to repeat]. Claim appends a claim record and
// PollTasks leases tasks, so a try that timed out on our side may have been
// applied: those two are not repeated on DEADLINE_EXCEEDED. The journal's
// writes are safe to repeat: a retry with the same token resolves to the
// record the first try wrote (services/journal/dagnats/journal/store.py).
const METHODS = {
  pollTasks: ['engine', 'PollTasks', false],
  heartbeat: ['engine', 'Heartbeat', true],
  report: ['engine', 'Report', true],
  claim: ['journal', 'Claim', false],
  beginModel: ['journal', 'BeginModel', true],
  recordModel: ['journal', 'RecordModel', true],
  beginTool: ['journal', 'BeginTool', true],
  toolOutput: ['journal', 'ToolOutput', true],
  finishTool: ['journal', 'FinishTool', true],
  hold: ['journal', 'Hold', true],
  commit: ['journal', 'Commit', true],
};

const TRANSIENT = new Set([grpc.status.UNAVAILABLE, grpc.status.RESOURCE_EXHAUSTED]);
const ATTEMPTS = 5;
const BACKOFF = 0.1; // seconds; the wait before try n is random in [0, BACKOFF * 2^n]
const MAX_BACKOFF = 2.0;

export class EngineRpc {
  constructor(target, { timeout = 10 } = {}) {
    this.timeout = timeout;
    const credentials = grpc.credentials.createInsecure();
    const engine = new dagnats.engine.v1.EngineService(target, credentials);
    // Both services are on the engine's port: one channel carries both.
    const journal = new dagnats.journal.v1.JournalService(target, credentials, {
      channelOverride: engine.getChannel(),
    });
    this.clients = { engine, journal };
  }

  close() {
    this.clients.engine.close();
  }

  // Calls `method` (a key of METHODS) with retries; `deadline` in seconds
  // replaces the default timeout (PollTasks waits on the server first).
  async call(method, request, { signal, deadline = this.timeout } = {}) {
    const [service, rpc, idempotent] = METHODS[method];
    const client = this.clients[service];
    for (let attempt = 1; ; attempt++) {
      signal?.throwIfAborted();
      try {
        return await unary(client, rpc, request, deadline, signal);
      } catch (err) {
        if (signal?.aborted) throw signal.reason;
        const transient =
          TRANSIENT.has(err.code) || (idempotent && err.code === grpc.status.DEADLINE_EXCEEDED);
        if (!transient) throw domainError(rpc, err);
        if (attempt >= ATTEMPTS) {
          throw new Unavailable(`${rpc} failed ${attempt} times; last: ${err.details}`, {
            status: err.code,
          });
        }
        const wait = Math.random() * Math.min(MAX_BACKOFF, BACKOFF * 2 ** attempt);
        await sleep(wait * 1000, undefined, { signal });
      }
    }
  }
}

function unary(client, rpc, request, deadline, signal) {
  return new Promise((resolve, reject) => {
    const cancel = () => call.cancel();
    const options = { deadline: Date.now() + deadline * 1000 };
    const call = client[rpc](request, options, (err, response) => {
      signal?.removeEventListener('abort', cancel);
      if (err) reject(err);
      else resolve(response);
    });
    signal?.addEventListener('abort', cancel, { once: true });
  });
}

// The service's error code travels in trailing metadata
// (core/dagnats/core/grpcutil.py); the status is the fallback.
function domainError(rpc, err) {
  const [code = ''] = err.metadata?.get('dagnats-error-code') ?? [];
  const message = `${rpc}: ${err.details || grpc.status[err.code]}`;
  if (code === 'fenced' || err.code === grpc.status.ABORTED) return new Fenced(message);
  return new DagnatsError(message, { status: err.code, code: String(code) });
}

// A protobuf Duration as seconds.
export function seconds(duration) {
  return duration ? Number(duration.seconds) + duration.nanos / 1e9 : 0;
}

// Seconds as a protobuf Duration.
export function duration(secs) {
  const whole = Math.floor(secs);
  return { seconds: String(whole), nanos: Math.round((secs - whole) * 1e9) };
}

// JSON in and out of the contracts' bytes fields; empty bytes are null.
export function encode(value) {
  return Buffer.from(JSON.stringify(value ?? null));
}

export function decode(bytes) {
  return bytes?.length ? JSON.parse(bytes.toString('utf8')) : null;
}
