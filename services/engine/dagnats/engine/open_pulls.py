"""The task pulls of a replica's polls, kept open from one poll to the next.

A poll names many task consumers: its task types, their build lanes, every
partition. It pulls each, and the first that brings tasks answers it. A pull
request cannot be withdrawn: nats-server drops one whose inbox is gone when
it next looks for a taker, but one it chose for a task just before the inbox
went sends that task to nobody, and the task waits out its lease (the task's
ack wait, 30 s by default) before it is delivered again. Polls withdrew the
pulls that lost the race, and a burst of tasks across partitions lost one
now and then.

So a pull, once sent, is read to its end: each consumer has at most one
pull open, a poll that names the consumer waits on the open one rather than
sending another, and a poll answered leaves the others open for the next
poll. What a pull brings is ready for whichever poll of this replica takes
it first; what no poll takes within ``HOLD`` seconds is given back
(delivered again at once), so a task never waits on a replica whose workers
are busy. The one withdrawal left is a worker's leaving: when the last poll
waiting on an open pull is cancelled, the pull goes with it, so that a
build whose workers are gone shows as gone (``build_present`` counts a
waiting pull, and a recent delivery, as a worker there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from dagnats.core.partitions import STANDBY_DELAY
from dagnats.engine.store import Delivery

log = logging.getLogger(__name__)

HOLD = STANDBY_DELAY
"""Seconds a pulled task waits for a poll of this replica before it is given back."""


class Lane(NamedTuple):
    """A task consumer a poll pulls: a task type, a build (its lane), a
    partition, and the pull's priority (``pull_priority``)."""

    task_type: str
    build: str
    partition: int
    priority: int


Pull = Callable[[Lane, int, float], Awaitable[list[Delivery]]]
GiveBack = Callable[[list[Delivery]], Awaitable[None]]


class OpenPulls:
    """The open pulls of one replica, by consumer, and what they brought.

    ``pull(lane, batch, seconds)`` pulls up to ``batch`` tasks of a lane,
    waiting up to ``seconds`` for the first; ``give_back`` hands tasks back
    for another taker."""

    def __init__(self, pull: Pull, give_back: GiveBack, *, hold: float = HOLD) -> None:
        self._pull = pull
        self._give_back = give_back
        self._hold = hold
        self._open: dict[tuple[str, str, int], asyncio.Task[list[Delivery]]] = {}
        self._ready: dict[tuple[str, str, int], list[tuple[Delivery, float]]] = {}
        self._arrival: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._closed = False
        self.polls_waiting = 0  # polls waiting now for what the pulls bring
        self._waiting: dict[tuple[str, str, int], int] = {}  # polls waiting, by consumer

    async def fetch(self, lanes: Sequence[Lane], max_tasks: int, wait: float) -> list[Delivery]:
        """Up to ``max_tasks`` tasks of ``lanes``, waiting up to ``wait``
        seconds for the first: those of priority 0 (the partitions this
        replica owns) at once, the others once ``STANDBY_DELAY`` (half the
        wait at most) passed with nothing, or at once when none is of
        priority 0."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + wait
        first = [lane for lane in lanes if lane.priority == 0] or list(lanes)
        standby = [lane for lane in lanes if lane not in first]
        standby_at = loop.time() + min(STANDBY_DELAY, wait / 2) if standby else None
        chosen = first
        waited: set[tuple[str, str, int]] = set()
        try:
            while True:
                got = self._take(chosen, max_tasks)
                now = loop.time()
                if got or now >= ends or self._closed:
                    return got
                if standby_at is not None and now >= standby_at:
                    chosen, standby_at = [*first, *standby], None
                for lane in chosen:
                    key = self._ensure_open(lane, max_tasks, ends - now)
                    if key not in waited:
                        waited.add(key)
                        self._waiting[key] = self._waiting.get(key, 0) + 1
                self.polls_waiting += 1
                try:
                    await self._arrived(min(ends, standby_at or ends) - now)
                finally:
                    self.polls_waiting -= 1
        except asyncio.CancelledError:
            self._left(waited, withdraw=True)  # its worker went away
            raise
        finally:
            self._left(waited, withdraw=False)

    def _left(self, keys: set[tuple[str, str, int]], *, withdraw: bool) -> None:
        """A poll that waited on ``keys`` left; with ``withdraw`` (its worker
        went away), the open pulls no other poll waits on are withdrawn."""
        for key in keys:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
                if withdraw:
                    self._withdraw(key)
        keys.clear()

    async def close(self) -> None:
        """Stop every open pull and give back what is ready."""
        self._closed = True
        pulls = list(self._open.values())
        for task in pulls:
            task.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)
        ready = [d for waiting in self._ready.values() for d, _ in waiting]
        self._ready.clear()
        await self._give_back(ready)
        for later in list(self._tasks):
            later.cancel()  # nothing is ready any more
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._notify()

    # ---- the open pulls ----------------------------------------------------------

    def _withdraw(self, key: tuple[str, str, int]) -> None:
        """Withdraw the open pull of ``key``: no poll waits for what it would
        bring. A task chosen for it just as it goes may wait out its lease:
        the cost of a worker leaving, not of a poll answered."""
        if (task := self._open.get(key)) is not None:
            task.cancel()

    def _take(self, lanes: Sequence[Lane], max_tasks: int) -> list[Delivery]:
        got: list[Delivery] = []
        for lane in lanes:
            waiting = self._ready.get(lane[:3])
            while waiting and len(got) < max_tasks:
                got.append(waiting.pop(0)[0])
        return got

    def _ensure_open(self, lane: Lane, batch: int, seconds: float) -> tuple[str, str, int]:
        key = (lane.task_type, lane.build, lane.partition)
        if key not in self._open:
            task = asyncio.ensure_future(self._pulled(lane, batch, seconds))
            self._open[key] = task
            task.add_done_callback(lambda done: self._landed(key, done))
        return key

    async def _pulled(self, lane: Lane, batch: int, seconds: float) -> list[Delivery]:
        try:
            return await self._pull(lane, batch, max(seconds, 0.05))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the connection is reconnecting: the next poll tries again
            log.warning("pull of %s failed: %r", lane, err)
            await asyncio.sleep(STANDBY_DELAY)
            return []

    def _landed(self, key: tuple[str, str, int], task: asyncio.Task[list[Delivery]]) -> None:
        if self._open.get(key) is task:
            del self._open[key]
        if not task.cancelled() and task.exception() is None and (got := task.result()):
            now = asyncio.get_running_loop().time()
            self._ready.setdefault(key, []).extend((d, now) for d in got)
            self._later(self._expire(key, now))
        self._notify()

    async def _expire(self, key: tuple[str, str, int], landed: float) -> None:
        """Give back what landed at ``landed`` and no poll took within ``HOLD``."""
        await asyncio.sleep(self._hold)
        waiting = self._ready.get(key, [])
        stale = [d for d, at in waiting if at <= landed]
        if stale:
            self._ready[key] = [(d, at) for d, at in waiting if at > landed]
            await self._give_back(stale)

    def _later(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- polls waiting --------------------------------------------------------------

    async def _arrived(self, within: float) -> None:
        """Until a pull lands (with tasks or without) or ``within`` seconds pass."""
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._arrival), max(within, 0.0))

    def _notify(self) -> None:
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
