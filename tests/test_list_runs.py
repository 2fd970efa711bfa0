"""``ListRuns`` reads about its page, not every stored run: the pure rules of
a page (``run_list.newest``, ``run_list.page_is_whole``, and through the runs
by creation time ``run_list.candidates``, ``run_list.settle_by_creation``),
then the engine's answers, equal to what a read of every stored run gives
whatever the filter and the limit (runs rewritten long after they were
created, runs purged), what nats-server sent the engine to answer the newest
ten of 400 runs, and of ten behind 200 older runs rewritten since; and the
crash rule of the runs by creation time: an entry with no run is skipped, a
create stopped before its entry is listed once a reconciler pass publishes
its outbox, a run stored before the entries existed is given one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
import pytest_asyncio

from dagnats.core import jetstream as jsx
from dagnats.core import seam
from dagnats.core.ids import new_run_id
from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import created_subject
from dagnats.engine import convert, rules
from dagnats.engine.convert_workflow import stored_workflow
from dagnats.engine.processor import Engine
from dagnats.engine.run_list import (
    Created,
    Filter,
    Listed,
    PageWhole,
    ReadEveryRun,
    ReadMoreEntries,
    candidates,
    created_data,
    created_entry,
    most_loaded,
    newest,
    page_is_whole,
    settle_by_creation,
)
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import CREATED_COMPLETE
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.sdk import Client
from tests.stack import FAST, loop_workflow, unique

RUNNING, CANCELLED = pb.RUN_STATUS_RUNNING, pb.RUN_STATUS_CANCELLED
STORED = 400  # runs stored before the page of the cost test
REWRITTEN = 200  # older runs rewritten after the page's runs were created
PAGE = 10

# ---- the rules ----------------------------------------------------------------------


def run(run_id: str, created: int, *, workflow: str = "w", status: int = RUNNING) -> Listed[str]:
    return Listed(
        run_id=run_id, workflow=workflow, status=status, created=created, revision=1, view=run_id
    )


def test_a_page_is_the_newest_matching_runs_and_the_run_id_breaks_ties() -> None:
    runs = [
        run("a", 1),
        run("c", 3),
        run("b", 3),
        run("x", 4, workflow="v"),
        run("y", 5, status=CANCELLED),
    ]
    page = newest(runs, Filter(workflow="w", status=RUNNING, limit=2))
    assert [r.view for r in page] == ["c", "b"]
    assert [r.view for r in newest(runs, Filter(limit=10))] == ["y", "x", "c", "b", "a"]


def test_a_page_is_whole_once_no_unread_run_can_be_newer_than_its_oldest() -> None:
    full = [run("b", 200), run("a", 100)]
    two = Filter(limit=2)
    # Nothing was left unread: whatever the page holds is all there is.
    assert page_is_whole([], two, unread_before=None, skew=0)
    # Room in the page: an unread run, however old, would belong in it.
    assert not page_is_whole(full[:1], two, unread_before=0, skew=0)
    # An unread run was stored before 90 and created before 90 + 5.
    assert page_is_whole(full, two, unread_before=90, skew=5)
    assert not page_is_whole(full, two, unread_before=95, skew=5)
    assert not page_is_whole(full, two, unread_before=90, skew=10)


def test_an_entry_holds_its_runs_creation_and_workflow() -> None:
    assert created_entry("r1", created_data("wf", 1234)) == Created("r1", "wf", 1234)
    assert created_entry("r1", b"") is None
    assert created_entry("r1", b"soon wf") is None


def test_the_candidates_are_the_entries_of_the_workflow_newest_first_each_run_once() -> None:
    entries = [
        Created("a", "w", 1),
        Created("c", "w", 3),
        Created("b", "w", 3),
        Created("x", "v", 4),
        Created("a", "w", 1),  # published again by a reconciler
    ]
    assert [e.run_id for e in candidates(entries, Filter(workflow="w"))] == ["c", "b", "a"]
    assert [e.run_id for e in candidates(entries, Filter())] == ["x", "c", "b", "a"]


def test_a_page_read_through_the_entries_reads_further_back_or_every_run() -> None:
    full = [run("b", 200), run("a", 100)]
    two = Filter(limit=2)

    def settle(page: list[Listed[str]], before: int | None, *, loaded: int = 2) -> object:
        # 10 entries read, stored from ``before`` to ``before + 10 ms``.
        newest = (before or 0) + 10_000_000
        return settle_by_creation(
            page, two, unread_before=before, loaded=loaded, skew=5, read=10, newest=newest
        )

    # Every entry read: the page is all there is, full or not.
    assert settle(full[:1], None, loaded=1) == PageWhole()
    # An unread entry was stored before 90, its run created before 95.
    assert settle(full, 90) == PageWhole()
    # Before 95: the entries stored since 90 (100 - 5, and 1 ns), at a
    # rate of one a millisecond, and a quarter over; at least a page.
    assert settle(full, 95) == ReadMoreEntries(2)
    assert settle(full, 2_000_095) == ReadMoreEntries(3)  # 2 ms and 1 ns, and a quarter
    # Room in the page: three times as many again.
    assert settle(full[:1], 0, loaded=1) == ReadMoreEntries(30)
    # A status few runs have: past ``most_loaded`` runs loaded, the runs
    # bucket's own read costs less.
    assert settle(full[:1], 0, loaded=most_loaded(two)) == ReadEveryRun()


# ---- the engine ---------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lister(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    """An engine whose reconciler does not rewrite the runs while a test counts
    (its first pass aside), on the module's server. Its clock is the server's
    (one machine): the page needs no allowance for a lead."""
    config = replace(FAST, reconcile_interval=120.0, clock_skew=0.001)
    server = await start_engine(nats_server.url, config=config)
    yield server
    await server.stop()


async def idle_workflow(client: Client) -> str:
    """A workflow whose task no worker takes: its runs stay running."""
    name = unique("listwf")
    await client.register_workflow(loop_workflow(name, unique("nobody")))
    return name


async def test_every_page_is_what_a_read_of_every_run_gives(lister: EngineServer) -> None:
    async with Client(lister.target) as client:
        first, second = await idle_workflow(client), await idle_workflow(client)
        started: list[tuple[str, str]] = []  # (run id, workflow), oldest first
        for n in range(40):
            workflow = first if n % 3 else second
            started.append(((await client.start_run(workflow)).run_id, workflow))
        # Old runs cancelled now are the bucket's newest writes, behind newer
        # runs written once: a page must not take them for new ones.
        cancelled = {run_id for run_id, _ in started[:30:4]}
        for run_id in cancelled:
            await client.cancel_run(run_id)
        purged = {started[0][0], started[8][0]}
        for run_id in purged:
            await client.purge_run(run_id)
        status_of = {run_id: CANCELLED if run_id in cancelled else RUNNING for run_id, _ in started}
        for workflow in ("", first, second):
            for status in (None, RUNNING, CANCELLED):
                for limit in (1, 3, 10, 1000):
                    expected = [
                        run_id
                        for run_id, of in reversed(started)
                        if run_id not in purged
                        and workflow in ("", of)
                        and status in (None, status_of[run_id])
                    ][:limit]
                    listed = await client.list_runs(workflow=workflow, status=status, limit=limit)
                    ids = [r.run_id for r in listed]
                    if workflow:
                        assert ids == expected, (workflow, status, limit)
                    else:  # after ours, the module's older runs, if any
                        assert ids[: len(expected)] == expected, (status, limit)
                    assert all(status in (None, r.status) for r in listed)


async def test_the_newest_ten_of_400_runs_read_about_ten(
    lister: EngineServer, nats_server: NatsServer
) -> None:
    async with Client(lister.target) as client:
        old, new = await idle_workflow(client), await idle_workflow(client)
        starting = asyncio.Semaphore(20)

        async def start() -> None:
            async with starting:
                await client.start_run(old)

        await asyncio.gather(*(start() for _ in range(STORED)))
        newest_first = [(await client.start_run(new)).run_id for _ in range(PAGE)][::-1]
        before = await sent_to(nats_server, "dagnats-engine")
        listed = await client.list_runs(limit=PAGE)
        cost = await sent_to(nats_server, "dagnats-engine") - before
    assert [r.run_id for r in listed] == newest_first
    # A read of the bucket gets each stored run in a message of its own.
    assert cost < STORED / 4, cost


async def sent_to(server: NatsServer, name: str) -> int:
    """Messages nats-server has sent the connection called ``name``."""

    def read() -> int:
        url = f"{server.monitor_url}/connz?limit=1024"
        with urllib.request.urlopen(url, timeout=5) as answer:
            connections = json.loads(answer.read())["connections"]
        (found,) = [c for c in connections if c.get("name") == name]
        return int(found["out_msgs"])

    return await asyncio.to_thread(read)


async def test_the_newest_ten_read_about_ten_though_older_runs_were_rewritten_since(
    lister: EngineServer, nats_server: NatsServer
) -> None:
    """The runs bucket's newest writes are 200 older runs (cancelled after the
    ten were started, as a reconciler pass parks them): the page reads the
    newest entries of the runs by creation time, not the bucket's writes."""
    async with Client(lister.target) as client:
        old, new = await idle_workflow(client), await idle_workflow(client)
        at_once = asyncio.Semaphore(20)

        async def one(call: Callable[[], Awaitable[object]]) -> None:
            async with at_once:
                await call()

        olds = [(await client.start_run(old)).run_id for _ in range(REWRITTEN)]
        newest_first = [(await client.start_run(new)).run_id for _ in range(PAGE)][::-1]
        await asyncio.gather(*(one(functools.partial(client.cancel_run, r)) for r in olds))
        before = await sent_to(nats_server, "dagnats-engine")
        listed = await client.list_runs(limit=PAGE)
        cost = await sent_to(nats_server, "dagnats-engine") - before
        assert [r.run_id for r in listed] == newest_first
        # Through the bucket's newest writes it read every rewritten run.
        assert cost < REWRITTEN / 2, cost
        # A status few runs have falls back on the bucket's read, answering the same.
        cancelled = await client.list_runs(workflow=old, status=CANCELLED, limit=PAGE)
        assert [r.run_id for r in cancelled] == olds[::-1][:PAGE]


async def test_an_entry_with_no_run_is_skipped_and_a_run_with_none_yet_is_listed_after_a_pass(
    lister: EngineServer,
) -> None:
    store = lister.engine.store
    async with Client(lister.target) as client:
        workflow = await idle_workflow(client)
        # A create whose run's write never landed, or a purge stopped
        # between the run and its entry: an entry with no run.
        ghost = new_run_id()
        await store.publish(
            ipb.OutboxEntry(
                subject=created_subject(ghost),
                data=created_data(workflow, time.time_ns()),
                msg_id=f"{ghost}.created",
            )
        )
        kept = (await client.start_run(workflow)).run_id
        assert [r.run_id for r in await client.list_runs(workflow=workflow)] == [kept]

        # A create stopped after the run's write, before its outbox (its
        # first task, its entry) was published: the run has no entry yet.
        run_id = new_run_id()

        async def crash(point: str) -> None:
            if point == "before_first_tasks":
                raise RuntimeError("the engine died storing the run, its entry not published")

        seam.install(crash)
        try:
            with pytest.raises(RuntimeError):
                await create(run_id, workflow, Engine(store, FAST))
        finally:
            seam.install(None)
        assert await store.load_run(run_id) is not None
        assert [r.run_id for r in await client.list_runs(workflow=workflow)] == [kept]
        # A reconciler pass publishes the outbox the create left.
        await Engine(store, FAST, clock=lambda: time.time() + 2 * FAST.outbox_grace).reconcile()
        listed = [r.run_id for r in await client.list_runs(workflow=workflow)]
        assert listed == [run_id, kept]
        await store.delete_run(run_id)
        assert [r.run_id for r in await client.list_runs(workflow=workflow)] == [kept]


async def test_runs_stored_before_the_entries_existed_are_given_one_by_the_engine_that_starts(
    lister: EngineServer,
) -> None:
    store = lister.engine.store
    async with Client(lister.target) as client:
        workflow = await idle_workflow(client)
        started = [(await client.start_run(workflow)).run_id for _ in range(3)]
        # As a deployment from before: no entries, and no mark that they were given.
        for run_id in started:
            await store.purge_subject(jsx.RUNS_CREATED, created_subject(run_id))
        await store.purge_subject(
            f"KV_{jsx.KV_ACTIVE_RUNS}", f"$KV.{jsx.KV_ACTIVE_RUNS}.{CREATED_COMPLETE}"
        )
        assert await client.list_runs(workflow=workflow) == []
        engine = Engine(store, FAST)
        await engine.start()
        await engine.stop()
        listed = [r.run_id for r in await client.list_runs(workflow=workflow)]
        assert listed == started[::-1]
        assert await store.enter_created(convert.created_run_entry) == 0  # once a deployment


async def create(run_id: str, workflow: str, engine: Engine) -> None:
    """Create a run of ``workflow`` (registered) with ``engine`` itself."""
    stored = await engine.store.get_workflow(workflow)
    accepted = rules.start_run(
        run_id=run_id,
        workflow=stored_workflow(stored),
        input=b"",
        now=time.time(),
    )
    await engine.create(accepted, {})
