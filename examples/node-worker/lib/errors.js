// Errors the worker raises, and the ones a handler raises to steer its task.
// The same tree as the Python SDK (sdk/dagnats/sdk/_errors.py):
//
//   Error
//   ├── JournalSignal          the task is settled or lost: let it propagate
//   │   ├── Stale              a late redelivery: a later dispatch exists
//   │   ├── Committed          this dispatch was committed before a crash
//   │   ├── RestartLimit       too many deliveries without progress; the step failed
//   │   └── Fenced             a successor holds the step; write nothing
//   ├── DagnatsError           a service refused a call (status + dagnats code)
//   │   └── Unavailable        the engine could not be reached, after retries
//   ├── Cancelled              the handler was told to stop (run cancelled, fenced)
//   ├── ConcurrentJournalUse   two journal calls at once on one handle
//   ├── TaskAlreadySettled     a second continue/complete/fail on one task
//   └── PermanentError         thrown by a handler: fail the step, no retry
//
// JavaScript has no BaseException, so a handler that catches errors must
// rethrow a JournalSignal: the worker has settled the task already (or, for
// Fenced, must leave it alone: acknowledging would take it from its successor).

export class JournalSignal extends Error {
  constructor(message, { runId = '', stepId = '' } = {}) {
    super(message);
    this.name = new.target.name;
    this.runId = runId;
    this.stepId = stepId;
  }
}

export class Stale extends JournalSignal {}
export class Committed extends JournalSignal {}
export class RestartLimit extends JournalSignal {}
export class Fenced extends JournalSignal {}

export class DagnatsError extends Error {
  // status: the gRPC status code; code: the service's error code
  // ("invalid_argument", "replay_mismatch", ...), from trailing metadata.
  constructor(message, { status, code = '' } = {}) {
    super(message);
    this.name = new.target.name;
    this.status = status;
    this.code = code;
  }
}

export class Unavailable extends DagnatsError {}

export class Cancelled extends Error {
  constructor(message) {
    super(message);
    this.name = 'Cancelled';
  }
}

export class ConcurrentJournalUse extends Error {
  constructor() {
    super('two journal calls at once on one handle; make journaled calls one at a time');
    this.name = 'ConcurrentJournalUse';
  }
}

export class TaskAlreadySettled extends Error {
  constructor(settledAs) {
    super(`the task was already settled (${settledAs})`);
    this.name = 'TaskAlreadySettled';
    this.settledAs = settledAs;
  }
}

export class PermanentError extends Error {
  constructor(message, { reason = '' } = {}) {
    super(message);
    this.name = 'PermanentError';
    this.reason = reason;
  }
}

// The text reported for a failure: "Type: message", as the Python SDK does.
export function describe(error) {
  return error instanceof Error ? `${error.name}: ${error.message}` : String(error);
}
