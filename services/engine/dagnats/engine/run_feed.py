"""Live lists of runs for clients (``WatchRuns``): one watch of every run per
engine, however many clients keep a list.

The :class:`RunFeed` holds one ``EngineStore.watch_runs`` (one ordered
consumer on the runs bucket) while any client follows it, and stops it when
the last one leaves: nobody watching costs nothing. It hands each stored
state to every follower's :class:`~dagnats.engine.run_list.RunList`, whose
rules decide what that client is told.

A follower joins the watch first, then reads the stored runs to seed its list
(``EngineStore.latest_runs``: one consumer's pass over the bucket), then
applies what the watch gave meanwhile: a state the read saw already is
skipped by its revision, so a run stored during the read is neither lost nor
sent twice.

Runs are sent without their input, output and the steps' outputs: a list
shows where runs are, and a payload can be megabytes (``GetRun`` has them).
Each state is converted once for all followers, not once per follower.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from dagnats.core.errors import DagnatsError, Unavailable
from dagnats.engine.run_list import Changes, Filter, Listed, RunList
from dagnats.engine.store import EngineStore, StoredRun
from dagnats.engine.v1 import engine_pb2 as pb


def summary(run: pb.Run) -> pb.Run:
    """``run`` without its input, output and step outputs."""
    out = pb.Run()
    out.CopyFrom(run)
    out.ClearField("input")
    out.ClearField("output")
    for step in out.steps:
        step.ClearField("output")
    return out


def listed(stored: StoredRun, *, whole: bool = False) -> Listed[pb.Run]:
    """A stored run as the list rules see it; its view the run without its
    payloads (:func:`summary`), or as stored with ``whole``."""
    run = stored.record.run
    return Listed(
        run_id=run.run_id,
        workflow=run.workflow,
        status=run.status,
        created=run.created_at.ToNanoseconds(),
        revision=stored.revision,
        view=run if whole else summary(run),
    )


class _Follower:
    """One client's list, fed by the watch."""

    def __init__(self, runs: RunList[pb.Run]) -> None:
        self.runs = runs
        # What the watch gave before the list was seeded: the latest per run.
        self.early: dict[str, Listed[pb.Run] | None] | None = {}
        self.wake = asyncio.Event()
        self.failed: DagnatsError | None = None

    def offer(self, run_id: str, state: Listed[pb.Run] | None) -> None:
        if self.early is not None:
            self.early.pop(run_id, None)  # re-inserted last: the order stored
            self.early[run_id] = state
            return
        self.runs.apply(state, run_id=run_id)
        self.wake.set()

    def fail(self, err: DagnatsError) -> None:
        self.failed = err
        self.wake.set()


class RunFeed:
    """The engine's watch of every run, shared by every ``WatchRuns`` call."""

    def __init__(self, store: EngineStore) -> None:
        self._store = store
        self._followers: set[_Follower] = set()
        self._start: asyncio.Task[Callable[[], Awaitable[None]]] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    async def follow(self, filter: Filter) -> AsyncIterator[tuple[bool, Changes[pb.Run]]]:
        """The list for ``filter`` (``True``, every run in it), then its
        changes (``False``, what changed) as runs are stored; never ends by
        itself.

        Raises:
            Unavailable: the engine is stopping, or the watch could not start.
        """
        follower = _Follower(RunList(filter))
        self._followers.add(follower)
        try:
            await self._watching()
            seeded = [listed(stored) for stored in await self._store.latest_runs()]
            early, follower.early = follower.early or {}, None
            snapshot = follower.runs.seed(seeded)
            for run_id, state in early.items():
                follower.runs.apply(state, run_id=run_id)
            yield True, Changes(snapshot, [])
            while True:
                changes = follower.runs.take()
                if changes is not None:
                    yield False, changes
                    continue
                if follower.failed is not None:
                    raise follower.failed
                await follower.wake.wait()
                follower.wake.clear()
        finally:
            self._leave(follower)

    async def _watching(self) -> None:
        """Return once the watch is in place, starting it when need be."""
        if self._start is None:
            self._start = asyncio.create_task(
                self._store.watch_runs(self._deliver), name="watch-runs"
            )
        start = self._start
        try:
            await asyncio.shield(start)
        except Exception:
            if self._start is start and start.done():
                self._start = None  # the next follower tries again
            raise

    def _deliver(self, run_id: str, stored: StoredRun | None) -> None:
        if not self._followers:
            return
        state = None if stored is None else listed(stored)
        for follower in list(self._followers):
            follower.offer(run_id, state)

    def _leave(self, follower: _Follower) -> None:
        self._followers.discard(follower)
        if self._followers or self._start is None:
            return
        start, self._start = self._start, None
        task = asyncio.create_task(_stop(start), name="stop-watch-runs")
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def __len__(self) -> int:
        """How many clients follow the feed."""
        return len(self._followers)

    @property
    def watching(self) -> bool:
        """Whether the watch is in place (or starting)."""
        return self._start is not None

    async def close(self) -> None:
        """End every follower with ``Unavailable`` (it follows another engine)."""
        for follower in list(self._followers):
            follower.fail(Unavailable("the engine is stopping"))
        if self._start is not None:
            start, self._start = self._start, None
            await _stop(start)
        for task in list(self._stopping):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _stop(start: asyncio.Task[Callable[[], Awaitable[None]]]) -> None:
    try:
        stop = await start
    except Exception:  # it never started: nothing to stop
        return
    await stop()
