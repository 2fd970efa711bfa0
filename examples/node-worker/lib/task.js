// The context a handler gets for one leased task, as TaskContext in
// sdk/dagnats/sdk/_context.py (the journaled part of it).
//
// Invariants:
// - A task is settled at most once: the first continue, complete, fail or
//   failPermanent claims it before its RPCs are sent, so a second one throws
//   TaskAlreadySettled. A settle refused by the engine or the journal with a
//   domain error releases the claim: nothing was stored.
// - Once the journal is claimed, every settle is a commit that carries the
//   lease: the commit is the state of record, and the journal service then
//   publishes its event (journal_seq = the commit's sequence) and releases
//   the task.
// - A Claim answered `settled` runs nothing: the task is settled here (stale:
//   acknowledged; committed or restart_limit: the stored commit is reported)
//   and a JournalSignal is thrown for the handler to let through.

import {
  Cancelled,
  Committed,
  DagnatsError,
  Fenced,
  RestartLimit,
  Stale,
  TaskAlreadySettled,
  describe,
} from './errors.js';
import { Journal } from './journal.js';
import { JournalSession, decode, encode, seconds } from './rpc.js';

// A failure refused as too large for a journal record is committed again with
// its error cut to this many bytes, and without the state.
const FAILURE_ERROR_BYTES = 16 * 1024;

export class TaskContext {
  #leased;
  #rpc;
  #workerId;
  #buildId; // stamped on each commit: the engine pins the step to it
  #restartLimit;
  #journal = null;
  #session = null; // the journal calls' stream, from the claim to the commit
  #claimFenced = false;
  #state = null; // the checkpoint as JSON bytes; saved by the commit
  #settledAs = null;
  #cancelled = false;
  #stop = new AbortController();

  constructor(leased, rpc, { workerId, restartLimit, buildId = '' }) {
    this.#leased = leased;
    this.#rpc = rpc;
    this.#workerId = workerId;
    this.#restartLimit = restartLimit;
    this.#buildId = buildId;
  }

  // The task.
  get runId() { return this.#leased.task.run_id; }
  get stepId() { return this.#leased.task.step_id; }
  get taskType() { return this.#leased.task.task_type; }
  get iteration() { return this.#leased.task.iteration; }
  get attempt() { return this.#leased.task.attempt; }
  get delivery() { return this.#leased.delivery; }
  get input() { return decode(this.#leased.task.input); }
  // Seconds the lease lasts without a heartbeat (0 when the engine did not say).
  get leaseDuration() { return seconds(this.#leased.lease_duration); }

  // Fires when the handler must stop: the run was cancelled or a successor
  // holds the step. Pass it to anything long-running.
  get signal() { return this.#stop.signal; }
  get cancelled() { return this.#cancelled; }
  get settled() { return this.#settledAs !== null; }
  get fenced() { return this.#claimFenced || Boolean(this.#journal?.fenced); }
  get journaled() { return this.#journal; }

  // Claims this dispatch's journal; the same handle on later calls. Throws
  // Stale, Committed or RestartLimit after settling the task (see the top).
  async journal() {
    if (this.#journal) return this.#journal;
    this.#session ??= new JournalSession(this.#rpc);
    let response;
    try {
      response = await this.#session.call(
        'claim',
        {
          run_id: this.runId,
          step_id: this.stepId,
          iteration: this.iteration,
          attempt: this.attempt,
          delivery: this.delivery,
          worker_id: this.#workerId,
          restart_limit: this.#restartLimit,
          // Its records carry it: a step belongs to its first claim's build.
          build_id: this.#buildId,
          // With the lease, a claim answered `settled` is settled by the
          // journal service itself: no Report follows.
          lease: this.#leased.lease,
        },
        { signal: this.signal },
      );
    } catch (err) {
      // A claim that lost the race to a successor's claim: the task is theirs.
      if (err instanceof Fenced) this.#claimFenced = true;
      throw err;
    }
    if (response.outcome === 'settled') await this.#settledByJournal(response.settled);
    const { token, state, has_state } = response.claimed;
    this.#journal = new Journal(this.#session, token, this.signal);
    this.#state = has_state ? state : null;
    return this.#journal;
  }

  async #settledByJournal({ reason, commit, detail, task_settled }) {
    this.#settledAs = reason;
    const where = { runId: this.runId, stepId: this.stepId };
    if (task_settled) {
      const Signal = { stale: Stale, restart_limit: RestartLimit }[reason] ?? Committed;
      throw new Signal(`${reason}: ${detail}`, where);
    }
    if (reason === 'stale') {
      await this.#rpc.call('report', this.#request({ acknowledge: {} }));
      throw new Stale(`stale: ${detail}`, where);
    }
    // Committed by a holder that crashed before its event was published (or the restart
    // limit's failure, just committed): report that commit, under its own
    // dispatch identity and sequence.
    const [field, outcome] = outcomeOf(commit.commit);
    await this.#rpc.call('report', {
      lease: this.#leased.lease,
      run_id: this.runId,
      step_id: this.stepId,
      iteration: commit.iteration,
      attempt: commit.attempt,
      journal_seq: commit.seq,
      [field]: outcome,
    });
    const Signal = reason === 'restart_limit' ? RestartLimit : Committed;
    throw new Signal(`${reason}: ${detail}`, where);
  }

  // Checkpoints travel in the journal: the state the last commit carried, and
  // the state the next commit will carry.
  loadCheckpoint() {
    this.#requireJournal('loadCheckpoint');
    return this.#state === null ? null : decode(this.#state);
  }

  checkpoint(state) {
    this.#requireJournal('checkpoint');
    this.#state = encode(state);
  }

  // Settling.
  async continue(output = null) {
    await this.#settle('continue', { output: encode(output) });
  }

  async complete(output = null) {
    await this.#settle('complete', { output: encode(output) });
  }

  async fail(error, { reason = '' } = {}) {
    await this.#settle('fail', { error: describe(error), kind: 'FAILURE_KIND_RETRIABLE', reason });
  }

  // Lets go of the task of a cancelled run, which drops any outcome. A journaled
  // dispatch cannot commit (the journal refuses a cancelled run's writes, code
  // "cancelled"): its task is acknowledged instead.
  async giveUpCancelled() {
    if (!this.#journal) {
      await this.failPermanent(`run ${this.runId} was cancelled`, { reason: 'cancelled' });
      return;
    }
    this.#settledAs = 'acknowledge';
    await this.#rpc.call('report', this.#request({ acknowledge: {} }));
  }

  async failPermanent(error, { reason = '' } = {}) {
    await this.#settle('fail', { error: describe(error), kind: 'FAILURE_KIND_PERMANENT', reason });
  }

  async #settle(field, outcome) {
    if (this.#settledAs !== null) throw new TaskAlreadySettled(this.#settledAs);
    this.#settledAs = field;
    try {
      if (this.#journal) {
        // The commit carries the lease: once it is stored, the journal service
        // publishes its event and releases the task, so no Report follows.
        await this.#commit(field, outcome);
      } else {
        const response = await this.#rpc.call('report', this.#request({ [field]: outcome }));
        if (response.cancelled) this.#markCancelled();
      }
    } catch (err) {
      if (err instanceof DagnatsError) this.#settledAs = null; // nothing was stored
      throw err;
    }
  }

  async #commit(field, outcome) {
    const commit = this.#commitOf(field, outcome);
    try {
      await this.#journal.commit(commit, this.#leased.lease);
    } catch (err) {
      if (field !== 'fail' || !(err instanceof DagnatsError) || err.code !== 'record_too_large') {
        throw err;
      }
      // A failure must end its attempt whatever it carries. Nothing resumes
      // from a failure's state (a retry loads the commit that ended the
      // iteration before), so it goes again without it, its error cut.
      const error = Buffer.from(commit.error);
      const cut =
        error.length > FAILURE_ERROR_BYTES
          ? `${error.subarray(0, FAILURE_ERROR_BYTES - 64)}... (${error.length} bytes in all)`
          : commit.error;
      const small = { ...commit, has_state: false, state: Buffer.alloc(0), error: cut };
      await this.#journal.commit(small, this.#leased.lease);
    }
  }

  #commitOf(field, outcome) {
    const commit = {
      has_state: this.#state !== null,
      state: this.#state ?? Buffer.alloc(0),
      build_id: this.#buildId,
    };
    switch (field) {
      case 'continue':
        return { ...commit, action: 'ACTION_CONTINUE', output: outcome.output };
      case 'complete':
        return { ...commit, action: 'ACTION_COMPLETE', output: outcome.output };
      default: {
        const permanent = outcome.kind === 'FAILURE_KIND_PERMANENT';
        const action = permanent ? 'ACTION_FAIL_PERMANENT' : 'ACTION_FAIL';
        return { ...commit, action, error: outcome.error, reason: outcome.reason };
      }
    }
  }

  #request(fields) {
    return {
      lease: this.#leased.lease,
      run_id: this.runId,
      step_id: this.stepId,
      iteration: this.iteration,
      attempt: this.attempt,
      ...fields,
    };
  }

  #requireJournal(what) {
    if (!this.#journal) throw new Error(`${what} needs the journal: call await tc.journal() first`);
  }

  // For the worker.

  // Extends the lease; true once the engine says the run was cancelled.
  async beat(signal) {
    const response = await this.#rpc.call(
      'heartbeat',
      { lease: this.#leased.lease, run_id: this.runId },
      { signal },
    );
    if (response.cancelled) this.#markCancelled();
    return this.#cancelled;
  }

  // Ends the journal's stream once the task is settled: nothing is left to write.
  close() {
    this.#session?.close();
  }

  // Tells the handler to stop: in-flight calls are cancelled, journal calls refused.
  abort(why) {
    this.#stop.abort(new Cancelled(why));
  }

  #markCancelled() {
    this.#cancelled = true;
  }
}

// The report that carries a stored commit to the engine, as outcome_of in
// sdk/dagnats/sdk/_context.py: [oneof field of ReportRequest, its message].
export function outcomeOf(commit) {
  switch (commit.action) {
    case 'ACTION_CONTINUE': {
      const outcome = { output: commit.output };
      if (commit.wait_delay || commit.wait_until || commit.wait_until_input) {
        outcome.wait = {
          delay: commit.wait_delay,
          until: commit.wait_until,
          until_input: commit.wait_until_input,
        };
      }
      return ['continue', outcome];
    }
    case 'ACTION_COMPLETE':
      return ['complete', { output: commit.output }];
    case 'ACTION_PAUSE':
      return ['pause', { duration: commit.pause }];
    default: {
      const permanent = commit.action === 'ACTION_FAIL_PERMANENT';
      const kind = permanent ? 'FAILURE_KIND_PERMANENT' : 'FAILURE_KIND_RETRIABLE';
      return ['fail', { error: commit.error, kind, reason: commit.reason }];
    }
  }
}
