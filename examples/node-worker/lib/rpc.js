// The one place the worker speaks gRPC, as sdk/dagnats/sdk/_rpc.py is for the
// Python SDK. It loads the contracts from the repository's proto/ directory at
// start-up (no generated code), opens one channel to the engine (which also
// serves the journal), and turns every failed call into an error from
// ./errors.js, so nothing else sees a gRPC status.
//
// Invariants:
// - Every call carries a deadline.
// - UNAVAILABLE, CANCELLED (a stopping server's, for a call it accepted but
//   had not begun; a call this worker cancels rejects with its signal's reason
//   first) and RESOURCE_EXHAUSTED are retried with jittered exponential
//   backoff, and DEADLINE_EXCEEDED too for calls that are safe to repeat; when
//   the tries run out the caller gets Unavailable. Any other status is a
//   domain error and is never retried.
// - ABORTED (error code "fenced") becomes Fenced: a successor holds the step.
// - A call given an AbortSignal is cancelled when the signal fires, and rejects
//   with the signal's reason.
//
// - Credentials: a bearer token (`authorization: Bearer ...` on every call,
//   streams included) and TLS files (the engine's CA; a client certificate
//   and key for mTLS), by default from DAGNATS_TOKEN and DAGNATS_TLS_CA,
//   DAGNATS_TLS_CERT, DAGNATS_TLS_KEY, as the Python SDK reads them.
//
// Messages keep the proto's field names (run_id, journal_seq, ...); 64-bit
// integers are strings, enums are their names, bytes are Buffers.

import { readFileSync } from 'node:fs';
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
  beginTools: ['journal', 'BeginTools', true],
  toolOutput: ['journal', 'ToolOutput', true],
  finishTool: ['journal', 'FinishTool', true],
  checkTail: ['journal', 'CheckTail', true],
  commit: ['journal', 'Commit', true],
};

const TRANSIENT = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.CANCELLED,
  grpc.status.RESOURCE_EXHAUSTED,
]);
const ATTEMPTS = 5;
const BACKOFF = 0.1; // seconds; the wait before try n is random in [0, BACKOFF * 2^n]
const MAX_BACKOFF = 2.0;

// The token and TLS files from the environment (empty values are unset).
export function credentialsFromEnv(env = process.env) {
  return {
    token: env.DAGNATS_TOKEN || undefined,
    ca: env.DAGNATS_TLS_CA || undefined,
    cert: env.DAGNATS_TLS_CERT || undefined,
    key: env.DAGNATS_TLS_KEY || undefined,
  };
}

export class EngineRpc {
  // credentials: { token, ca, cert, key } (file paths); TLS when ca or cert is set.
  constructor(target, { timeout = 10, credentials = credentialsFromEnv() } = {}) {
    this.timeout = timeout;
    const { token, ca, cert, key } = credentials;
    if (Boolean(cert) !== Boolean(key)) {
      throw new DagnatsError('a client certificate needs its key (DAGNATS_TLS_CERT and _KEY)');
    }
    const read = (path) => (path ? readFileSync(path) : null);
    const channel =
      ca || cert
        ? grpc.credentials.createSsl(read(ca), read(key), read(cert))
        : grpc.credentials.createInsecure();
    // The token goes in every call's metadata: call credentials cannot be
    // composed with a plaintext channel, which `dagnats dev` serves.
    const options = token ? { interceptors: [withToken(token)] } : {};
    const engine = new dagnats.engine.v1.EngineService(target, channel, options);
    // Both services are on the engine's port: one channel carries both.
    const journal = new dagnats.journal.v1.JournalService(target, channel, {
      ...options,
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
    const [service, rpc] = METHODS[method];
    const client = this.clients[service];
    return this.retrying(method, () => unary(client, rpc, request, deadline, signal), signal);
  }

  // `await attempt()`, tried again by the rules at the top. `attempt` rejects
  // with a gRPC error (`code`, `details`, `metadata`) when the transport
  // failed, or with an error of ./errors.js, which is passed on untouched.
  async retrying(method, attempt, signal) {
    const [, rpc, idempotent] = METHODS[method];
    for (let tries = 1; ; tries++) {
      signal?.throwIfAborted();
      try {
        return await attempt();
      } catch (err) {
        if (signal?.aborted) throw signal.reason;
        if (err instanceof DagnatsError || err instanceof Fenced) throw err;
        // A status with a dagnats error code is a refusal (a record over the
        // journal's maximum is RESOURCE_EXHAUSTED too): trying again cannot help.
        const refused = (err.metadata?.get('dagnats-error-code') ?? []).length > 0;
        const transient =
          !refused &&
          (TRANSIENT.has(err.code) || (idempotent && err.code === grpc.status.DEADLINE_EXCEEDED));
        if (!transient) throw domainError(rpc, err);
        if (tries >= ATTEMPTS) {
          throw new Unavailable(`${rpc} failed ${tries} times; last: ${err.details}`, {
            status: err.code,
          });
        }
        const wait = Math.random() * Math.min(MAX_BACKOFF, BACKOFF * 2 ** tries);
        await sleep(wait * 1000, undefined, { signal });
      }
    }
  }
}

function withToken(token) {
  return (options, nextCall) =>
    new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        metadata.set('authorization', `Bearer ${token}`);
        next(metadata, listener);
      },
    });
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
  return refusal(rpc, err.code, err.details, String(code));
}

function refusal(rpc, status, details, code) {
  const message = `${rpc}: ${details || grpc.status[status]}`;
  if (code === 'fenced' || status === grpc.status.ABORTED) return new Fenced(message);
  return new DagnatsError(message, { status, code });
}

// Each journal call's field in SessionRequest and SessionResponse.
const SESSION_FIELDS = {
  claim: 'claim',
  beginModel: 'begin_model',
  recordModel: 'record_model',
  beginTool: 'begin_tool',
  beginTools: 'begin_tools',
  toolOutput: 'tool_output',
  finishTool: 'finish_tool',
  checkTail: 'check_tail',
  commit: 'commit',
};

const STREAM_BUFFER = 1024; // chunks a live preview holds for a slow link before it drops
const COALESCE = 16 * 1024; // characters of text one waiting chunk may grow to

// One dispatch's journal calls on one JournalService.Session stream, as
// sdk/dagnats/sdk/_session.py: a message each way per call instead of a new
// call. Same interface as EngineRpc.call for the journal's methods.
// - One call at a time (the journal handle queues its calls, and the claim
//   comes before the handle exists), so the next answer is the pending call's.
// - A call whose answer did not arrive (timed out, aborted, the stream broke)
//   drops the stream: its answer would be taken for the next call's. The next
//   call opens a new one. EngineRpc's retry rules and deadline apply per try.
// - A refusal (a domain error) answers its call and the stream goes on.
export class JournalSession {
  #rpc;
  #stream = null;
  #pending = null; // the call waiting for its answer: { stream, id, settle }
  #sent = 0;

  constructor(rpc) {
    this.#rpc = rpc;
  }

  async call(method, request, { signal } = {}) {
    return this.#rpc.retrying(method, () => this.#exchange(method, request, signal), signal);
  }

  // A live preview of one call position (JournalService.PutStream), as
  // sdk/dagnats/sdk/_stream.py: `put` never waits. While grpc-js's write
  // buffer drains, chunks wait here, and a text chunk grows the waiting text
  // chunk before it (up to COALESCE characters), so text loses nothing; only
  // when STREAM_BUFFER chunks wait is a chunk dropped and counted, and the
  // next one carries `dropped`. `close` sends the rest, ends the call and
  // resolves once the service has published what was sent.
  putStream(token, position) {
    const waiting = []; // chunks not yet handed to grpc-js
    let closed = false;
    let seq = 0;
    let dropped = 0;
    let done;
    const finished = new Promise((resolve) => {
      done = resolve;
    });
    const call = this.#rpc.clients.journal.PutStream((err) => {
      if (err) console.error(`live stream of position ${position} ended: ${err.details}`);
      done();
    });
    const flush = () => {
      while (waiting.length > 0 && !call.writableNeedDrain) call.write(waiting.shift());
    };
    call.on('drain', flush);
    const queue = (chunk) => {
      seq += 1;
      waiting.push({ token, position, seq: String(seq), dropped: String(dropped), ...chunk });
      dropped = 0;
    };
    return {
      put(chunk) {
        if (closed) return;
        const last = waiting.at(-1);
        const text = typeof chunk === 'string';
        if (text && last?.text !== undefined && last.text.length + chunk.length <= COALESCE) {
          last.text += chunk;
          return;
        }
        if (waiting.length >= STREAM_BUFFER) {
          dropped += 1;
          return;
        }
        queue(text ? { text: chunk } : { json: encode(chunk) });
        flush();
      },
      async close({ abandon = false } = {}) {
        if (closed) return;
        closed = true;
        if (abandon) queue({ abandon: true });
        for (const request of waiting.splice(0)) call.write(request);
        call.end();
        await finished;
      },
    };
  }

  // Ends the stream once the dispatch has nothing left to send.
  close() {
    const stream = this.#stream;
    this.#stream = null;
    stream?.end();
  }

  #exchange(method, request, signal) {
    const field = SESSION_FIELDS[method];
    const stream = this.#open();
    const id = String(++this.#sent);
    return new Promise((resolve, reject) => {
      const settle = (err, answer) => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', aborted);
        this.#pending = null;
        if (err) {
          this.#drop(stream);
          reject(err);
        } else if (answer.id !== id || (answer.result !== field && answer.result !== 'error')) {
          this.#drop(stream);
          reject(broken(`${method}: answered out of turn`));
        } else if (answer.result === 'error') {
          const { status, message, code } = answer.error;
          reject(refusal(METHODS[method][1], status, message, code));
        } else {
          resolve(answer[field]);
        }
      };
      const aborted = () => settle(signal.reason);
      const timer = setTimeout(
        () => settle({ code: grpc.status.DEADLINE_EXCEEDED, details: `${method}: no answer` }),
        this.#rpc.timeout * 1000,
      );
      signal?.addEventListener('abort', aborted, { once: true });
      this.#pending = { stream, settle };
      stream.write({ id, trace_context: {}, [field]: request });
    });
  }

  #open() {
    if (this.#stream) return this.#stream;
    const stream = this.#rpc.clients.journal.Session();
    const lost = (err) => {
      if (this.#pending?.stream === stream) this.#pending.settle(err);
      this.#drop(stream);
    };
    stream.on('data', (answer) => {
      if (this.#pending?.stream === stream) this.#pending.settle(null, answer);
    });
    stream.on('error', (err) => lost(broken(`the session stream failed: ${err.details}`)));
    stream.on('end', () => lost(broken('the session stream ended')));
    this.#stream = stream;
    return stream;
  }

  #drop(stream) {
    if (this.#stream === stream) this.#stream = null;
    stream.cancel();
  }
}

// A stream that failed under a call: the call is tried again on a new one.
function broken(details) {
  return { code: grpc.status.UNAVAILABLE, details };
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
