"""Partitions and slots: where a run belongs among the replicas.

A run's id hashes to one of ``SLOTS`` slots (``zlib.crc32``, the same in every
process and on every machine); the slot is a token in the run's subjects
(tasks, history, timers, commit events), so a consumer can select a share of
the runs with one filter per slot. The deployment groups the 64 slots into P
partitions (1..64, fixed at provisioning): slot ``s`` is in partition
``s % P``. A replica consumes the partitions it owns.

Pure: no I/O, no clock. Invariants:

- ``slot_of`` depends on the run id only, never on P, so subjects written
  before a replica joined still name the same slot;
- every slot is in exactly one partition, and ``slots_of`` over all partitions
  covers ``range(SLOTS)`` once.
"""

from __future__ import annotations

import zlib

from dagnats.core.errors import InvalidArgument

SLOTS = 64
"""Slots in subjects; the most partitions a deployment can have."""

__all__ = [
    "SLOTS",
    "STANDBY_DELAY",
    "TASK_GROUP",
    "check_partitions",
    "partition_of",
    "pull_priority",
    "slot_of",
    "slots_of",
]

TASK_GROUP = "tasks"
"""The priority group of every task consumer (policy ``prioritized``)."""


STANDBY_DELAY = 0.5
"""Seconds a poll waits on the partitions its replica owns before it also
pulls the others (at priority 1): a burst of an owner's tasks goes to its own
workers as they poll again, not to a worker idle on another replica."""


def pull_priority(partition: int, owned: frozenset[int]) -> int:
    """The priority a poll pulls a partition's tasks with: 0 (first) on the
    partition's owner, 1 on any other replica. nats-server hands a task to a
    pull of priority 1 only when no pull of priority 0 waits on that
    consumer: a task goes to its owner's workers while one of them is
    free, and to any other replica's when none is (a busy owner, or one with
    no workers at all), so no task waits on a replica nobody polls."""
    return 0 if partition in owned else 1


def check_partitions(value: int, *, field: str = "partitions") -> int:
    """The number of partitions, checked at the edge.

    Args:
        value: the number of partitions asked for.
        field: the name of the setting or field, for the error.

    Returns:
        ``value``, an int from 1 to ``SLOTS``.

    Raises:
        InvalidArgument: not an int, or outside 1..64.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{field} must be a whole number from 1 to {SLOTS}", field=field)
    if not 1 <= value <= SLOTS:
        raise InvalidArgument(f"{field} must be from 1 to {SLOTS}, not {value}", field=field)
    return value


def slot_of(run_id: str) -> int:
    """The run's slot, 0..63: a stable hash of its id."""
    return zlib.crc32(run_id.encode()) % SLOTS


def partition_of(run_id: str, partitions: int) -> int:
    """The run's partition, 0..partitions-1, when there are ``partitions`` of them."""
    return slot_of(run_id) % partitions


def slots_of(partition: int, partitions: int) -> tuple[int, ...]:
    """The slots of ``partition``, in ascending order.

    Raises:
        InvalidArgument: ``partitions`` outside 1..64 or ``partition`` not below it.
    """
    check_partitions(partitions)
    if not 0 <= partition < partitions:
        raise InvalidArgument(
            f"partition must be from 0 to {partitions - 1}, not {partition}", field="partition"
        )
    return tuple(range(partition, SLOTS, partitions))
