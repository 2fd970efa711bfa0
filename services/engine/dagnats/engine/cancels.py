"""The cancels an engine hears, for the workers' polls that watch for them.

A worker never connects to NATS, so it hears that a run it serves was
cancelled on a channel it holds already: a poll that names the runs its
handlers run (``PollTasksRequest.cancel_watch``) waits here, and is answered
as soon as the engine hears the cancel announced on ``dagnats.cancel.<run>``
(by whichever engine applied it). Core NATS is at most once, so a cancel may
go unheard; the heartbeat's check of the run stays the fallback.

A poll sent after the cancel was announced still hears it: the runs whose
cancel was heard lately are kept (the newest ``KEPT`` of them), and a watch
that names one answers at once. A cancel announced before this engine
subscribed (it was starting) is not among them: the heartbeat finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

# Runs whose cancel is kept for the watches that come after it.
KEPT = 65_536


class Announcements(Protocol):
    async def hear_cancels(
        self, deliver: Callable[[str], None]
    ) -> Callable[[], Awaitable[None]]: ...


class CancelWatch:
    """The cancels heard since :meth:`start`, and the polls waiting for one."""

    def __init__(self, announcements: Announcements) -> None:
        self._announcements = announcements
        self._heard: OrderedDict[str, None] = OrderedDict()
        self._waiting: dict[str, set[asyncio.Future[str]]] = {}
        self._stop: Callable[[], Awaitable[None]] | None = None
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        """Hear cancels from now on (once; later calls return at once)."""
        async with self._starting:
            if self._stop is None:
                self._stop = await self._announcements.hear_cancels(self.heard)

    async def close(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            with contextlib.suppress(Exception):
                await stop()

    def heard(self, run_id: str) -> None:
        """A cancel of ``run_id`` was announced."""
        self._heard[run_id] = None
        self._heard.move_to_end(run_id)
        while len(self._heard) > KEPT:
            self._heard.popitem(last=False)
        for waiter in self._waiting.pop(run_id, ()):
            if not waiter.done():
                waiter.set_result(run_id)

    def was_heard(self, run_id: str) -> bool:
        """Whether the cancel of ``run_id`` was heard, and is still kept."""
        return run_id in self._heard

    async def wait(self, runs: Sequence[str], longest: float) -> list[str]:
        """The runs of ``runs`` that were cancelled: at once those heard
        already, else the first heard within ``longest`` seconds; none after it."""
        await self.start()
        cancelled = [r for r in runs if r in self._heard]
        if cancelled:
            return cancelled
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        for run_id in runs:
            self._waiting.setdefault(run_id, set()).add(waiter)
        try:
            async with asyncio.timeout(longest):
                return [await waiter]
        except TimeoutError:
            return []
        finally:
            for run_id in runs:
                waiting = self._waiting.get(run_id)
                if waiting is not None:
                    waiting.discard(waiter)
                    if not waiting:
                        del self._waiting[run_id]
