"""``ListRuns`` reads about its page, not every stored run: the pure rules of
a page (``run_list.newest``, ``run_list.page_is_whole``), then the engine's
answers, equal to what a read of every stored run gives whatever the filter
and the limit (runs rewritten long after they were created, runs purged),
and what nats-server sent the engine to answer the newest ten of 400 runs.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest_asyncio

from dagnats.core.natsserver import NatsServer
from dagnats.engine.run_list import Filter, Listed, newest, page_is_whole
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client
from tests.stack import FAST, loop_workflow, unique

RUNNING, CANCELLED = pb.RUN_STATUS_RUNNING, pb.RUN_STATUS_CANCELLED
STORED = 400  # runs stored before the page of the cost test
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
