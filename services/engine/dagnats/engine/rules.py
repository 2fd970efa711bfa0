"""The engine's state machine: every rule for runs and steps, in one place.

Pure functions from (run, input, now) to a decision: ``Accepted`` (the new run
and the effects to carry out after saving it) or ``Dropped`` (the input does
not apply; acknowledge and log it). No I/O, no clock, no randomness: the
caller passes ``now`` and ids.

Invariants:

* A step's ``(iteration, attempt)`` names its current dispatch. ``iteration``
  starts at 0 and grows by one per accepted continue; ``attempt`` starts at 1
  for every iteration and grows by one per retry or pause of that iteration.
* The acceptance rule: a step report is applied only while the run is running,
  the step is running, and the report's identity is the step's current
  dispatch -- or, for a journal step, the report carries a journal commit
  (``journal_seq``) of the step's current iteration that ends the iteration
  (continue, complete, permanent failure): the journal admits one commit per
  dispatch and fences every earlier holder, so such a report is the
  iteration's truth even when it comes from an earlier attempt. A report
  without identity is never applied. Everything else is dropped, so a
  duplicate or stale report never advances a step twice.
* Before a report reaches the run's history, the journal has its say
  (``check_journal_report``): a dispatch whose journal was claimed reports
  only the stored commit of that dispatch, named by ``journal_seq``, and
  exactly what it records. A heartbeat or a release of a task is refused
  when the journal's tail names another delivery of it as the holder
  (``check_journal_lease``).
* Every wait (retry backoff, loop delay, pause, a continue's wait) is a timer
  effect, and every timer carries the identity it was set for; a timer for
  another identity is dropped. Nothing waits in memory. A wait for input has
  no timer of its own: an ``InputArrived`` wakes it, and entering it asks the
  engine to check for inputs that arrived during the turn.
* A step's timeout and a loop's ``max_duration`` keep counting while the step
  waits: the timeout of the next dispatch is armed when the wait begins.
* When a step finishes, or its run ends before it started, its inputs end
  (``StepInputs`` with ``close``, carrying how the step finished): queued
  ones unanswered, ones placed into an iteration that never committed dropped.
* A terminal run never changes again. The decision that ends a run sets its
  purge, ``run_retention`` after its end; nothing sets one earlier.
* A task message is leased only for its step's current dispatch
  (``carried_dispatch``); any other is settled at once, but for one whose run
  is not stored yet, which waits for it (``awaits_its_run``). A running step whose
  task is a worker's (``awaiting_a_task``) must have that dispatch's task in
  flight, or the reconciler dispatches it again.
* A running run with nothing in motion (``parked``) may leave the active-run
  index; the reconciler's pass after the write that wakes it enters it again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from dagnats.core.subjects import is_task_subject
from dagnats.core.usage import Budget, Policy
from dagnats.engine.definition import BuildPolicy, StepDef, StepType, WorkflowDef, backoff_delay
from dagnats.engine.model import (
    Accepted,
    AnnounceCancel,
    CancelChildRun,
    CancelRequested,
    ChildEnded,
    Completed,
    Continued,
    Contradicted,
    Decision,
    DispatchTask,
    Dropped,
    Effect,
    Failed,
    FailureKind,
    ForkOrigin,
    Identity,
    InputArrived,
    JournalMark,
    LaneDecision,
    LeaseHere,
    MoveToLane,
    NotifyParent,
    Paused,
    PurgeLater,
    Resume,
    RuleOptions,
    Run,
    RunInput,
    RunStatus,
    SetTimer,
    StartChildRun,
    Step,
    StepInputs,
    StepOutcome,
    StepReport,
    StepStatus,
    StoreCancel,
    TaskVanished,
    TimerFired,
    TimerKind,
    UpgradeRequested,
    Wait,
)

DEFAULT_OPTIONS = RuleOptions()


def start_run(
    *,
    run_id: str,
    workflow: WorkflowDef,
    input: bytes,
    now: float,
    parent_run_id: str = "",
    parent_step_id: str = "",
    idempotency_key: str = "",
    settings: tuple[tuple[str, str], ...] = (),
    budget: Budget | None = None,
) -> Accepted:
    """A new run with its ready steps dispatched; ``budget``: the run's own
    (else its workflow's)."""
    run = Run(
        run_id=run_id,
        workflow=workflow,
        status=RunStatus.RUNNING,
        input=input,
        steps=tuple(Step(step_id=s.id) for s in workflow.steps),
        created_at=now,
        parent_run_id=parent_run_id,
        parent_step_id=parent_step_id,
        idempotency_key=idempotency_key,
        settings=settings,
        budget=budget or workflow.budget,
    )
    return _advance(run, (), now)


def fork_run(
    source: Run,
    *,
    run_id: str,
    origin: ForkOrigin,
    resume: Resume,
    input: bytes,
    settings: tuple[tuple[str, str], ...],
    now: float,
    idempotency_key: str = "",
) -> Accepted:
    """A run forked from ``source`` at a record of ``origin.step_id``'s
    journal: the steps the forked step depends on (directly or not) carried
    over as completed, with their outputs; the forked step dispatched at
    ``resume`` (its journal starts with the copied prefix, so its claim
    replays what was recorded); every other step pending, and dispatched now
    if it is ready. It keeps the source's budget."""
    carried = source.workflow.ancestors(origin.step_id)
    steps = tuple(
        replace(s, kept_seq=0, redispatches=0) if s.step_id in carried else Step(step_id=s.step_id)
        for s in source.steps
    )
    run = Run(
        run_id=run_id,
        workflow=source.workflow,
        status=RunStatus.RUNNING,
        input=input,
        steps=steps,
        created_at=now,
        idempotency_key=idempotency_key,
        settings=settings,
        forked_from=origin,
        budget=source.budget,  # bounds what the fork spends: its copied calls are the source's
    )
    step = replace(
        run.step(origin.step_id),
        started_at=now,
        iterations=resume.iterations,
        output=resume.output,
    )
    accepted = _dispatch(run, step, resume.iteration, resume.attempt, now, ())
    return _advance(accepted.run, accepted.effects, now)


def apply(
    run: Run, event: RunInput, now: float, options: RuleOptions = DEFAULT_OPTIONS
) -> Decision:
    """Apply one input to a run."""
    if run.status.terminal:
        return Dropped(reason=f"run is {run.status.value}")
    return _purged_after_end(_apply(run, event, now), now, options)


def _apply(run: Run, event: RunInput, now: float) -> Decision:
    match event:
        case CancelRequested(reason=reason):
            return _cancel(run, reason or "cancelled", now)
        case StepReport():
            return _on_report(run, event, now)
        case TimerFired():
            return _on_timer(run, event, now)
        case ChildEnded():
            return _on_child(run, event, now)
        case InputArrived():
            return _on_input(run, event, now)
        case TaskVanished():
            return _on_vanished(run, event, now)
        case UpgradeRequested():
            return _on_upgrade(run, event, now)


def _purged_after_end(decision: Decision, now: float, options: RuleOptions) -> Decision:
    """A decision that ends the run also sets its purge, the retention after
    its end (``PurgeLater``); the write that ends the run carries it in its
    outbox. Nothing of a running run is ever purged: no purge is set before
    the run ends, and a purge finds the run ended (see the engine's purge)."""
    if not isinstance(decision, Accepted) or not decision.run.status.terminal:
        return decision
    purge = PurgeLater(run_id=decision.run.run_id, due=now + options.run_retention)
    return replace(decision, effects=(*decision.effects, purge))


def child_run_id(run_id: str, step_id: str, iteration: int, attempt: int) -> str:
    """The deterministic id of the child run a sub-workflow dispatch starts."""
    digest = hashlib.sha256(f"{run_id}.{step_id}.{iteration}.{attempt}".encode()).hexdigest()
    return digest[:32]


def step_input(run: Run, step_def: StepDef) -> bytes:
    """Input of a step: the run's input for a root step, else its dependencies' outputs."""
    deps = step_def.depends_on
    if not deps:
        return run.input
    if len(deps) == 1:
        return run.step(deps[0]).output
    merged = {d: _decode(run.step(d).output) for d in deps}
    return json.dumps(merged).encode()


def run_output(run: Run) -> bytes:
    """Output of a completed run: its one sink step's output, else one per sink."""
    sinks = run.workflow.sinks()
    if len(sinks) == 1:
        return run.step(sinks[0].id).output
    return json.dumps({s.id: _decode(run.step(s.id).output) for s in sinks}).encode()


# ---- step reports -----------------------------------------------------------------


def _on_report(run: Run, report: StepReport, now: float) -> Decision:
    if not run.has_step(report.step_id):
        return Dropped(reason=f"unknown step {report.step_id!r}")
    step = run.step(report.step_id)
    ident = report.identity
    committed = (
        report.journal_seq > 0
        and ident is not None
        and ident.iteration == step.iteration
        and _ends_iteration(report.outcome)
    )
    if step.status is not StepStatus.RUNNING and not (
        committed and step.status is StepStatus.WAITING
    ):
        return Dropped(reason=f"step {step.step_id} is {step.status.value}")
    if ident is None:
        return Dropped(reason="report without dispatch identity")
    if (ident.iteration, ident.attempt) != (step.iteration, step.attempt) and not committed:
        return Dropped(
            reason=(
                f"report for dispatch ({ident.iteration}, {ident.attempt}) but step "
                f"{step.step_id} is at ({step.iteration}, {step.attempt})"
            )
        )
    step_def = run.workflow.step(step.step_id)
    step, kept_seq = _with_build(run.workflow, step, report)
    match report.outcome:
        case Continued(output=output, wait=wait):
            return _on_continue(run, step, step_def, output, wait, now, kept_seq)
        case Completed(output=output):
            return _complete_step(run, step, output, now)
        case Failed() as failed:
            return _fail_attempt(run, step, failed, now)
        case Paused(duration=duration):
            return _wait(run, step, step.iteration, step.attempt + 1, now + duration, ())


def _with_build(workflow: WorkflowDef, step: Step, report: StepReport) -> tuple[Step, int]:
    """``step`` with the build of an accepted commit recorded, and the task
    message its next iteration may keep. Pinned: the first build that
    commits the step stays its build, and a commit of another build (the
    step was moved to a new build while the old one held it) keeps no
    message: the next dispatch is published to the step's build. Upgrade:
    the step records the latest build. An unversioned commit on an
    unversioned step changes nothing."""
    if not report.build and not step.build:
        return step, report.kept_seq
    if workflow.build_policy is BuildPolicy.UPGRADE:
        return replace(step, build=report.build or step.build), report.kept_seq
    if not step.build:
        return replace(step, build=report.build), report.kept_seq
    return step, report.kept_seq if report.build == step.build else 0


def pinned_build(run: Run, step: Step) -> str:
    """The build whose workers alone may run ``step``'s dispatches: its
    recorded build under the pinned policy; "" when any worker may."""
    return step.build if run.workflow.build_policy is BuildPolicy.PINNED else ""


def leasable_on_lane(pin: str, lane_build: str, worker_build: str) -> bool:
    """Whether a message of the current dispatch of a step pinned to ``pin``
    ("": to none; ``pinned_build``), found on the lane of ``lane_build`` ("":
    the unpinned lane), may be leased to a worker of ``worker_build``: the
    step is pinned to no build, or the message is on its build's lane, or
    the worker is of that build. Otherwise the message is misplaced (a kept
    message of a pinned step redelivered on the unpinned lane, or one left
    on an old build's lane by a move): it is dispatched again on the step's
    lane and settled, never given back."""
    return not pin or pin in (lane_build, worker_build)


def asks_holder(*, pinned_policy: bool, step_build: str, delivery: int) -> bool:
    """Whether the lease of a task message needs the build of its step's
    journal holder: a step of a pinned workflow that recorded no build yet
    (none of its iterations committed with one), delivered again (its holder
    may have died inside the iteration, its records replayed by the next).
    A first delivery has no holder before it, and a step with a build is
    decided on it: neither reads anything more."""
    return pinned_policy and not step_build and delivery > 1


def lane_for_lease(
    *, pin: str, lane_build: str, worker_build: str, holder_build: str = ""
) -> LaneDecision:
    """Where a message of a step's current dispatch goes when a worker of
    ``worker_build`` polls it, on the lane of ``lane_build``. A step pinned
    to ``pin`` (``pinned_build``) is decided by ``leasable_on_lane``. A step
    of a pinned workflow with no build yet belongs to the build of its
    journal's holder, ``holder_build`` (read only when ``asks_holder``): the
    build of the claim that began the iteration, whose records the next
    holder replays. A worker of another build, or an unversioned one, would
    replay them with other code: the message moves to that build's lane,
    where the step records it. An unversioned holder, or none, pins nothing."""
    if pin:
        leasable = leasable_on_lane(pin, lane_build, worker_build)
        return LeaseHere() if leasable else MoveToLane(build=pin)
    if holder_build and holder_build not in (lane_build, worker_build):
        return MoveToLane(build=holder_build)
    return LeaseHere()


def _ends_iteration(outcome: StepOutcome) -> bool:
    """Whether a commit with this outcome ends its iteration for every attempt:
    a retriable failure or a pause ends only its own attempt."""
    match outcome:
        case Continued() | Completed():
            return True
        case Failed(kind=kind):
            return kind is FailureKind.PERMANENT
        case Paused():
            return False


# ---- tasks: which message is a step's current dispatch ----------------------------


def carried_dispatch(
    run: RunStatus,
    step: StepStatus | None,
    current: Identity | None,
    task: Identity,
    *,
    kept: bool = False,
) -> Identity | None:
    """The dispatch a task message published for ``task`` carries, if it may
    be leased: its run and its step are running and it carries the step's
    current dispatch (``current``; ``step`` None when the run has no such
    step): the dispatch it was published for, or, ``kept`` (the step's
    ``kept_seq`` is this message), the dispatch its holder kept it for
    (the kept task). None for any other: a stale duplicate, or its run ended; it is
    settled without a worker."""
    if run is not RunStatus.RUNNING or step is not StepStatus.RUNNING or current is None:
        return None
    return current if kept or current == task else None


def dispatch_task(run: Run, step: Step) -> DispatchTask:
    """The task of ``step``'s current dispatch (a step that runs a task)."""
    step_def = run.workflow.step(step.step_id)
    assert step_def.task is not None
    return DispatchTask(
        run_id=run.run_id,
        step_id=step.step_id,
        task_type=step_def.task,
        workflow=run.workflow.name,
        iteration=step.iteration,
        attempt=step.attempt,
        input=step_input(run, step_def),
        redispatch=step.redispatches,
        settings=run.settings,
        budget=_task_budget(run.budget, step_def),
        build=pinned_build(run, step),
    )


def _task_budget(budget: Budget | None, step_def: StepDef) -> Budget | None:
    """The run's budget as a step's task carries it: a pause waits with a
    continue, which only an agent loop has, so a task step's refused call
    fails it whatever the run's policy."""
    if budget is None or step_def.type is StepType.AGENT_LOOP:
        return budget
    return replace(budget, policy=Policy.FAIL)


def kept_decision(
    step: Step | None, run: RunStatus, task_seq: int, reported: Identity
) -> bool | None:
    """What became of task message ``task_seq``, kept by the holder of the
    dispatch ``reported`` across its commit, once the engine applied the
    commit's report: True, it carries the step's next dispatch; False, it
    carries no current dispatch (release it); None, it still carries
    ``reported`` (the report is not applied yet)."""
    carried = carried_dispatch(
        run,
        step.status if step is not None else None,
        Identity(iteration=step.iteration, attempt=step.attempt) if step is not None else None,
        reported,
        kept=step is not None and step.kept_seq == task_seq,
    )
    if carried is None:
        return False
    return None if carried == reported else True


def carried_on(step: Step, kept_seq: int) -> bool:
    """Whether ``step`` runs its dispatch on kept task message ``kept_seq``."""
    return step.status is StepStatus.RUNNING and step.kept_seq == kept_seq


def carries_kept_loop_on(run: Run, decision: Decision, step_id: str, kept_seq: int) -> bool:
    """Whether ``decision`` on ``run`` only carries step ``step_id``'s loop on
    to its next iteration on kept message ``kept_seq``, which ``run`` already
    says is kept: it publishes nothing and leaves the run running. Such a
    decision may be made before it is written, as long as a reader of the run
    can take it from the journal (the deferred write)."""
    if not isinstance(decision, Accepted) or decision.effects or not run.has_step(step_id):
        return False
    before, after = run.step(step_id), decision.run.step(step_id)
    return (
        decision.run.status is RunStatus.RUNNING
        and carried_on(before, kept_seq)
        and carried_on(after, kept_seq)
        and before.build == after.build
    )


def catch_up(
    run: Run, reports: list[StepReport], now: float, options: RuleOptions = DEFAULT_OPTIONS
) -> Run:
    """``run`` with ``reports`` applied in order: a step's continue commits
    that an engine decided without writing the run (deferred writes), each kept its
    message (``kept_seq``). It stops at the first that would do anything else
    than carry the loop on with that message: that one's event decides it."""
    for report in reports:
        decision = apply(run, report, now, options)
        if not carries_kept_loop_on(run, decision, report.step_id, report.kept_seq):
            break  # a wait, an end, a retry: not a decision made unwritten
        assert isinstance(decision, Accepted)
        run = decision.run
    return run


# Seconds taken off JetStream's duplicate window for the clocks of two
# engines: an outbox's age is one engine's clock against another's stamp.
CLOCK_MARGIN = 30.0


def republishable(subject: str, outbox_age: float, dedupe_window: float) -> bool:
    """Whether an outbox entry on ``subject`` may be published again, its
    outbox ``outbox_age`` seconds old. Anything but a task may. A task may
    while its Msg-Id is inside the stream's duplicate window (less
    ``CLOCK_MARGIN``), where a second publish is dropped; past it the task
    would be stored again as a second delivery of a dispatch that may be
    current, whose claim fences the live holder. A task that never went out
    is dispatched anew by the reconciler's stranded-step check instead."""
    return not is_task_subject(subject) or outbox_age < dedupe_window - CLOCK_MARGIN


# How long a task whose run is not stored yet is given back for: first, and at most.
RUN_AWAITED_FIRST = 0.02
RUN_AWAITED_MOST = 1.0


def awaits_its_run(
    task_age: float, delivered: int, *, retry_budget: float, clock_skew: float
) -> float | None:
    """How long to give back a task message whose run is not stored, or None
    to settle it. A run's create publishes its first tasks while it writes the
    run, so a task may be delivered before its run is stored: it is
    given back, at intervals that double from ``RUN_AWAITED_FIRST`` to
    ``RUN_AWAITED_MOST``, while the write may still land, and settled after:
    its run was never stored, or was purged. The write may land for three
    writes' ``retry_budget`` (the index, the run, the create again after a
    lost acknowledgement) after the task was stored, ``task_age`` seconds ago
    by an engine's clock that may lead the stored time by ``clock_skew``."""
    horizon = 3 * retry_budget + clock_skew
    if task_age >= horizon:
        return None
    backoff = RUN_AWAITED_FIRST * (1 << min(max(delivered, 1) - 1, 16))
    return min(backoff, RUN_AWAITED_MOST, horizon - task_age)


def awaiting_a_task(run: Run) -> list[tuple[Step, str]]:
    """The running steps of ``run`` whose dispatch is a worker's task, each
    with its task type: each must have its current dispatch's task in flight
    (a step that runs a child run, or has no task type, has none)."""
    found = []
    for step in run.steps:
        if step.status is not StepStatus.RUNNING or step.child_run_id:
            continue
        task = next((d.task for d in run.workflow.steps if d.id == step.step_id), None)
        if task:
            found.append((step, task))
    return found


def parked(run: Run, *, outbox: bool) -> bool:
    """Whether a run may leave the active-run index (a parked run): it is running,
    has no ``outbox`` left to publish or clear, and nothing of it is in
    motion: no step runs (so no task or child run is in flight for the
    reconciler to find lost), and at least one waits, for an input or a timer
    whose message is stored already. Whatever wakes it is a write of the run,
    which the reconciler's next pass reads and enters in the index again."""
    if run.status is not RunStatus.RUNNING or outbox:
        return False
    if any(step.status is StepStatus.RUNNING for step in run.steps):
        return False
    return any(step.status is StepStatus.WAITING for step in run.steps)


# ---- journal steps: what the journal says of a worker's call ----------------------


def check_journal_report(
    report: StepReport, tail: JournalMark | None, named: JournalMark | None
) -> Contradicted | None:
    """Whether the journal allows a step report; None when it does.

    A dispatch whose journal was claimed has one outcome, its commit: the
    report must name (``journal_seq``) a stored commit of its own iteration
    and attempt and report what that commit records. Only the holder of the
    dispatch could have stored it, as every append is fenced; so a holder
    fenced by its successor, which has no commit, cannot report, and a report
    of the successor's commit says what the successor said. A dispatch with
    no record in the journal (a step without a journal, or a handler that
    ended before it claimed) reports without one.

    Args:
        report: The report, as its event will carry it.
        tail: The last record of the step's journal; None when it has none.
        named: The record at ``report.journal_seq`` on the step's journal;
            None when there is none (or no sequence was named).
    """
    ident = report.identity
    where = "" if ident is None else f" of iteration {ident.iteration} attempt {ident.attempt}"
    if report.journal_seq > 0:
        if (
            named is None
            or named.commit is None
            or ident is None
            or named.dispatch
            != (
                ident.iteration,
                ident.attempt,
            )
        ):
            return _contradict(
                ident, tail, f"journal_seq {report.journal_seq} is no stored commit{where}"
            )
        if not _same_outcome(named.commit, report.outcome):
            return Contradicted(
                reason="fenced",
                message=(
                    f"the commit at seq {named.seq} records {_describe(named.commit)}, "
                    f"not {_describe(report.outcome)}"
                ),
            )
        return None
    if tail is None or (ident is not None and tail.dispatch < (ident.iteration, ident.attempt)):
        return None
    return _contradict(
        ident,
        tail,
        f"the dispatch{where} holds a journal: its outcome is its commit, named by journal_seq",
    )


def check_journal_lease(
    identity: Identity,
    delivery: int,
    tail: JournalMark | None,
    *,
    releasing: bool = False,
    run_ended: bool = False,
) -> Contradicted | None:
    """Whether the holder of a task's lease may keep it (a heartbeat) or release
    it (``releasing``: an acknowledgement); None when it may.

    Every journal record carries its writer's delivery count, so the tail
    names the delivery whose claim holds the dispatch. A lease of another
    delivery belongs to a holder that a later claim fenced (or that never
    claimed after it): it must not keep the task alive for the holder, nor
    take it away. A task whose dispatch the journal has moved past keeps no
    lease; it may still be released (a claim found it stale), as may the
    task of a run that ended (``run_ended``). A journal with no record of the
    dispatch, or a claim that gave no delivery, decides nothing.
    """
    dispatch = (identity.iteration, identity.attempt)
    if tail is None or tail.dispatch < dispatch or (releasing and run_ended):
        return None
    if tail.dispatch > dispatch:
        if releasing:
            return None
        return Contradicted(
            reason="fenced",
            message=(
                f"the journal has moved on to iteration {tail.iteration} attempt "
                f"{tail.attempt}: this task's lease is spent"
            ),
        )
    if releasing and tail.commit is not None:
        return None  # the dispatch is committed: its task is done, whoever releases it
    if tail.delivery and tail.delivery != delivery:
        return Contradicted(
            reason="fenced",
            message=(
                f"delivery {tail.delivery} of this task claimed the step after delivery "
                f"{delivery}: a successor holds it"
            ),
        )
    return None


def _contradict(ident: Identity | None, tail: JournalMark | None, why: str) -> Contradicted:
    """``stale`` when the journal is past the dispatch or committed it, else ``fenced``."""
    if ident is not None and tail is not None:
        dispatch = (ident.iteration, ident.attempt)
        if tail.dispatch > dispatch:
            return Contradicted(reason="stale", message=f"{why}; the journal has moved past it")
        if tail.dispatch == dispatch and tail.commit is not None:
            return Contradicted(
                reason="stale", message=f"{why}; it was committed at seq {tail.seq}"
            )
    return Contradicted(reason="fenced", message=why)


def _same_outcome(a: StepOutcome, b: StepOutcome) -> bool:
    if isinstance(a, Continued) and isinstance(b, Continued):
        return a.output == b.output and _wait_or_none(a.wait) == _wait_or_none(b.wait)
    return a == b


def _wait_or_none(wait: Wait | None) -> Wait | None:
    return None if wait == Wait() else wait


def _describe(outcome: StepOutcome) -> str:
    match outcome:
        case Continued():
            return "a continue"
        case Completed():
            return "a complete"
        case Failed():
            return "a failure"
        case Paused():
            return "a pause"


def _on_continue(
    run: Run,
    step: Step,
    step_def: StepDef,
    output: bytes,
    wait: Wait | None,
    now: float,
    kept_seq: int,
) -> Decision:
    if step_def.type is not StepType.AGENT_LOOP:
        return Dropped(reason=f"continue on {step_def.type.value} step {step.step_id}")
    bounds = step_def.agent_loop
    assert bounds is not None
    iterations = step.iterations + 1
    step = replace(step, iterations=iterations, output=output, failures=0)
    if iterations >= bounds.max_iterations:
        error = f"agent loop reached max_iterations ({bounds.max_iterations})"
        return _fail_step(run, step, error, now)
    if bounds.max_duration is not None and now - (step.started_at or now) >= bounds.max_duration:
        return _fail_step(
            run, step, f"agent loop exceeded max_duration ({bounds.max_duration}s)", now
        )
    if wait is not None and (wait.until_input or wait.due(now) is not None):
        return _wait_for(run, step, step_def, iterations, wait, now)
    if bounds.loop_delay > 0:
        return _wait(run, step, iterations, 1, now + bounds.loop_delay, ())
    # The next iteration at once: its reporter kept its task message for it
    # (kept_seq), so that message carries it and no task is published.
    return _dispatch(run, step, iterations, 1, now, (), kept_seq=kept_seq)


def _wait_for(
    run: Run, step: Step, step_def: StepDef, iteration: int, wait: Wait, now: float
) -> Accepted:
    """A continue that waits: for a time, for an input, or both."""
    due = wait.due(now)
    step = replace(
        step,
        status=StepStatus.WAITING,
        iteration=iteration,
        attempt=1,
        wake_at=due,
        redispatches=0,
        waiting_for_input=wait.until_input,
    )
    effects: list[Effect] = []
    if due is not None:
        effects.append(_timer(run, step, TimerKind.WAKE, due))
    if step_def.timeout is not None:
        effects.append(_timer(run, step, TimerKind.STEP_TIMEOUT, now + step_def.timeout))
    if wait.until_input:
        effects.append(_inputs(run, step, close=False))
    return Accepted(run=_with_step(run, step), effects=tuple(effects))


def _on_input(run: Run, arrived: InputArrived, now: float) -> Decision:
    if not run.has_step(arrived.step_id):
        return Dropped(reason=f"input for unknown step {arrived.step_id!r}")
    step = run.step(arrived.step_id)
    if step.status is not StepStatus.WAITING or not step.waiting_for_input:
        return Dropped(reason=f"step {step.step_id} is not waiting for input")
    return _dispatch(run, step, step.iteration, step.attempt, now, ())


def _inputs(run: Run, step: Step, *, close: bool) -> StepInputs:
    return StepInputs(
        run_id=run.run_id,
        step_id=step.step_id,
        iteration=step.iteration,
        close=close,
        status=step.status,
        iterations=step.iterations,
    )


def _complete_step(run: Run, step: Step, output: bytes, now: float) -> Accepted:
    done = replace(
        step,
        status=StepStatus.COMPLETED,
        output=output,
        error="",
        finished_at=now,
        wake_at=None,
        waiting_for_input=False,
    )
    return _advance(_with_step(run, done), (_inputs(run, done, close=True),), now)


def _fail_attempt(run: Run, step: Step, failed: Failed, now: float) -> Decision:
    error = failed.error or "failed"
    failures = step.failures + 1
    policy = run.workflow.retry_for(step.step_id)
    effects: tuple[Effect, ...] = ()
    if step.child_run_id:
        effects = (CancelChildRun(child_run_id=step.child_run_id, reason=error),)
    if failed.kind is FailureKind.PERMANENT or failures >= policy.max_attempts:
        return _fail_step(run, replace(step, failures=failures), error, now, effects)
    step = replace(step, failures=failures, error=error)
    due = now + backoff_delay(policy, failures)
    return _wait(run, step, step.iteration, step.attempt + 1, due, effects)


# ---- timers, children, reconciler ---------------------------------------------------


def _on_timer(run: Run, timer: TimerFired, now: float) -> Decision:
    if not run.has_step(timer.step_id):
        return Dropped(reason=f"timer for unknown step {timer.step_id!r}")
    step = run.step(timer.step_id)
    same = (timer.iteration, timer.attempt) == (step.iteration, step.attempt)
    match timer.kind:
        case TimerKind.WAKE if same and step.status is StepStatus.WAITING:
            return _dispatch(run, step, step.iteration, step.attempt, now, ())
        case TimerKind.STEP_TIMEOUT if same and step.status in _TIMED:
            timeout = run.workflow.step(step.step_id).timeout
            failed = Failed(error=f"step timed out after {timeout}s", reason="timeout")
            return _fail_attempt(run, step, failed, now)
        case TimerKind.MAX_DURATION if not step.status.finished:
            bounds = run.workflow.step(step.step_id).agent_loop
            limit = bounds.max_duration if bounds else None
            return _fail_step(run, step, f"agent loop exceeded max_duration ({limit}s)", now)
    return Dropped(reason=f"{timer.kind.value} timer no longer applies to {step.step_id}")


def _on_child(run: Run, child: ChildEnded, now: float) -> Decision:
    if not run.has_step(child.step_id):
        return Dropped(reason=f"child result for unknown step {child.step_id!r}")
    step = run.step(child.step_id)
    if step.status is not StepStatus.RUNNING or step.child_run_id != child.child_run_id:
        return Dropped(
            reason=f"child {child.child_run_id} is not the current child of {step.step_id}"
        )
    if child.status is RunStatus.COMPLETED:
        return _complete_step(run, step, child.output, now)
    error = f"child run {child.child_run_id} {child.status.value}: {child.error}".rstrip(": ")
    return _fail_step(run, step, error, now)


def _on_vanished(run: Run, gone: TaskVanished, now: float) -> Decision:
    if not run.has_step(gone.step_id):
        return Dropped(reason=f"unknown step {gone.step_id!r}")
    step = run.step(gone.step_id)
    same = (gone.iteration, gone.attempt) == (step.iteration, step.attempt)
    if not same or step.status is not StepStatus.RUNNING or step.child_run_id:
        return Dropped(reason=f"step {step.step_id} has moved on")
    # A step moved to the lane of its first claim's build records it; one
    # that recorded a build (or was upgraded meanwhile) keeps its own.
    build = step.build or gone.build
    step = replace(step, build=build, redispatches=step.redispatches + 1)
    return _dispatch(run, step, step.iteration, step.attempt, now, ())


def _on_upgrade(run: Run, upgrade: UpgradeRequested, now: float) -> Decision:
    """Move every step that recorded a build to ``upgrade.build``. A pinned
    step whose task is out is dispatched again (the same dispatch, one more
    re-dispatch) on the new build's lane; the message on the old lane no
    longer matches its step's lane and is settled wherever it is found."""
    effects: tuple[Effect, ...] = ()
    moved = False
    for step in run.steps:
        if not step.build or step.build == upgrade.build or step.status.finished:
            continue
        moved = True
        step = replace(step, build=upgrade.build)
        redispatch = (
            step.status is StepStatus.RUNNING
            and not step.child_run_id
            and bool(pinned_build(run, step))
            and run.workflow.step(step.step_id).task is not None
        )
        if redispatch:
            step = replace(step, redispatches=step.redispatches + 1)
            accepted = _dispatch(run, step, step.iteration, step.attempt, now, effects)
            run, effects = accepted.run, accepted.effects
        else:
            run = _with_step(run, step)
    if not moved:
        return Dropped(reason=f"no step of run {run.run_id} runs on another build")
    return Accepted(run=run, effects=effects)


# ---- transitions shared by the rules above -----------------------------------------


def _advance(run: Run, effects: tuple[Effect, ...], now: float) -> Accepted:
    """Dispatch every pending step whose dependencies completed; finish the run
    when every step completed."""
    if all(s.status is StepStatus.COMPLETED for s in run.steps):
        done = replace(run, status=RunStatus.COMPLETED, finished_at=now)
        done = replace(done, output=run_output(done))
        return Accepted(run=done, effects=effects + _notify_parent(done))
    for step in run.steps:
        if step.status is not StepStatus.PENDING:
            continue
        deps = run.workflow.step(step.step_id).depends_on
        if all(run.step(d).status is StepStatus.COMPLETED for d in deps):
            accepted = _dispatch(run, replace(step, started_at=now), 0, 1, now, effects)
            run, effects = accepted.run, accepted.effects
    return Accepted(run=run, effects=effects)


def _dispatch(
    run: Run,
    step: Step,
    iteration: int,
    attempt: int,
    now: float,
    effects: tuple[Effect, ...],
    *,
    kept_seq: int = 0,
) -> Accepted:
    """Run ``step``'s dispatch ``(iteration, attempt)``: a task for a worker,
    or a child run. ``kept_seq``: the task message a holder kept, which
    carries the dispatch instead of a new task."""
    step_def = run.workflow.step(step.step_id)
    if (iteration, attempt) != (step.iteration, step.attempt):
        step = replace(step, redispatches=0)
    step = replace(
        step,
        status=StepStatus.RUNNING,
        iteration=iteration,
        attempt=attempt,
        dispatched_at=now,
        wake_at=None,
        waiting_for_input=False,
        kept_seq=kept_seq if step_def.task else 0,
    )
    new: list[Effect] = []
    if step_def.type is StepType.SUB_WORKFLOW:
        child = child_run_id(run.run_id, step.step_id, iteration, attempt)
        step = replace(step, child_run_id=child)
        assert step_def.workflow is not None
        new.append(
            StartChildRun(
                child_run_id=child,
                workflow=step_def.workflow,
                input=step_input(run, step_def),
                parent_run_id=run.run_id,
                parent_step_id=step.step_id,
            )
        )
    elif not step.kept_seq:
        new.append(dispatch_task(run, step))
    if step_def.timeout is not None:
        new.append(_timer(run, step, TimerKind.STEP_TIMEOUT, now + step_def.timeout))
    bounds = step_def.agent_loop
    first = iteration == 0 and attempt == 1 and step.redispatches == 0
    if first and bounds is not None and bounds.max_duration is not None:
        start = step.started_at if step.started_at is not None else now
        new.append(_timer(run, step, TimerKind.MAX_DURATION, start + bounds.max_duration))
    return Accepted(run=_with_step(run, step), effects=effects + tuple(new))


def _wait(
    run: Run, step: Step, iteration: int, attempt: int, due: float, effects: tuple[Effect, ...]
) -> Accepted:
    step = replace(
        step,
        status=StepStatus.WAITING,
        iteration=iteration,
        attempt=attempt,
        wake_at=due,
        redispatches=0,
    )
    timer = _timer(run, step, TimerKind.WAKE, due)
    return Accepted(run=_with_step(run, step), effects=(*effects, timer))


def _timer(run: Run, step: Step, kind: TimerKind, due: float) -> SetTimer:
    return SetTimer(
        run_id=run.run_id,
        step_id=step.step_id,
        kind=kind,
        iteration=step.iteration,
        attempt=step.attempt,
        due=due,
    )


def _fail_step(
    run: Run, step: Step, error: str, now: float, effects: tuple[Effect, ...] = ()
) -> Accepted:
    failed = replace(
        step,
        status=StepStatus.FAILED,
        error=error,
        finished_at=now,
        wake_at=None,
        waiting_for_input=False,
    )
    run = _with_step(run, failed)
    effects = (*effects, _inputs(run, failed, close=True))
    return _finish(run, RunStatus.FAILED, f"step {step.step_id} failed: {error}", now, effects)


def _cancel(run: Run, reason: str, now: float) -> Accepted:
    return _finish(run, RunStatus.CANCELLED, reason, now, ())


def _finish(
    run: Run, status: RunStatus, error: str, now: float, effects: tuple[Effect, ...]
) -> Accepted:
    """End the run: stop every unfinished step, cancel live children, seal the
    journal of each step a handler may hold (a cancel record: its next write
    is refused), tell the parent, and announce the end so running handlers stop."""
    steps = []
    extra: list[Effect] = []
    for step in run.steps:
        if step.status.finished:
            steps.append(step)
            continue
        if step.child_run_id and step.status is StepStatus.RUNNING:
            extra.append(CancelChildRun(child_run_id=step.child_run_id, reason=error))
        elif step.status is not StepStatus.PENDING:
            extra.append(
                StoreCancel(
                    run_id=run.run_id,
                    step_id=step.step_id,
                    iteration=step.iteration,
                    attempt=step.attempt,
                    reason=error,
                )
            )
        # A pending step takes inputs too: they end with it.
        closed = _inputs(run, step, close=True)
        extra.append(replace(closed, status=StepStatus.CANCELLED))
        steps.append(
            replace(
                step,
                status=StepStatus.CANCELLED,
                finished_at=now,
                wake_at=None,
                waiting_for_input=False,
            )
        )
    done = replace(run, status=status, error=error, steps=tuple(steps), finished_at=now)
    extra.append(AnnounceCancel(run_id=run.run_id))
    return Accepted(run=done, effects=effects + tuple(extra) + _notify_parent(done))


def _notify_parent(run: Run) -> tuple[Effect, ...]:
    if not run.parent_run_id:
        return ()
    return (
        NotifyParent(
            parent_run_id=run.parent_run_id,
            parent_step_id=run.parent_step_id,
            child_run_id=run.run_id,
            status=run.status,
            output=run.output,
            error=run.error,
        ),
    )


def _with_step(run: Run, step: Step) -> Run:
    return replace(run, steps=tuple(step if s.step_id == step.step_id else s for s in run.steps))


_TIMED = frozenset({StepStatus.RUNNING, StepStatus.WAITING})


def _decode(raw: bytes) -> object:
    return json.loads(raw) if raw else None
