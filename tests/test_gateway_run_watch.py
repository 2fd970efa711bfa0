"""The gateway's waits on a run: ``GET /runs/{id}?wait=`` and ``GET /runs/{id}/events``.

Handlers wait on gates the test opens (``tests.gates``), so each
change is one the test caused. ``GetRun`` calls are counted at the engine:
the waits make none.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.sdk import Client
from tests.gates import Gates, engine_counting_get_runs
from tests.helpers import wait_for

# GetRun calls the module's engine served, by run id.
GET_RUNS: Counter[str] = Counter()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    """The module's engine, counting the GetRun calls it serves in GET_RUNS."""
    async with engine_counting_get_runs(nats_server.url, GET_RUNS) as server:
        yield server


async def start(http: httpx.AsyncClient, workflow: str) -> str:
    response = await http.post("/runs", json={"workflow": workflow})
    assert response.status_code == 201, response.text
    run_id: str = response.json()["run_id"]
    return run_id


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The ``(event, data)`` pairs of a server-sent event stream."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line == "":
            if "event" in fields:
                yield fields["event"], json.loads(fields["data"])
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


def step_status(run: dict[str, Any], step_id: str) -> str:
    return next(str(s["status"]) for s in run["steps"] if s["step_id"] == step_id)


async def test_the_event_stream_shows_each_change_then_the_end(
    http: httpx.AsyncClient, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run_id = await start(http, name)
    seen: list[tuple[str, dict[str, Any]]] = []
    async with http.stream("GET", f"/runs/{run_id}/events", timeout=None) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for event, data in sse(response):
            seen.append((event, data))
            if event == "run" and step_status(data, "first") == "running":
                gates.open("first")
            if event == "run" and step_status(data, "second") == "running":
                gates.open("second")

    views = [
        (d["status"], step_status(d, "first"), step_status(d, "second"))
        for e, d in seen
        if e == "run"
    ]
    changes = [v for i, v in enumerate(views) if i == 0 or v != views[i - 1]]
    assert changes == [
        ("running", "running", "pending"),
        ("running", "completed", "running"),
        ("completed", "completed", "completed"),
    ]
    assert seen[-1] == ("end", {"status": "completed"})
    assert [e for e, _ in seen[:-1]] == ["run"] * (len(seen) - 1)
    assert seen[-2][1]["output"] == {"step": "second"}
    assert GET_RUNS[run_id] == 0


async def test_a_long_poll_answers_when_the_run_ends(
    engine: EngineServer, http: httpx.AsyncClient, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run_id = await start(http, name)
    waiting = asyncio.create_task(
        http.get(f"/runs/{run_id}", params={"wait": "30s", "if_status": "running"})
    )
    assert engine.watches is not None
    watches = engine.watches
    await wait_for(lambda: run_id in watches, message="the run is watched")
    assert not waiting.done()
    gates.open("first", "second")
    response = await waiting
    assert response.status_code == 200
    assert response.json()["status"] == "completed"
    assert GET_RUNS[run_id] == 0

    # The status already differs from if_status: at once.
    again = await http.get(f"/runs/{run_id}", params={"wait": "30s", "if_status": "running"})
    assert again.json()["status"] == "completed"


async def test_a_long_poll_that_runs_out_answers_the_run_as_it_is(
    http: httpx.AsyncClient, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run_id = await start(http, name)
    response = await http.get(f"/runs/{run_id}", params={"wait": "200ms"})
    assert response.status_code == 200
    assert response.json()["status"] == "running"
    gates.open("first", "second")


async def test_bad_input_is_a_400_and_an_unknown_run_a_404(
    http: httpx.AsyncClient, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run_id = await start(http, name)
    unknown = "ab" * 16
    for path, params, field in [
        ("/runs/not-a-run", {"wait": "1s"}, "run_id"),
        ("/runs/not-a-run/events", {}, "run_id"),
        (f"/runs/{run_id}", {"wait": "soon"}, "wait"),
        (f"/runs/{run_id}", {"wait": "61s"}, "wait"),
        (f"/runs/{run_id}", {"wait": "1s", "if_status": "asleep"}, "if_status"),
    ]:
        response = await http.get(path, params=params)
        assert response.status_code == 400, (path, params, response.text)
        assert response.json()["field"] == field, (path, params)
    for path, params in [(f"/runs/{unknown}", {"wait": "5s"}), (f"/runs/{unknown}/events", {})]:
        response = await http.get(path, params=params)
        assert response.status_code == 404, (path, response.text)
        assert response.json()["code"] == "not_found"
    gates.open("first", "second")


async def test_the_waits_need_the_api_token(engine: EngineServer) -> None:
    config = GatewayConfig(engine_target=engine.target, port=0, api_token="api-secret")
    server = await start_gateway(config)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            run_path = "/runs/" + "0" * 32
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                for path, params in [(run_path, {"wait": "1s"}), (run_path + "/events", {})]:
                    response = await http.get(path, params=params, headers=headers)
                    assert response.status_code == 401, (path, headers)
            good = {"Authorization": "Bearer api-secret"}
            assert (await http.get(run_path + "/events", headers=good)).status_code == 404
            document = (await http.get("/openapi.json", headers=good)).json()
            events = document["paths"]["/runs/{run_id}/events"]["get"]
            assert "text/event-stream" in events["responses"]["200"]["content"]
            waits = document["paths"]["/runs/{run_id}"]["get"]["parameters"]
            assert {p["name"] for p in waits} >= {"wait", "if_status"}
    finally:
        await server.stop()


async def test_an_ended_run_streams_its_state_and_end(
    client: Client, http: httpx.AsyncClient, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    gates.open("first", "second")
    run_id = await start(http, name)
    done = await client.wait_for_run(run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED
    async with http.stream("GET", f"/runs/{run_id}/events") as response:
        seen = [event async for event, _ in sse(response)]
    assert seen == ["run", "end"]
    # A long poll of an ended run answers it at once, with or without if_status.
    for params in ({"wait": "30s"}, {"wait": "30s", "if_status": "completed"}):
        response = await http.get(f"/runs/{run_id}", params=params)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "completed"


async def test_a_journal_follower_of_a_cancelled_run_ends_on_the_cancel(
    http: httpx.AsyncClient, gated: tuple[str, Gates]
) -> None:
    """A cancel writes one journal record, its cancel (the step's gated
    handler never journaled), just after the run's write: the run's watch
    tells the follower it ended, with or without that record before."""
    name, _ = gated
    run_id = await start(http, name)
    path = f"/runs/{run_id}/steps/first/journal"
    async with http.stream("GET", path, params={"follow": "1"}, timeout=None) as response:
        assert response.status_code == 200
        cancelled = await http.post(f"/runs/{run_id}/cancel", json={"reason": "enough"})
        assert cancelled.status_code == 200
        seen = [(event, data) async for event, data in sse(response)]
    assert [(event, data.get("kind")) for event, data in seen[:-1]] in ([], [("record", "cancel")])
    assert seen[-1] == ("end", {"run_status": "cancelled", "step_status": "cancelled"})
    assert GET_RUNS[run_id] == 1, "only the route's own look at the step"
