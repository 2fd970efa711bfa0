"""A step's status, as the engine keeps it and every service reads it.

The engine's rules move a step through these; the inputs service reads them
to decide whether a step still takes inputs and whether a placed input is
done. One enum, and one mapping to and from the contract's ``StepStatus``.
"""

from __future__ import annotations

import enum

from dagnats.engine.v1 import engine_pb2 as pb


class StepStatus(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Completed, failed or cancelled: the step does nothing more."""
        return self in _FINISHED


_FINISHED = frozenset({StepStatus.COMPLETED, StepStatus.FAILED, StepStatus.CANCELLED})
_TO_PROTO = {
    StepStatus.PENDING: pb.STEP_STATUS_PENDING,
    StepStatus.RUNNING: pb.STEP_STATUS_RUNNING,
    StepStatus.WAITING: pb.STEP_STATUS_WAITING,
    StepStatus.COMPLETED: pb.STEP_STATUS_COMPLETED,
    StepStatus.FAILED: pb.STEP_STATUS_FAILED,
    StepStatus.CANCELLED: pb.STEP_STATUS_CANCELLED,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def step_status_to_proto(status: StepStatus) -> pb.StepStatus.ValueType:
    return _TO_PROTO[status]


def step_status_from_proto(status: int) -> StepStatus:
    """The status of a contract's step; an unset one is a step the engine has
    not touched yet (pending)."""
    return _FROM_PROTO.get(pb.StepStatus.ValueType(status), StepStatus.PENDING)


# A run's statuses after which nothing changes it: what a watch of it ends on.
FINAL_RUN_STATUSES = frozenset(
    {pb.RUN_STATUS_COMPLETED, pb.RUN_STATUS_FAILED, pb.RUN_STATUS_CANCELLED}
)
