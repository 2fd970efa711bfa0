// The worker: polls the engine for tasks and runs one handler per task, as
// sdk/dagnats/sdk/_worker.py does.
//
// Invariants:
// - The poll loop never runs a handler itself and never dies of an engine
//   error: a failed poll is logged and retried after a jittered backoff.
// - At most `concurrency` handlers run at once; a poll asks for exactly the
//   free slots, so the worker never leases a task it cannot start.
// - While a handler runs, a heartbeat goes out every third of the lease. Once
//   the journal is claimed, each heartbeat is preceded by a CheckTail: only a holder
//   may extend the lease (a zombie's heartbeat would extend its successor's).
//   Fenced, or a cancelled run, stops the handler.
// - Every task ends with exactly one report unless the handler settled it or
//   the journal did (a JournalSignal), or the holder was fenced: a fenced
//   holder reports nothing, since acknowledging would take the task from its
//   successor. A report that cannot be delivered is logged and dropped; the
//   lease then expires and the engine delivers the task again.
// - Stopping cancels the poll in flight; handlers still running after the
//   grace period are abandoned unreported (their leases expire).

import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { DagnatsError, Fenced, JournalSignal, PermanentError } from './errors.js';
import { EngineRpc, duration } from './rpc.js';
import { TaskContext } from './task.js';

const NOT_SETTLED = 'handler returned without calling continue, complete or fail';
// Refusals no retry can get past (a record too large for the journal, another
// call than the one recorded at a position, an invalid argument): a handler
// that lets one through fails its step for good, with the refusal's message.
const REFUSALS = new Set(['invalid_argument', 'record_too_large', 'replay_mismatch']);
const ASSUMED_LEASE = 30; // seconds, when the engine does not say
const MIN_HEARTBEAT = 0.05;
const POLL_BACKOFF = 0.2;
const POLL_BACKOFF_MAX = 10;

export class Worker {
  #rpc;
  #handlers;
  #concurrency;
  #pollWait;
  #heartbeatInterval;
  #restartLimit;
  #inflight = new Set();
  #stopping = new AbortController();
  #stopped = once(this.#stopping.signal);

  // handlers: { [taskType]: async (tc) => {...} }. Times are in seconds.
  constructor(
    target,
    {
      handlers,
      concurrency = 4,
      pollWait = 5,
      rpcTimeout = 10,
      heartbeatInterval = null,
      restartLimit = 5,
      workerId = `${hostname()}-${process.pid}-${randomBytes(3).toString('hex')}`,
      // The build of this code: a step's first commit pins it to this build.
      buildId = process.env.DAGNATS_BUILD_ID ?? '',
    },
  ) {
    this.#rpc = new EngineRpc(target, { timeout: rpcTimeout });
    this.#handlers = handlers;
    this.#concurrency = concurrency;
    this.#pollWait = pollWait;
    this.#heartbeatInterval = heartbeatInterval;
    this.#restartLimit = restartLimit;
    this.workerId = workerId;
    this.buildId = buildId;
  }

  // Polls and runs handlers until stop().
  async run() {
    log(`worker ${this.workerId} polling for ${Object.keys(this.#handlers).join(', ')}`);
    let failures = 0;
    while (!this.#stopping.signal.aborted) {
      const free = await this.#freeSlots();
      if (free === 0) continue; // stopping
      let leased;
      try {
        leased = await this.#poll(free);
      } catch (err) {
        if (this.#stopping.signal.aborted) break;
        const delay = backoff(++failures);
        warn(`polling the engine failed (${err.message}); retrying in ${delay.toFixed(2)}s`);
        await pause(delay, this.#stopping.signal);
        continue;
      }
      failures = 0;
      for (const task of leased) this.#start(task);
    }
  }

  // Stops polling, gives running handlers `grace` seconds, then returns.
  async stop({ grace = 10 } = {}) {
    this.#stopping.abort();
    const finished = Promise.allSettled(this.#inflight).then(() => true);
    if (!(await Promise.race([finished, pause(grace).then(() => false)]))) {
      warn(`abandoning ${this.#inflight.size} handler(s) still running; their leases will expire`);
    }
    this.#rpc.close();
  }

  async #freeSlots() {
    while (this.#inflight.size >= this.#concurrency && !this.#stopping.signal.aborted) {
      await Promise.race([...this.#inflight, this.#stopped]);
    }
    return this.#stopping.signal.aborted ? 0 : this.#concurrency - this.#inflight.size;
  }

  async #poll(maxTasks) {
    const request = {
      task_types: Object.keys(this.#handlers),
      max_tasks: maxTasks,
      wait: duration(this.#pollWait),
      worker_id: this.workerId,
      build_id: this.buildId,
    };
    // The engine holds a poll up to pollWait, so the deadline is on top of that.
    const deadline = this.#pollWait + this.#rpc.timeout;
    const response = await this.#rpc.call('pollTasks', request, {
      deadline,
      signal: this.#stopping.signal,
    });
    return response.tasks;
  }

  #start(leased) {
    const running = this.#execute(leased)
      .catch((err) => warn(`task runner failed: ${err.stack}`))
      .finally(() => this.#inflight.delete(running));
    this.#inflight.add(running);
  }

  async #execute(leased) {
    const tc = new TaskContext(leased, this.#rpc, {
      workerId: this.workerId,
      restartLimit: this.#restartLimit,
      buildId: this.buildId,
    });
    log(`leased ${name(tc)} delivery ${tc.delivery}`);
    const handler = this.#handlers[tc.taskType];
    if (!handler) {
      await report(tc.fail(`worker ${this.workerId} has no handler for ${tc.taskType}`));
      return;
    }
    const beats = new AbortController();
    const keepAlive = this.#keepAlive(tc, beats.signal);
    let error = null;
    try {
      await handler(tc);
    } catch (err) {
      error = err;
    } finally {
      beats.abort();
      await keepAlive;
    }
    try {
      await this.#conclude(tc, error);
    } finally {
      tc.close();
    }
  }

  async #keepAlive(tc, stopped) {
    const interval =
      this.#heartbeatInterval ?? Math.max((tc.leaseDuration || ASSUMED_LEASE) / 3, MIN_HEARTBEAT);
    while (await pause(interval, stopped)) {
      if (tc.settled) return; // the lease is spent; nothing left to keep alive
      try {
        if (tc.journaled) await tc.journaled.checkTail(stopped);
        if (await tc.beat(stopped)) {
          log(`run ${tc.runId} was cancelled; stopping ${name(tc)}`);
          tc.abort(`run ${tc.runId} was cancelled`);
          return;
        }
      } catch (err) {
        if (stopped.aborted) return;
        if (err instanceof Fenced) {
          warn(`${name(tc)}: a successor holds the step; stopping`);
          tc.abort('a successor holds the step');
          return;
        }
        // The next beat may get through; the lease is longer than the interval.
        warn(`heartbeat for ${name(tc)} failed: ${err.message}`);
      }
    }
  }

  // How the task ends when the handler did not settle it.
  async #conclude(tc, err) {
    if (tc.fenced) {
      log(`${name(tc)}: fenced; the task is its successor's, nothing reported`);
      return;
    }
    if (err instanceof JournalSignal) {
      log(`${name(tc)}: settled by the journal (${err.message})`);
      return;
    }
    if (tc.settled) {
      if (err) warn(`handler for ${tc.taskType} threw after settling its task: ${err.message}`);
      return;
    }
    if (tc.cancelled) {
      // The engine drops any outcome of a cancelled run: the task is let go.
      await report(tc.giveUpCancelled());
    } else if (err instanceof PermanentError) {
      await report(tc.failPermanent(err, { reason: err.reason }));
    } else if (err instanceof DagnatsError && REFUSALS.has(err.code)) {
      warn(`handler for ${tc.taskType} was refused: ${err.message}`);
      await report(tc.failPermanent(err, { reason: err.code }));
    } else if (err) {
      warn(`handler for ${tc.taskType} failed: ${err.stack}`);
      await report(tc.fail(err));
    } else {
      await report(tc.fail(NOT_SETTLED));
    }
  }
}

async function report(settle) {
  try {
    await settle;
  } catch (err) {
    warn(
      `could not report a task (${err.message}); its lease will expire ` +
        'and the engine will deliver it again',
    );
  }
}

// Sleeps `secs`; false when `signal` fired first.
async function pause(secs, signal) {
  try {
    await sleep(secs * 1000, undefined, { signal });
    return true;
  } catch {
    return false;
  }
}

function once(signal) {
  return new Promise((resolve) => signal.addEventListener('abort', resolve, { once: true }));
}

function backoff(failures) {
  const ceiling = Math.min(POLL_BACKOFF_MAX, POLL_BACKOFF * 2 ** Math.min(failures, 16));
  return ceiling / 2 + (Math.random() * ceiling) / 2;
}

function name(tc) {
  return `${tc.runId}/${tc.stepId} (${tc.iteration}, ${tc.attempt})`;
}

export function log(message) {
  console.log(`${new Date().toISOString()} ${message}`);
}

export function warn(message) {
  console.warn(`${new Date().toISOString()} WARN ${message}`);
}
