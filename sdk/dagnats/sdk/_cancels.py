"""How a worker hears, within a fraction of a second, that a run whose
handler it runs was cancelled, without NATS: a poll that leases nothing and
names those runs (``PollTasksRequest.cancel_watch``), held by the engine until
one of them is cancelled (it heard the cancel announced) or its wait ends.

Invariants:

- At most one watch is in flight. It names every run the worker's handlers
  ran when it was sent; a handler that starts on another run is watched by
  sending the watch again, no sooner than ``REWATCH`` after the one before
  (so a worker whose tasks come and go sends a few watches a second, not
  one per task). The engine remembers the cancels it heard lately, so a
  watch sent after the cancel still hears it at once.
- A run heard cancelled is not watched again while its handlers finish.
- A failed watch is sent again after a short backoff; the heartbeat's check
  of the run (``TaskContext.heartbeat``, the worker's keep-alive) is the
  fallback, since a cancel is announced at most once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("dagnats.sdk")

# Shortest time between two watches: the longest a new run waits to be watched.
REWATCH = 0.2
_BACKOFF = 0.5


class CancelWatch:
    """Watches the runs of a worker's running handlers for their cancel.

    Args:
        watch: Sends one watch naming the runs; returns those cancelled
            (none when its wait ended).
        cancelled: Called with each run heard cancelled.
    """

    def __init__(
        self,
        watch: Callable[[Sequence[str]], Awaitable[Sequence[str]]],
        cancelled: Callable[[str], None],
    ) -> None:
        self._watch = watch
        self._cancelled = cancelled
        self._runs: Counter[str] = Counter()
        self._heard: set[str] = set()  # cancelled: not watched again
        self._named: set[str] = set()  # by the watch in flight
        self._changed = asyncio.Event()

    def add(self, run_id: str) -> None:
        """A handler of ``run_id`` started. (The next iteration of a kept task
        is a run the watch names already: nothing to wake.)"""
        self._runs[run_id] += 1
        if run_id not in self._named:
            self._changed.set()

    def remove(self, run_id: str) -> None:
        """A handler of ``run_id`` ended."""
        self._runs[run_id] -= 1
        if self._runs[run_id] <= 0:
            del self._runs[run_id]
            self._heard.discard(run_id)

    def _watched(self) -> set[str]:
        return set(self._runs) - self._heard

    async def run(self) -> None:
        """Watch until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            runs = self._watched()
            if not runs:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._changed.clear()
            sent = loop.time()
            self._named = runs
            call = asyncio.ensure_future(self._watch(sorted(runs)))
            try:
                await self._until_done_or_new(call, runs, sent)
            finally:
                self._named = set()
                if not call.done():
                    call.cancel()
                    await asyncio.wait((call,))
            if call.cancelled():
                continue  # sent again with the new runs
            if (err := call.exception()) is not None:
                log.info("watching for cancels failed (%s); trying again", err)
                await asyncio.sleep(_BACKOFF)
                continue
            for run_id in call.result():
                if run_id in self._runs and run_id not in self._heard:
                    self._heard.add(run_id)
                    self._cancelled(run_id)

    async def _until_done_or_new(
        self, call: asyncio.Future[Sequence[str]], runs: set[str], sent: float
    ) -> None:
        """Return when ``call`` is answered, or when a run it does not name
        is to be watched and ``REWATCH`` has passed since it was sent."""
        loop = asyncio.get_running_loop()
        while not call.done():
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait((call, changed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            if call.done():
                return
            self._changed.clear()
            if self._watched() <= runs:
                continue
            wait = sent + REWATCH - loop.time()
            if wait > 0:
                await asyncio.wait((call,), timeout=wait)
            return
