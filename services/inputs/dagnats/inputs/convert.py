"""Protobuf to the plain values of :mod:`dagnats.inputs.rules` and back."""

from __future__ import annotations

from dagnats.core.status import step_status_from_proto
from dagnats.core.timestamps import timestamp
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.inputs import rules
from dagnats.inputs.rules import InputState, Mode, Status
from dagnats.inputs.v1 import inputs_pb2 as pb

_MODE = {
    pb.MODE_STEER: Mode.STEER,
    pb.MODE_FOLLOW_UP: Mode.FOLLOW_UP,
    pb.MODE_APPROVAL: Mode.APPROVAL,
    pb.MODE_BUDGET: Mode.BUDGET,
}
MODE_TO_PROTO = {v: k for k, v in _MODE.items()}
_STATUS = {
    pb.STATUS_QUEUED: Status.QUEUED,
    pb.STATUS_PLACED: Status.PLACED,
    pb.STATUS_DONE: Status.DONE,
    pb.STATUS_UNANSWERED: Status.UNANSWERED,
    pb.STATUS_WITHDRAWN: Status.WITHDRAWN,
    pb.STATUS_DROPPED: Status.DROPPED,
    pb.STATUS_EXPIRED: Status.EXPIRED,
}
STATUS_TO_PROTO = {v: k for k, v in _STATUS.items()}


def mode_from_proto(mode: int) -> Mode | None:
    """The mode, or None for an unset or unknown one."""
    return _MODE.get(pb.Mode.ValueType(mode))


def status_from_proto(status: int) -> Status | None:
    """The status, or None for an unset or unknown one."""
    return _STATUS.get(pb.Status.ValueType(status))


def find_step(run: epb.Run, step_id: str) -> epb.StepState | None:
    return next((s for s in run.steps if s.step_id == step_id), None)


def to_proto(state: InputState) -> pb.Input:
    """The wire form of ``state`` (as stored, or as seen: :func:`visible`)."""
    return pb.Input(
        run_id=state.run_id,
        step_id=state.step_id,
        request_id=state.request_id,
        mode=MODE_TO_PROTO[state.mode],
        content=state.content,
        status=STATUS_TO_PROTO[state.status],
        created_at=timestamp(state.created_at),
        updated_at=timestamp(state.updated_at),
        placed_iteration=state.placed_iteration,
        placed_attempt=state.placed_attempt,
        placed_by=state.placed_by,
        created_by=state.created_by,
        reason=state.reason,
    )


def from_proto(message: pb.Input) -> InputState:
    """The plain value of a stored record."""
    return InputState(
        run_id=message.run_id,
        step_id=message.step_id,
        request_id=message.request_id,
        mode=_MODE[message.mode],
        content=message.content,
        status=_STATUS[message.status],
        created_at=message.created_at.ToNanoseconds() / 1e9,
        updated_at=message.updated_at.ToNanoseconds() / 1e9,
        placed_iteration=message.placed_iteration,
        placed_attempt=message.placed_attempt,
        placed_by=message.placed_by,
        created_by=message.created_by,
        reason=message.reason,
    )


def progress(run: epb.Run | None, step_id: str) -> rules.StepProgress | None:
    """What the inputs of ``step_id`` depend on of it (None when the run or
    the step is gone)."""
    step = find_step(run, step_id) if run is not None else None
    if step is None:
        return None
    status = step_status_from_proto(step.status)
    return rules.step_progress(status, step.iteration, step.iterations)


def visible(state: InputState, run: epb.Run | None, *, now: float, window: float) -> InputState:
    """What a client sees of ``state`` given its run (None when the run is gone)."""
    return rules.visible(state, progress(run, state.step_id), now=now, window=window)
