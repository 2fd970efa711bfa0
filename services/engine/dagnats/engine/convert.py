"""Moves engine values to and from protobuf, and effects to the messages that
carry them out (:func:`outbox_entry`). The only module besides the servicer
and the store that touches generated types for runs and events."""

from __future__ import annotations

from dagnats.core.budget_wire import budget_from_proto, budget_to_proto
from dagnats.core.outcomes import outcome_of
from dagnats.core.status import step_status_from_proto, step_status_to_proto
from dagnats.core.subjects import (
    cancel_subject,
    created_subject,
    history_subject,
    journal_subject,
    purge_timer_subject,
    task_subject,
    timer_subject,
)
from dagnats.core.timestamps import duration_seconds, seconds, timestamp
from dagnats.engine import model as m
from dagnats.engine.convert_workflow import (
    stored_workflow,
    stored_workflow_proto,
)
from dagnats.engine.run_list import created_data
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb

_RUN_STATUS = {
    m.RunStatus.RUNNING: pb.RUN_STATUS_RUNNING,
    m.RunStatus.COMPLETED: pb.RUN_STATUS_COMPLETED,
    m.RunStatus.FAILED: pb.RUN_STATUS_FAILED,
    m.RunStatus.CANCELLED: pb.RUN_STATUS_CANCELLED,
}
_RUN_STATUS_BACK = {v: k for k, v in _RUN_STATUS.items()}
_TIMER_KIND = {
    m.TimerKind.WAKE: ipb.TIMER_KIND_WAKE,
    m.TimerKind.STEP_TIMEOUT: ipb.TIMER_KIND_STEP_TIMEOUT,
    m.TimerKind.MAX_DURATION: ipb.TIMER_KIND_MAX_DURATION,
}
_TIMER_KIND_BACK = {v: k for k, v in _TIMER_KIND.items()}


def run_status_to_proto(status: m.RunStatus) -> pb.RunStatus.ValueType:
    return _RUN_STATUS[status]


def run_status_from_proto(status: pb.RunStatus.ValueType) -> m.RunStatus:
    return _RUN_STATUS_BACK[status]


def step_to_proto(step: m.Step) -> pb.StepState:
    msg = pb.StepState(
        step_id=step.step_id,
        status=step_status_to_proto(step.status),
        iteration=step.iteration,
        attempt=step.attempt,
        iterations=step.iterations,
        output=step.output,
        error=step.error,
        child_run_id=step.child_run_id,
        waiting_for_input=step.waiting_for_input,
        build_id=step.build,
    )
    for name in ("started_at", "dispatched_at", "finished_at", "wake_at"):
        value = getattr(step, name)
        if value is not None:
            getattr(msg, name).CopyFrom(timestamp(value))
    return msg


def step_from_proto(msg: pb.StepState, record: ipb.StepRecord | None) -> m.Step:
    def opt(name: str) -> float | None:
        return seconds(getattr(msg, name), msg.HasField(name))  # type: ignore[arg-type]

    return m.Step(
        step_id=msg.step_id,
        status=step_status_from_proto(msg.status),
        iteration=msg.iteration,
        attempt=msg.attempt,
        iterations=msg.iterations,
        failures=record.failures if record else 0,
        redispatches=record.redispatches if record else 0,
        kept_seq=record.kept_seq if record else 0,
        output=msg.output,
        error=msg.error,
        child_run_id=msg.child_run_id,
        started_at=opt("started_at"),
        dispatched_at=opt("dispatched_at"),
        finished_at=opt("finished_at"),
        wake_at=opt("wake_at"),
        waiting_for_input=msg.waiting_for_input,
        build=msg.build_id,
    )


def run_to_proto(run: m.Run) -> pb.Run:
    msg = pb.Run(
        run_id=run.run_id,
        workflow=run.workflow.name,
        status=_RUN_STATUS[run.status],
        input=run.input,
        output=run.output,
        error=run.error,
        steps=[step_to_proto(s) for s in run.steps],
        parent_run_id=run.parent_run_id,
        parent_step_id=run.parent_step_id,
        idempotency_key=run.idempotency_key,
        settings=dict(run.settings),
    )
    if run.forked_from is not None:
        origin = run.forked_from
        msg.forked_from.CopyFrom(
            pb.ForkOrigin(run_id=origin.run_id, step_id=origin.step_id, at_seq=origin.at_seq)
        )
    if run.budget is not None:
        msg.budget.CopyFrom(budget_to_proto(run.budget))
    msg.created_at.CopyFrom(timestamp(run.created_at))
    if run.finished_at is not None:
        msg.finished_at.CopyFrom(timestamp(run.finished_at))
    return msg


def record_to_proto(
    run: m.Run,
    outbox: list[ipb.OutboxEntry],
    outbox_since: float | None,
    trace_context: dict[str, str],
) -> ipb.RunRecord:
    record = ipb.RunRecord(
        run=run_to_proto(run),
        workflow=stored_workflow_proto(run.workflow),
        outbox=outbox,
        trace_context=trace_context,
    )
    for step in run.steps:
        if step.failures or step.redispatches or step.kept_seq:
            record.step_records[step.step_id].CopyFrom(
                ipb.StepRecord(
                    failures=step.failures,
                    redispatches=step.redispatches,
                    kept_seq=step.kept_seq,
                )
            )
    if outbox and outbox_since is not None:
        record.outbox_since.CopyFrom(timestamp(outbox_since))
    return record


def record_from_proto(record: ipb.RunRecord) -> m.Run:
    msg = record.run
    return m.Run(
        run_id=msg.run_id,
        workflow=stored_workflow(record.workflow),
        status=_RUN_STATUS_BACK[msg.status],
        input=msg.input,
        output=msg.output,
        error=msg.error,
        steps=tuple(step_from_proto(s, record.step_records.get(s.step_id)) for s in msg.steps),
        created_at=msg.created_at.ToNanoseconds() / 1e9,
        parent_run_id=msg.parent_run_id,
        parent_step_id=msg.parent_step_id,
        idempotency_key=msg.idempotency_key,
        finished_at=seconds(msg.finished_at, msg.HasField("finished_at")),
        settings=tuple(sorted(msg.settings.items())),
        forked_from=_origin(msg),
        budget=budget_from_proto(msg.budget) if msg.HasField("budget") else None,
    )


def _origin(msg: pb.Run) -> m.ForkOrigin | None:
    if not msg.HasField("forked_from"):
        return None
    o = msg.forked_from
    return m.ForkOrigin(run_id=o.run_id, step_id=o.step_id, at_seq=o.at_seq)


# ---- events -----------------------------------------------------------------------


def outcome_to_event(
    outcome: pb.Continue | pb.Complete | pb.Fail | pb.Pause, event: ipb.HistoryEvent
) -> None:
    match outcome:
        case pb.Continue():
            getattr(event, "continue").CopyFrom(outcome)
        case pb.Complete():
            event.complete.CopyFrom(outcome)
        case pb.Fail():
            event.fail.CopyFrom(outcome)
        case pb.Pause():
            event.pause.CopyFrom(outcome)


def event_to_input(event: ipb.HistoryEvent) -> m.RunInput | None:
    """The rule input an event carries; None for events the rules do not take
    (a child-run start, which the processor handles itself)."""
    kind = event.WhichOneof("kind")
    identity = (
        m.Identity(iteration=event.iteration, attempt=event.attempt) if event.attempt > 0 else None
    )
    outcome: m.StepOutcome
    if kind == "continue":
        cont = getattr(event, "continue")
        outcome = m.Continued(output=cont.output, wait=wait_from_proto(cont))
    elif kind == "complete":
        outcome = m.Completed(output=event.complete.output)
    elif kind == "fail":
        failure = (
            m.FailureKind.PERMANENT
            if event.fail.kind == pb.FAILURE_KIND_PERMANENT
            else m.FailureKind.RETRIABLE
        )
        outcome = m.Failed(error=event.fail.error, kind=failure, reason=event.fail.reason)
    elif kind == "pause":
        outcome = m.Paused(duration=duration_seconds(event.pause.duration))
    elif kind == "cancel":
        return m.CancelRequested(reason=event.cancel.reason)
    elif kind == "input":
        return m.InputArrived(step_id=event.step_id)
    elif kind == "child":
        return m.ChildEnded(
            step_id=event.step_id,
            child_run_id=event.child.child_run_id,
            status=_RUN_STATUS_BACK[event.child.status],
            output=event.child.output,
            error=event.child.error,
        )
    else:
        return None
    return m.StepReport(
        step_id=event.step_id,
        identity=identity,
        outcome=outcome,
        journal_seq=event.journal_seq,
        kept_seq=event.kept_seq,
        build=event.build_id,
    )


def wait_from_proto(cont: pb.Continue) -> m.Wait | None:
    if not cont.HasField("wait"):
        return None
    w = cont.wait
    return m.Wait(
        delay=duration_seconds(w.delay) if w.HasField("delay") else None,
        until=seconds(w.until, w.HasField("until")),
        until_input=w.until_input,
    )


def timer_to_input(timer: ipb.Timer) -> m.TimerFired:
    return m.TimerFired(
        step_id=timer.step_id,
        kind=_TIMER_KIND_BACK[timer.kind],
        iteration=timer.iteration,
        attempt=timer.attempt,
    )


def timer_to_proto(effect: m.SetTimer, trace_context: dict[str, str]) -> ipb.Timer:
    msg = ipb.Timer(
        run_id=effect.run_id,
        step_id=effect.step_id,
        kind=_TIMER_KIND[effect.kind],
        iteration=effect.iteration,
        attempt=effect.attempt,
        trace_context=trace_context,
    )
    msg.due.CopyFrom(timestamp(effect.due))
    return msg


def task_to_proto(effect: m.DispatchTask, trace_context: dict[str, str]) -> pb.Task:
    task = _task(effect, trace_context)
    if effect.budget is not None:
        task.budget.CopyFrom(budget_to_proto(effect.budget))
    return task


def _task(effect: m.DispatchTask, trace_context: dict[str, str]) -> pb.Task:
    return pb.Task(
        run_id=effect.run_id,
        step_id=effect.step_id,
        task_type=effect.task_type,
        iteration=effect.iteration,
        attempt=effect.attempt,
        input=effect.input,
        workflow=effect.workflow,
        trace_context=trace_context,
        settings=dict(effect.settings),
    )


# ---- journal records ----------------------------------------------------------


def journal_mark(record: jpb.Record, delivery: int) -> m.JournalMark:
    """What the rules need of a stored journal record: its dispatch, its
    writer's delivery and, for a commit, its outcome."""
    commit: m.StepOutcome | None = None
    if record.HasField("commit"):
        field, outcome = outcome_of(record.commit)
        event = ipb.HistoryEvent(iteration=record.iteration, attempt=record.attempt)
        getattr(event, field).CopyFrom(outcome)
        report = event_to_input(event)
        assert isinstance(report, m.StepReport)
        commit = report.outcome
    return m.JournalMark(
        seq=record.seq,
        iteration=record.iteration,
        attempt=record.attempt,
        commit=commit,
        delivery=delivery,
        build=record.commit.build_id,
    )


def pinned_build_of(record: ipb.RunRecord, step: pb.StepState) -> str:
    """``rules.pinned_build`` of a stored run's step, read from the record."""
    upgrade = record.workflow.build_policy == pb.BUILD_POLICY_UPGRADE
    return "" if upgrade else step.build_id


def holder_build(tail: jpb.Record, iteration: int) -> str:
    """The build of the holder that appended ``tail``, a step's last journal
    record, when it is a record of ``iteration`` (its claim's build, or its
    commit's); "" for an earlier iteration's record, whose records the next
    holder of ``iteration`` does not replay."""
    if tail.iteration != iteration:
        return ""
    return tail.build_id or tail.commit.build_id


def task_msg_id(run_id: str, step_id: str, iteration: int, attempt: int) -> str:
    """The Msg-Id of a dispatch's task (a re-dispatch appends ``.r<n>``)."""
    return f"{run_id}.{step_id}.{iteration}.{attempt}"


def created_run_entry(run: pb.Run) -> ipb.OutboxEntry:
    """The run's entry in the runs by creation time (``RUNS_CREATED``), in
    its first outbox: published beside the run's write, or by the reconciler
    when the create stopped before, and deduplicated by its Msg-Id."""
    return ipb.OutboxEntry(
        subject=created_subject(run.run_id),
        data=created_data(run.workflow, run.created_at.ToNanoseconds()),
        msg_id=f"{run.run_id}.created",
    )


def outbox_entry(effect: m.Effect, headers: dict[str, str], now: float) -> ipb.OutboxEntry:
    """The message that carries out ``effect``: its subject, its data, the
    Msg-Id that makes publishing it twice harmless, and ``headers`` (the trace
    context it is stamped with); an event is stamped ``now``."""
    match effect:
        case m.DispatchTask():
            task = task_to_proto(effect, headers)
            msg_id = task_msg_id(effect.run_id, effect.step_id, effect.iteration, effect.attempt)
            if effect.redispatch:
                msg_id += f".r{effect.redispatch}"
            subject = task_subject(effect.task_type, effect.run_id, effect.step_id, effect.build)
            return ipb.OutboxEntry(
                subject=subject, data=task.SerializeToString(), msg_id=msg_id, headers=headers
            )
        case m.SetTimer():
            timer = timer_to_proto(effect, headers)
            msg_id = (
                f"{effect.run_id}.{effect.step_id}.{effect.kind.value}"
                f".{effect.iteration}.{effect.attempt}"
            )
            return ipb.OutboxEntry(
                subject=timer_subject(effect.run_id, effect.step_id),
                data=timer.SerializeToString(),
                msg_id=msg_id,
                headers=headers,
            )
        case m.PurgeLater():
            purge = ipb.Timer(
                run_id=effect.run_id, kind=ipb.TIMER_KIND_PURGE, trace_context=headers
            )
            purge.due.CopyFrom(timestamp(effect.due))
            return ipb.OutboxEntry(
                subject=purge_timer_subject(effect.run_id),
                data=purge.SerializeToString(),
                msg_id=f"{effect.run_id}.purge",
                headers=headers,
            )
        case m.StartChildRun():
            event = ipb.HistoryEvent(
                run_id=effect.child_run_id,
                trace_context=headers,
                start=ipb.StartChild(
                    workflow=effect.workflow,
                    input=effect.input,
                    parent_run_id=effect.parent_run_id,
                    parent_step_id=effect.parent_step_id,
                ),
            )
            return _event_entry(event, now, f"{effect.child_run_id}.start", headers)
        case m.CancelChildRun():
            event = ipb.HistoryEvent(
                run_id=effect.child_run_id,
                trace_context=headers,
                cancel=ipb.CancelRequest(reason=effect.reason),
            )
            return _event_entry(event, now, f"{effect.child_run_id}.cancel", headers)
        case m.NotifyParent():
            event = ipb.HistoryEvent(
                run_id=effect.parent_run_id,
                step_id=effect.parent_step_id,
                trace_context=headers,
                child=ipb.ChildFinished(
                    child_run_id=effect.child_run_id,
                    status=run_status_to_proto(effect.status),
                    output=effect.output,
                    error=effect.error,
                ),
            )
            msg_id = f"{effect.parent_run_id}.{effect.parent_step_id}.child.{effect.child_run_id}"
            return _event_entry(event, now, msg_id, headers)
        case m.AnnounceCancel():
            return ipb.OutboxEntry(subject=cancel_subject(effect.run_id), data=b"")
        case m.StoreCancel():
            return cancel_record_entry(effect, now)
        case m.StepInputs():
            event = ipb.HistoryEvent(
                run_id=effect.run_id,
                step_id=effect.step_id,
                iteration=effect.iteration,
                trace_context=headers,
                inputs=ipb.StepInputs(
                    close=effect.close,
                    status=step_status_to_proto(effect.status),
                    iterations=effect.iterations,
                ),
            )
            what = "close" if effect.close else "check"
            msg_id = f"{effect.run_id}.{effect.step_id}.inputs.{what}.{effect.iteration}"
            return _event_entry(event, now, msg_id, headers)


def cancel_record_entry(effect: m.StoreCancel, now: float) -> ipb.OutboxEntry:
    """The cancel record of a step's journal, as an outbox entry: published
    with no expected sequence, so it lands whatever the tail (and fences the
    holder), once per step (its Msg-Id). It names no writer: the engine's."""
    record = jpb.Record(
        run_id=effect.run_id,
        step_id=effect.step_id,
        iteration=effect.iteration,
        attempt=effect.attempt,
        cancel=jpb.Cancel(reason=effect.reason),
    )
    record.time.CopyFrom(timestamp(now))
    return ipb.OutboxEntry(
        subject=journal_subject(effect.run_id, effect.step_id),
        data=record.SerializeToString(),
        msg_id=f"{effect.run_id}.{effect.step_id}.cancel",
        headers={"Dagnats-Kind": "cancel"},
    )


def _event_entry(
    event: ipb.HistoryEvent, now: float, msg_id: str, headers: dict[str, str]
) -> ipb.OutboxEntry:
    event.time.CopyFrom(timestamp(now))
    return ipb.OutboxEntry(
        subject=history_subject(event.run_id),
        data=event.SerializeToString(),
        msg_id=msg_id,
        headers=headers,
    )
