"""An engine hears the other writers' writes of runs (ADR 38), and trusts
what it heard only where nothing can go unheard: on one server, after it
heard one of its own writes, on a connection that has not reconnected since.

Each test has its own engines (stores on connections of their own) on a real
nats-server, and writes runs as the engine does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest_asyncio

from dagnats.core import jetstream as jsx
from dagnats.core.ids import new_run_id
from dagnats.core.natsserver import NatsCluster, NatsServer
from dagnats.engine.config import EngineConfig
from dagnats.engine.heard import HEARD_RUNS, Listening, RunWrites
from dagnats.engine.processor import Engine
from dagnats.engine.store import EngineStore, StoredRun
from dagnats.engine.v1 import internal_pb2 as ipb
from tests.helpers import wait_for


class Writer:
    """One engine's store and what it hears, on a connection of its own."""

    def __init__(
        self, store: EngineStore, heard: RunWrites, unhear: Callable[[], Awaitable[None]]
    ) -> None:
        self.store, self.heard, self._unhear = store, heard, unhear

    @classmethod
    async def open(cls, url: str, topology: jsx.Topology | None = None) -> Writer:
        nc = await jsx.connect(url, name="dagnats-test-writer")
        await jsx.provision(nc.jetstream(), topology)
        store = await EngineStore.open(nc)
        return cls(store, *await store.hear_run_writes())

    async def close(self) -> None:
        await self._unhear()
        await self.store.nc.close()

    async def create(self) -> tuple[str, int]:
        record = ipb.RunRecord()
        record.run.run_id = new_run_id()
        revision = await self.store.create_run(record)
        assert revision is not None
        return record.run.run_id, revision

    async def update(self, run_id: str, revision: int) -> int:
        record = ipb.RunRecord()
        record.run.run_id = run_id
        return await self.store.update_run(record, revision)

    async def settled(self) -> None:
        """Until this engine heard its own writes and has nothing left to hear."""
        await wait_for(lambda: self.heard.mark() is not None, message="own write heard")


@pytest_asyncio.fixture(loop_scope="module")
async def writers(nats_server: NatsServer) -> AsyncIterator[tuple[Writer, Writer]]:
    one, other = await Writer.open(nats_server.url), await Writer.open(nats_server.url)
    yield one, other
    await one.close()
    await other.close()


async def test_an_engine_hears_another_engines_write_of_a_run(
    writers: tuple[Writer, Writer],
) -> None:
    one, other = writers
    run_id, revision = await one.create()
    untouched, _ = await one.create()
    await one.settled()
    mark = one.heard.mark()
    # Its own write is not another writer's.
    revision = await one.update(run_id, revision)
    await one.settled()
    assert one.heard.quiet_since(run_id, mark)
    # Another engine writes the run: heard, for that run only.
    await other.update(run_id, revision)
    await wait_for(lambda: not one.heard.quiet_since(run_id, mark), message="heard")
    await one.settled()
    assert one.heard.quiet_since(untouched, mark)
    # A mark taken after the write trusts the run again.
    assert one.heard.quiet_since(run_id, one.heard.mark())


async def test_nothing_heard_before_a_reconnect_is_trusted(tmp_path: Path) -> None:
    server = await NatsServer.start(tmp_path)
    try:
        one = await Writer.open(server.url)
        try:
            run_id, _ = await one.create()
            await one.settled()
            mark = one.heard.mark()
            assert one.heard.quiet_since(run_id, mark)
            # Publishes sent while the connection is down are lost to it.
            await server.restart()
            await wait_for(
                lambda: one.store.nc.stats["reconnects"] == 1 and one.store.nc.is_connected,
                timeout=20,
                message="reconnected",
            )
            assert not one.heard.quiet_since(run_id, mark)
            assert one.heard.quiet_since(run_id, one.heard.mark())
        finally:
            await one.close()
    finally:
        await server.stop()


async def test_on_a_cluster_nothing_heard_is_trusted(nats_cluster: NatsCluster) -> None:
    # Routes between servers are not ordered with the stream, and drop
    # messages when they reconnect: each kept iteration reads the run.
    one = await Writer.open(nats_cluster.url, jsx.Topology(replicas=3))
    try:
        run_id, revision = await one.create()
        await one.update(run_id, revision)
        assert one.heard.mark() is None
        assert not one.heard.quiet_since(run_id, one.heard.mark())
    finally:
        await one.close()


class Subscription:
    """The numbers a connection gives of the subscription, set by the test."""

    def __init__(self, writes: RunWrites) -> None:
        self.writes = writes
        self.now = Listening(delivered=0, pending=0, reconnects=0)
        writes.listen(lambda: self.now)

    def arrive(self, run_id: str, writer: str | None, *, heard: bool = True) -> None:
        """One publish delivered; heard at once, or left waiting in the queue."""
        delivered, pending, reconnects = self.now
        self.now = Listening(delivered + 1, pending + (0 if heard else 1), reconnects)
        if heard:
            self.writes.heard(run_id, writer)

    def drop(self) -> None:
        """One publish delivered and dropped (a slow consumer)."""
        self.now = self.now._replace(delivered=self.now.delivered + 1)


def test_a_publish_waiting_or_dropped_leaves_nothing_trusted() -> None:
    writes = RunWrites()
    sub = Subscription(writes)
    assert writes.mark() is None, "nothing trusted before an own write is heard"
    sub.arrive("a", writes.writer)
    mark = writes.mark()
    assert writes.quiet_since("a", mark)
    # A publish taken from the socket but not heard yet may be of this run.
    sub.arrive("b", "other", heard=False)
    assert not writes.quiet_since("a", mark)
    sub.now = sub.now._replace(pending=0)
    writes.heard("b", "other")
    assert writes.quiet_since("a", mark)
    # A dropped publish may have been of any run: every earlier mark is doubtful.
    sub.drop()
    assert not writes.quiet_since("a", mark)
    assert writes.quiet_since("a", writes.mark())


def test_runs_heard_long_ago_make_earlier_marks_doubtful() -> None:
    writes = RunWrites()
    sub = Subscription(writes)
    sub.arrive("mine", writes.writer)
    mark = writes.mark()
    for n in range(HEARD_RUNS + 1):
        sub.arrive(f"run{n}", "other")
    # run0's write is forgotten one by one: a mark before it trusts no run.
    assert not writes.quiet_since("mine", mark)
    later = writes.mark()
    assert writes.quiet_since("mine", later)
    assert writes.quiet_since("run0", later)


async def test_a_kept_iteration_is_deferred_only_on_a_run_nobody_wrote_since(
    writers: tuple[Writer, Writer],
) -> None:
    # The engine may leave a kept iteration unwritten only while its last
    # write of the run is still the run as stored: nothing heard of another
    # writer since, or else the revision read is still its own.
    one, other = writers
    engine = Engine(one.store, EngineConfig())
    engine.heard = one.heard
    run_id, revision = await one.create()
    await one.settled()
    mark = one.heard.mark()
    guess = StoredRun((await one.store.require_run(run_id)).record, revision)
    assert await engine._unchanged(guess, mark)
    await other.update(run_id, revision)  # another engine writes the run
    await wait_for(lambda: not one.heard.quiet_since(run_id, mark), message="the write heard")
    assert not await engine._unchanged(guess, mark)
    # Where nothing heard is trusted (a cluster), the read alone decides.
    engine.heard = None
    assert not await engine._unchanged(guess, None)


async def test_a_write_that_names_no_engine_is_another_writers(
    nats_server: NatsServer, writers: tuple[Writer, Writer]
) -> None:
    # A store that does not listen signs none of its writes (an engine on a
    # cluster, or one that has not started listening): its write of a run is
    # heard without a name, and is another writer's, not this engine's own.
    one, _ = writers
    nc = await jsx.connect(nats_server.url, name="dagnats-test-unsigned")
    try:
        unsigned = await EngineStore.open(nc)
        run_id, revision = await one.create()
        await one.settled()
        mark = one.heard.mark()
        record = ipb.RunRecord()
        record.run.run_id = run_id
        await unsigned.update_run(record, revision)
        await wait_for(
            lambda: not one.heard.quiet_since(run_id, mark), message="the unsigned write heard"
        )
    finally:
        await nc.close()
