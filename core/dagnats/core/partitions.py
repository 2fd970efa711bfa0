"""Partitions and slots: where a run belongs among the replicas.

A run's id hashes to one of ``SLOTS`` slots (``zlib.crc32``, the same in every
process); the slot is a token in the run's subjects, so a consumer can select
a share of the runs with one filter per slot. The deployment groups the slots
into P partitions (1..64, fixed at provisioning): slot ``s`` is in partition
``s % P``. Pure: no I/O.
"""

from __future__ import annotations

import zlib

SLOTS = 64
"""Slots in subjects; the most partitions a deployment can have."""

__all__ = ["SLOTS", "partition_of", "slot_of", "slots_of"]


def slot_of(run_id: str) -> int:
    """The run's slot, 0..63: a stable hash of its id."""
    return zlib.crc32(run_id.encode()) % SLOTS


def partition_of(run_id: str, partitions: int) -> int:
    """The run's partition, 0..partitions-1, when there are ``partitions``."""
    return slot_of(run_id) % partitions


def slots_of(partition: int, partitions: int) -> tuple[int, ...]:
    """The slots of ``partition``, in ascending order."""
    return tuple(range(partition, SLOTS, partitions))
