"""Which partitions this replica owns (advisory, for speed only).

A stand-in that owns every partition and never changes; the partition
leases replace it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from dagnats.core.partitions import partition_of

__all__ = ["OnChange", "Ownership"]

OnChange = Callable[[frozenset[int]], Awaitable[None] | None]


class Ownership:
    """The partitions this replica owns, and a word when they change."""

    def __init__(self, partitions: int, owned: frozenset[int]) -> None:
        self.partitions = partitions
        self._owned = owned
        self._callbacks: list[OnChange] = []

    @classmethod
    def whole(cls, partitions: int = 1) -> Ownership:
        """Every partition, for good: one engine without leases."""
        return cls(partitions, frozenset(range(partitions)))

    def owned(self) -> frozenset[int]:
        return self._owned

    def owns_run(self, run_id: str) -> bool:
        return partition_of(run_id, self.partitions) in self._owned

    def on_change(self, callback: OnChange) -> None:
        """Call ``callback`` with the new owned set at each change (awaited
        when it returns an awaitable)."""
        self._callbacks.append(callback)

    async def start(self) -> None:
        pass

    async def release(self) -> None:
        pass

    async def stop(self) -> None:
        pass
