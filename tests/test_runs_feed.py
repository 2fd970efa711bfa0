"""The live list of runs: the pure rules of ``dagnats.engine.run_list``, the
engine's ``WatchRuns`` (one watch of the runs bucket for every follower,
stopped when the last leaves; a list that ends equal to ``ListRuns`` however
runs were started around the read that seeded it), the gateway's
``GET /runs/events`` (the list, changes, removals; bad input 400, the API
token).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from dagnats.engine.run_list import Filter, Listed, RunList
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, InvalidArgument
from tests.helpers import wait_for
from tests.stack import unique
from tests.test_gateway_run_watch import sse

RUNNING, DONE = pb.RUN_STATUS_RUNNING, pb.RUN_STATUS_COMPLETED

# ---- the rules ----------------------------------------------------------------------


def state(run_id: str, created: int, revision: int, *, status: int = RUNNING) -> Listed[str]:
    return Listed(
        run_id=run_id,
        workflow="w",
        status=status,
        created=created,
        revision=revision,
        view=f"{run_id}:{status}:{revision}",
    )


def test_the_list_is_the_newest_runs_and_a_newer_run_pushes_out_the_oldest() -> None:
    runs: RunList[str] = RunList(Filter(limit=2))
    shown = runs.seed([state("a", 1, 1), state("c", 3, 3), state("b", 2, 2)])
    assert shown == ["c:1:3", "b:1:2"]
    runs.apply(state("d", 4, 4))
    changes = runs.take()
    assert changes is not None
    assert (changes.runs, changes.removed) == (["d:1:4"], ["b"])
    runs.apply(state("a", 1, 5))  # older than everything shown
    assert runs.take() is None


def test_changes_are_coalesced_per_run_and_a_run_never_told_is_never_removed() -> None:
    runs: RunList[str] = RunList(Filter(limit=2))
    runs.seed([state("a", 1, 1)])
    for revision in range(2, 1000):
        runs.apply(state("a", 1, revision))
    runs.apply(state("b", 2, 1000))
    runs.apply(state("c", 3, 1001))  # pushes out a; b and c are news
    runs.apply(state("d", 4, 1002))  # pushes out b, which was never told
    changes = runs.take()
    assert changes is not None
    assert changes.runs == ["d:1:1002", "c:1:1001"]
    assert changes.removed == ["a"]
    assert len(runs) == 2


def test_a_run_leaves_when_its_status_no_longer_matches_or_it_is_purged() -> None:
    runs: RunList[str] = RunList(Filter(status=RUNNING, limit=10))
    runs.seed([state("a", 1, 1), state("b", 2, 2), state("x", 3, 3, status=DONE)])
    assert len(runs) == 2
    runs.apply(state("a", 1, 4, status=DONE))
    runs.apply(None, run_id="b")
    changes = runs.take()
    assert changes is not None
    assert (changes.runs, changes.removed) == ([], ["a", "b"])
    runs.apply(state("a", 1, 5))  # running again would enter again
    changes = runs.take()
    assert changes is not None and changes.runs == ["a:1:5"]


def test_an_old_state_and_a_write_that_changes_nothing_shown_are_not_news() -> None:
    runs: RunList[str] = RunList(Filter(limit=10))
    runs.seed([state("a", 1, 5)])
    runs.apply(state("a", 1, 4, status=DONE))  # the read saw a later state
    runs.apply(state("a", 1, 3))
    same = Listed(run_id="a", workflow="w", status=RUNNING, created=1, revision=6, view="a:1:5")
    runs.apply(same)  # only the engine's bookkeeping changed
    assert runs.take() is None


def test_a_workflow_filter_shows_only_that_workflow() -> None:
    runs: RunList[str] = RunList(Filter(workflow="w", limit=10))
    other = Listed(run_id="o", workflow="v", status=RUNNING, created=9, revision=9, view="o")
    assert runs.seed([state("a", 1, 1), other]) == ["a:1:1"]
    runs.apply(other)
    assert runs.take() is None


# ---- the engine ---------------------------------------------------------------------


async def idle_workflow(client: Client) -> str:
    """A workflow whose step no worker takes: its runs stay running."""
    name = unique("feed")
    step = {"id": "a", "type": "task", "task": unique("nobody")}
    await client.register_workflow({"name": name, "steps": [step]})
    return name


class Followed:
    """What a follower of ``Client.watch_runs`` holds: run id -> status."""

    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.messages = 0

    def apply(self, message: pb.WatchRunsResponse) -> None:
        self.messages += 1
        if message.snapshot:
            self.runs.clear()
        for run in message.runs:
            assert not run.input and not run.output, "the list carries no payloads"
            self.runs[run.run_id] = run.status
        for run_id in message.removed:
            self.runs.pop(run_id, None)


@contextlib.asynccontextmanager
async def following(client: Client, **options: Any) -> AsyncIterator[Followed]:
    followed = Followed()
    first = asyncio.Event()

    async def read() -> None:
        async for message in client.watch_runs(**options):
            followed.apply(message)
            first.set()

    task = asyncio.create_task(read())
    try:
        waiting = asyncio.create_task(first.wait())
        await asyncio.wait([task, waiting], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            task.result()  # raises what the watch raised
        assert first.is_set(), "no first message within 10s"
        yield followed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_list_ends_equal_to_list_runs_with_runs_started_around_its_read(
    client: Client,
) -> None:
    name = await idle_workflow(client)
    before = [await client.start_run(name, {"n": n}) for n in range(5)]
    burst = asyncio.gather(*(client.start_run(name, {"n": n}) for n in range(5, 30)))
    async with following(client, workflow=name, limit=10) as followed:
        await burst
        for run in before[:3]:
            await client.cancel_run(run.run_id)

        async def same() -> bool:
            listed = await client.list_runs(workflow=name, limit=10)
            return followed.runs == {r.run_id: r.status for r in listed}

        await wait_for(same, timeout=10, message="the live list equal to ListRuns")
        assert len(followed.runs) == 10


async def test_a_purged_run_leaves_the_list_and_a_list_read_after_it_has_no_trace(
    client: Client,
) -> None:
    name = await idle_workflow(client)
    kept, purged = await client.start_run(name), await client.start_run(name)
    await client.cancel_run(purged.run_id)
    async with following(client, workflow=name) as followed:
        assert set(followed.runs) == {kept.run_id, purged.run_id}
        await client.purge_run(purged.run_id)
        await wait_for(lambda: purged.run_id not in followed.runs, timeout=10)
    # The purge's marker is the bucket's last write: the read ends on it.
    async with following(client, workflow=name) as later:
        assert later.runs == {kept.run_id: RUNNING}


async def test_every_follower_shares_one_watch_which_stops_when_the_last_leaves(
    engine: EngineServer, client: Client
) -> None:
    feed = engine.feed
    assert feed is not None
    name = await idle_workflow(client)
    js = engine.nc.jetstream()
    alone = (await js.stream_info("KV_RUNS")).state.consumer_count
    async with contextlib.AsyncExitStack() as stack:
        lists = [
            await stack.enter_async_context(following(client, workflow=name)) for _ in range(20)
        ]
        assert len(feed) == 20 and feed.watching
        assert (await js.stream_info("KV_RUNS")).state.consumer_count == alone + 1
        run = await client.start_run(name)
        await wait_for(lambda: all(run.run_id in f.runs for f in lists), timeout=10)
    await wait_for(lambda: not feed.watching and len(feed) == 0, timeout=10)

    async def gone() -> bool:
        return bool((await js.stream_info("KV_RUNS")).state.consumer_count <= alone)

    await wait_for(gone, timeout=15, message="the watch's consumer gone")


async def test_a_bad_filter_is_refused(client: Client) -> None:
    for options in ({"limit": 1001}, {"workflow": "a.b"}, {"status": 99}):
        with pytest.raises(InvalidArgument):
            async with following(client, **options):
                pass


# ---- the gateway --------------------------------------------------------------------


async def test_the_gateway_streams_the_list_its_changes_and_removals(
    client: Client, http: httpx.AsyncClient
) -> None:
    name = await idle_workflow(client)
    first = await client.start_run(name, {"big": "x" * 1000})
    params = {"workflow": name, "status": "running", "limit": "2"}
    async with http.stream("GET", "/runs/events", params=params) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = sse(response)
        kind, data = await anext(stream)
        assert kind == "runs"
        assert [(r["run_id"], r["status"], r["input"]) for r in data["runs"]] == [
            (first.run_id, "running", None)
        ]
        second = await client.start_run(name)
        kind, data = await anext(stream)
        assert (kind, [r["run_id"] for r in data["runs"]], data["removed"]) == (
            "change",
            [second.run_id],
            [],
        )
        third = await client.start_run(name)  # the list holds two: the first leaves
        kind, data = await anext(stream)
        assert ([r["run_id"] for r in data["runs"]], data["removed"]) == (
            [third.run_id],
            [first.run_id],
        )
        await client.cancel_run(third.run_id)  # no longer running: it leaves
        kind, data = await anext(stream)
        assert (data["runs"], data["removed"]) == ([], [third.run_id])


async def test_bad_live_list_requests_are_a_400_naming_the_field(http: httpx.AsyncClient) -> None:
    for params, field in [
        ({"limit": "1001"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"workflow": "a.b"}, "workflow"),
        ({"workflow": "w" * 65}, "workflow"),
        ({"status": "asleep"}, "status"),
    ]:
        response = await http.get("/runs/events", params=params)
        assert response.status_code == 400, (params, response.text)
        assert response.json()["field"] == field, params
