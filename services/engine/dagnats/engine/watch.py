"""Watching runs for clients (``WatchRun``): one watch of a run per engine,
however many clients watch it.

A :class:`RunHub` holds one ``EngineStore.watch_run`` (one ordered consumer
on the run's key) and hands every stored state of the run, caught up with
its journal (the run now, ``dagnats.engine.runs``) when a watcher is shown
its progress, to each of its
:class:`Watcher`\\ s. The hub stops its watch when its last watcher leaves.

The engine of this process also hands the hub each state of the run it
stores, as it stores it (:meth:`RunWatches.written`). When that
engine wrote the run last, the watch itself waits: until another writer's
write of the run is heard (:meth:`RunWatches.heard`), or ``WATCH_AFTER``.
A run that ends within that time, as most short runs do, needs no consumer
at all; another engine's write is seen at most ``WATCH_AFTER`` late where
writes cannot be heard (a cluster).

What a watcher sends (the contract of ``WatchRun``):

- first the run as the servicer read it (or as the start it served stored
  it), so the answer needs no wait for the hub; then each later state, in
  the order stored;
- a state only when the run as a client sees it (the ``Run`` message) differs
  from the one sent last: a write that only clears the engine's outbox is
  not a change; a state with a revision at or below one sent is not news;
- after a state whose status is final, nothing: the watch ends;
- with ``ended_only``, no state between the first and a final one.

A watcher holds at most ``BUFFER`` states. One that falls further behind
drops the oldest: it skips intermediate states, never the latest one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from dagnats.core.errors import DagnatsError, NotFound, Unavailable
from dagnats.core.grpcutil import as_domain_error
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.engine.runs import Runs
from dagnats.engine.store import StoredRun

BUFFER = 256
# Seconds a hub whose run this engine wrote last waits before it watches.
WATCH_AFTER = 0.05


class Watcher:
    """One client's view of a hub: the states it has yet to send."""

    def __init__(self, first: StoredRun, *, ended_only: bool = False) -> None:
        self.ended_only = ended_only
        self._pending: deque[StoredRun | None] = deque([first], maxlen=BUFFER)
        self._ready = asyncio.Event()
        self._ready.set()
        self._failed: DagnatsError | None = None

    def offer(self, stored: StoredRun | None) -> None:
        """A state the hub saw; None when the run was purged."""
        self._pending.append(stored)
        self._ready.set()

    def fail(self, err: DagnatsError) -> None:
        self._failed = err
        self._ready.set()

    async def changes(self) -> AsyncIterator[StoredRun]:
        """The states to send, by the rules above, until the run has ended.

        Raises:
            NotFound: the run was purged.
            DagnatsError: the hub's watch failed (``Unavailable``: watch again).
        """
        revision, last = 0, None
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                stored = self._pending.popleft()
                if stored is None:
                    raise NotFound("the run was purged", field="run_id")
                if stored.revision <= revision:
                    continue
                revision = stored.revision
                if stored.record.run == last:
                    continue
                if (
                    self.ended_only
                    and last is not None
                    and stored.record.run.status not in FINAL_RUN_STATUSES
                ):
                    continue  # progress, which this watcher does not want
                last = stored.record.run
                yield stored
                if last.status in FINAL_RUN_STATUSES:
                    return
            if self._failed is not None:
                raise self._failed


class RunHub:
    """One run's watch and the watchers that share it. ``wait``: seconds
    before the watch starts, unless :meth:`wake` comes first."""

    def __init__(self, hubs: RunWatches, runs: Runs, run_id: str, wait: float) -> None:
        self._hubs = hubs
        self.run_id = run_id
        self.watchers: set[Watcher] = set()
        self.latest: StoredRun | None = None  # the newest state the hub was given
        self._woken = asyncio.Event()
        self._task = asyncio.create_task(self._pump(runs, wait), name=f"watch-run-{run_id}")

    def offer(self, stored: StoredRun) -> None:
        """A stored state of the run, from the watch or from the engine that
        stored it; one no newer than the newest given is not news."""
        if self.latest is not None and stored.revision <= self.latest.revision:
            return
        self.latest = stored
        for watcher in list(self.watchers):
            watcher.offer(stored)

    def wake(self) -> None:
        """Start the watch now: another writer wrote the run."""
        self._woken.set()

    async def _pump(self, runs: Runs, wait: float) -> None:
        try:
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), wait)
            async for stored in runs.store.watch_run(self.run_id):
                if stored is not None:
                    if any(not w.ended_only for w in self.watchers):
                        # The run now, for watchers shown its progress; a final
                        # state, all the others are sent, needs no catching up.
                        stored = await runs.caught_up_stored(stored)
                    self.offer(stored)
                    continue
                for watcher in list(self.watchers):
                    watcher.offer(None)  # purged
        except Exception as err:
            failed = as_domain_error(err)
            if not isinstance(failed, DagnatsError):
                failed = Unavailable(f"watching run {self.run_id}: {err!r}")
            for watcher in list(self.watchers):
                watcher.fail(failed)
        finally:
            self._hubs.forget(self)

    def leave(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)
        if not self.watchers:
            self._hubs.forget(self)
            self._task.cancel()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class RunWatches:
    """The runs this engine watches for clients, one :class:`RunHub` each.
    ``wrote_last``: whether a state is the one this process's engine stored
    last of its run (its watch may then wait)."""

    def __init__(
        self, runs: Runs, *, wrote_last: Callable[[StoredRun], bool] | None = None
    ) -> None:
        self._runs = runs
        self._wrote_last = wrote_last or (lambda _: False)
        self._hubs: dict[str, RunHub] = {}

    async def follow(
        self, first: StoredRun, *, ended_only: bool = False
    ) -> AsyncIterator[StoredRun]:
        """``first``, then the run's later states by the rules above, until it
        ends; with ``ended_only``, only its final state after ``first``."""
        if first.record.run.status in FINAL_RUN_STATUSES:
            yield first  # it changes no more: no watch needed
            return
        run_id = first.record.run.run_id
        hub = self._hubs.get(run_id)
        if hub is None:
            wait = WATCH_AFTER if self._wrote_last(first) else 0.0
            hub = self._hubs[run_id] = RunHub(self, self._runs, run_id, wait)
        watcher = Watcher(first, ended_only=ended_only)
        if hub.latest is not None:
            # What the hub saw while ``first`` was read (the older is skipped).
            watcher.offer(hub.latest)
        hub.watchers.add(watcher)
        try:
            async for stored in watcher.changes():
                yield stored
        finally:
            hub.leave(watcher)

    def written(self, stored: StoredRun) -> None:
        """A state of a run that this process's engine has just stored."""
        hub = self._hubs.get(stored.record.run.run_id)
        if hub is not None:
            hub.offer(stored)

    def heard(self, run_id: str) -> None:
        """Another writer wrote ``run_id``: its watch starts now."""
        hub = self._hubs.get(run_id)
        if hub is not None:
            hub.wake()

    def forget(self, hub: RunHub) -> None:
        if self._hubs.get(hub.run_id) is hub:
            del self._hubs[hub.run_id]

    def __len__(self) -> int:
        return len(self._hubs)

    def watchers(self, run_id: str) -> int:
        """How many watchers the run has now."""
        hub = self._hubs.get(run_id)
        return len(hub.watchers) if hub is not None else 0

    def __contains__(self, run_id: object) -> bool:
        """Whether the run is watched now."""
        return run_id in self._hubs

    async def close(self) -> None:
        hubs, self._hubs = list(self._hubs.values()), {}
        for hub in hubs:
            await hub.stop()
