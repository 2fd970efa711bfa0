"""The engine's state as plain values: runs, steps, events, timers and effects.

The rules in :mod:`dagnats.engine.rules` take these in and give these back;
:mod:`dagnats.engine.convert` moves them to and from protobuf. Times are
seconds since the epoch (floats), injected by the caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from dagnats.core.status import StepStatus as StepStatus
from dagnats.core.usage import Budget
from dagnats.engine.definition import WorkflowDef

DEFAULT_RUN_RETENTION = 30 * 24 * 3600.0


class RunStatus(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not RunStatus.RUNNING


class TimerKind(enum.Enum):
    WAKE = "wake"
    STEP_TIMEOUT = "step_timeout"
    MAX_DURATION = "max_duration"


class FailureKind(enum.Enum):
    RETRIABLE = "retriable"
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """One step of a run. ``(iteration, attempt)`` is the current dispatch, or the
    dispatch a waiting step will make when its timer fires."""

    step_id: str
    status: StepStatus = StepStatus.PENDING
    iteration: int = 0
    attempt: int = 0
    iterations: int = 0
    failures: int = 0
    redispatches: int = 0
    # The TASKS message that carries the current dispatch, kept by its holder
    # from the iteration before (the kept task); 0: the dispatch's own message.
    kept_seq: int = 0
    # The worker build whose commit the step recorded (the pinned policy
    # sends its later dispatches to that build); "": none yet, or unversioned.
    build: str = ""
    output: bytes = b""
    error: str = ""
    child_run_id: str = ""
    started_at: float | None = None
    dispatched_at: float | None = None
    finished_at: float | None = None
    wake_at: float | None = None
    waiting_for_input: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ForkOrigin:
    """The journal record a forked run was copied from: the source run, its
    step, and the last record copied."""

    run_id: str
    step_id: str
    at_seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """Where a forked step resumes: the dispatch its first claim replays,
    the continues before it, and the output of the last of them."""

    iteration: int
    attempt: int
    iterations: int
    output: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    run_id: str
    workflow: WorkflowDef
    status: RunStatus
    input: bytes
    steps: tuple[Step, ...]
    created_at: float
    output: bytes = b""
    error: str = ""
    parent_run_id: str = ""
    parent_step_id: str = ""
    idempotency_key: str = ""
    finished_at: float | None = None
    # Settings its handlers read, sorted by name; every task carries them.
    settings: tuple[tuple[str, str], ...] = ()
    forked_from: ForkOrigin | None = None
    budget: Budget | None = None  # what its model calls may spend (the usage ledger)

    def step(self, step_id: str) -> Step:
        for s in self.steps:
            if s.step_id == step_id:
                return s
        raise KeyError(step_id)

    def has_step(self, step_id: str) -> bool:
        return any(s.step_id == step_id for s in self.steps)


# ---- inputs to the rules -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """Which dispatch an event claims to come from; ``None``: it names none (dropped)."""

    iteration: int
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """Hold the next iteration until ``delay`` passes, ``until`` comes, or an
    input arrives (``until_input``), whichever is first."""

    delay: float | None = None
    until: float | None = None
    until_input: bool = False

    def due(self, now: float) -> float | None:
        times = [t for t in (None if self.delay is None else now + self.delay, self.until) if t]
        return min(times) if times else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Continued:
    output: bytes = b""
    wait: Wait | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Completed:
    output: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    error: str
    kind: FailureKind = FailureKind.RETRIABLE
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Paused:
    duration: float


StepOutcome = Continued | Completed | Failed | Paused


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """A worker's report about a step, as it arrives on the run's history."""

    step_id: str
    identity: Identity | None
    outcome: StepOutcome
    journal_seq: int = 0
    # The reporter keeps its task message (this sequence) for the next
    # iteration, if that is dispatched at once (the kept task); 0: released.
    kept_seq: int = 0
    # The build of the worker whose commit this is; "": unversioned.
    build: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerFired:
    step_id: str
    kind: TimerKind
    iteration: int
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildEnded:
    step_id: str
    child_run_id: str
    status: RunStatus
    output: bytes = b""
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class InputArrived:
    """An input was queued for the step (or found queued when its wait began)."""

    step_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelRequested:
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskVanished:
    """The reconciler saw no task in flight for the step's current dispatch,
    or the lease moves its message to the lane of ``build``: the build the
    step belongs to, recorded on a step that has none yet (the build of its
    first claim). Empty: the step's lane as recorded."""

    step_id: str
    iteration: int
    attempt: int
    build: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpgradeRequested:
    """An operator moves the run's steps to worker build ``build``."""

    build: str


RunInput = (
    StepReport
    | TimerFired
    | ChildEnded
    | CancelRequested
    | TaskVanished
    | InputArrived
    | UpgradeRequested
)


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalMark:
    """What the engine reads of one record of a step's journal.

    Attributes:
        seq: Its stream sequence.
        iteration: Iteration of the dispatch that wrote it.
        attempt: Attempt of the dispatch that wrote it.
        commit: For a commit, the outcome it records; None for any other kind.
        delivery: Delivery count of its writer's task (the claim's); 0 when
            the claim did not say.
        build: For a commit, its writer's build; "" for none.
    """

    seq: int
    iteration: int
    attempt: int
    commit: StepOutcome | None = None
    delivery: int = 0
    # For a commit, the build of the worker that wrote it ("": unversioned).
    build: str = ""

    @property
    def dispatch(self) -> tuple[int, int]:
        return self.iteration, self.attempt


@dataclass(frozen=True, slots=True, kw_only=True)
class Contradicted:
    """A worker's call that the journal contradicts. ``fenced``: another holder
    owns the dispatch, or the report names no commit of it; ``stale``: the
    journal has moved past the dispatch, or it is committed already."""

    reason: Literal["fenced", "stale"]
    message: str


# ---- outputs of the rules -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchTask:
    run_id: str
    step_id: str
    task_type: str
    workflow: str
    iteration: int
    attempt: int
    input: bytes
    redispatch: int = 0
    settings: tuple[tuple[str, str], ...] = ()
    budget: Budget | None = None
    # The worker build the task goes to (its subject names it); "": any worker.
    build: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SetTimer:
    run_id: str
    step_id: str
    kind: TimerKind
    iteration: int
    attempt: int
    due: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StartChildRun:
    child_run_id: str
    workflow: str
    input: bytes
    parent_run_id: str
    parent_step_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelChildRun:
    child_run_id: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NotifyParent:
    parent_run_id: str
    parent_step_id: str
    child_run_id: str
    status: RunStatus
    output: bytes
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AnnounceCancel:
    run_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreCancel:
    """Append a cancel record to the journal of a step the run's end stopped,
    whatever its tail: the holder's next write is refused by the fence, and
    the journal answers it ``RunCancelled``."""

    run_id: str
    step_id: str
    iteration: int
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """Close a finished step's queued inputs, or check a step that began to wait
    for input for inputs that arrived during its turn."""

    run_id: str
    step_id: str
    iteration: int
    close: bool
    # With ``close``: how the step finished, and its accepted continues,
    # which decide each input's end without a read of the run.
    status: StepStatus = StepStatus.PENDING
    iterations: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PurgeLater:
    """Purge the run that just ended, and everything of it, at ``due``: its
    retention after its end. A durable timer, so an engine restart in
    between does not lose it."""

    run_id: str
    due: float


Effect = (
    DispatchTask
    | SetTimer
    | StartChildRun
    | CancelChildRun
    | NotifyParent
    | AnnounceCancel
    | StoreCancel
    | StepInputs
    | PurgeLater
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Accepted:
    """The input changed the run; save ``run`` and then carry out ``effects``."""

    run: Run
    effects: tuple[Effect, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Dropped:
    """The input does not apply to the run as it is now; acknowledge and log it."""

    reason: str


Decision = Accepted | Dropped


@dataclass(frozen=True, slots=True)
class LeaseHere:
    """The task message may be leased to the polling worker."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveToLane:
    """The task message is off the lane of ``build``, the build its step
    belongs to: its dispatch is made again there and the message settled."""

    build: str


LaneDecision = LeaseHere | MoveToLane


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleOptions:
    """Engine settings the rules depend on."""

    # How long an ended run is kept after its end (``DAGNATS_RUN_RETENTION``).
    run_retention: float = DEFAULT_RUN_RETENTION
