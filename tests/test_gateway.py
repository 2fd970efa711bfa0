"""The HTTP gateway end to end: the spec's agent driven through REST alone, the
journal as a page and as server-sent events (reconnects, many followers), and
bad input answered with JSON errors that store nothing."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
import yaml

from dagnats.core.jetstream import JOURNAL
from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer
from dagnats.gateway import GatewayConfig, GatewayServer, start_gateway
from dagnats.sdk import TaskContext, Worker
from dagnats.sdk.testing import ScriptedModel
from examples.agent_turn.handler import make_agent_turn
from tests.helpers import wait_for
from tests.stack import loop_workflow, unique

WORKFLOW = Path(__file__).parent.parent / "examples" / "agent_turn" / "workflow.yaml"


@dataclass
class Event:
    id: int
    data: dict[str, Any]


@asynccontextmanager
async def events(
    http: httpx.AsyncClient, path: str, *, last_event_id: int | None = None
) -> AsyncIterator[AsyncIterator[Event]]:
    """A journal event stream: ``async for event in stream`` until the caller leaves."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    async with http.stream("GET", path, headers=headers, timeout=None) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")

        async def parse() -> AsyncIterator[Event]:
            fields: dict[str, str] = {}
            async for line in response.aiter_lines():
                if line == "":
                    if fields.get("event") == "record":
                        yield Event(int(fields["id"]), json.loads(fields["data"]))
                    fields = {}
                elif not line.startswith(":"):
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")

        yield parse()


async def collect(stream: AsyncIterator[Event], *, until: Any) -> list[Event]:
    """Events from ``stream`` up to and including the first that ``until`` accepts."""
    got = []
    async for event in stream:
        got.append(event)
        if until(event.data):
            return got
    raise AssertionError(f"the stream ended after {len(got)} events")


def is_commit(action: str) -> Any:
    return lambda record: record["kind"] == "commit" and record["commit"]["action"] == action


async def page(http: httpx.AsyncClient, run_id: str, step: str = "agent") -> list[dict[str, Any]]:
    response = await http.get(f"/runs/{run_id}/steps/{step}/journal", params={"limit": 1000})
    assert response.status_code == 200, response.text
    records: list[dict[str, Any]] = response.json()["records"]
    return records


async def step_of(http: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    got = await http.get(f"/runs/{run_id}")
    assert got.status_code == 200, got.text
    step: dict[str, Any] = got.json()["steps"][0]
    return step


class GatedModel:
    """The scripted model, holding its first call until the test lets it go."""

    def __init__(self, script: list[Any]) -> None:
        self.scripted = ScriptedModel(script)
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def __call__(self, history: Any) -> Any:
        if self.scripted.calls == 0:
            self.entered.set()
            await self.release.wait()
        return await self.scripted(history)


async def test_the_spec_agent_driven_through_rest_alone(
    http: httpx.AsyncClient, engine: EngineServer
) -> None:
    name, task = unique("rest-agent"), unique("rest-agent")
    document = yaml.safe_load(WORKFLOW.read_text())
    document["name"], document["steps"][0]["task"] = name, task
    assert (await http.post("/workflows", json=document)).status_code == 200

    model = GatedModel(
        [
            {"done": False, "tool": "search", "input": {"q": "weather"}},
            {"done": True, "answer": "sunny"},
            {"done": True, "answer": "sunny tomorrow too"},
        ]
    )
    starts: list[str] = []

    async def run_tool(tool: str, input: Any, key: str) -> Any:
        starts.append(tool)
        return {"results": 3}

    async with Worker(engine.target, handlers={task: make_agent_turn(model, run_tool)}):
        started = await http.post("/runs", json={"workflow": name, "input": "weather?"})
        assert started.status_code == 201, started.text
        run_id = started.json()["run_id"]
        inputs = f"/runs/{run_id}/steps/agent/inputs"

        # Steer while the first turn runs: queued now, placed at the next turn.
        await asyncio.wait_for(model.entered.wait(), timeout=20)
        steer = {"request_id": "s-1", "mode": "steer", "content": "in celsius"}
        first = await http.post(inputs, json=steer)
        assert first.status_code == 201 and first.json()["status"] == "queued"
        again = await http.post(inputs, json={**steer, "content": "ignored"})
        assert again.status_code == 200 and again.json() == first.json()
        model.release.set()

        async def steer_status(wanted: str) -> bool:
            got = await http.get(f"{inputs}/s-1", params={"wait": "2s"})
            assert got.status_code == 200, got.text
            return bool(got.json()["status"] == wanted)

        await wait_for(lambda: steer_status("done"), timeout=30)
        await wait_for(
            lambda: _waiting_for_input(http, run_id), timeout=30
        )  # answered; no task held

        # The journal as a page: one continue commit per finished turn.
        records = await page(http, run_id)
        kinds = [r["kind"] for r in records]
        assert kinds.count("input_placed") == 1 and kinds.count("tool_intent") == 1
        placed = next(r for r in records if r["kind"] == "input_placed")
        assert placed["input_placed"]["content"] == "in celsius" and placed["iteration"] == 1
        assert sum(1 for r in records if is_commit("continue")(r)) == 2
        # The model saw the steer once, in the turn after it arrived.
        assert json.dumps(model.scripted.requests[1]).count("in celsius") == 1

        # Follow the stream from the start; a follow-up wakes the agent and its
        # records arrive live.
        async with events(http, f"/runs/{run_id}/steps/agent/journal?follow=1") as stream:
            replayed = [e async for e in _take(stream, len(records))]
            assert [e.id for e in replayed] == [r["seq"] for r in records]
            follow_up = {"request_id": "f-1", "mode": "follow_up", "content": "tomorrow?"}
            assert (await http.post(inputs, json=follow_up)).status_code == 201
            live = await collect(stream, until=is_commit("continue"))
        # The woken turn's claim rides its first record, the placement (the riding claim).
        assert live[0].data["kind"] == "input_placed" and "leading_claim" in live[0].data
        assert live[-1].data["commit"]["wait_until_input"] is True
        assert model.scripted.calls == 3 and starts == ["search"]

        cancelled = await http.post(f"/runs/{run_id}/cancel", json={"reason": "done here"})
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        listed = await http.get("/runs", params={"workflow": name, "status": "cancelled"})
        assert [r["run_id"] for r in listed.json()["runs"]] == [run_id]
        running = await http.get("/runs", params={"workflow": name, "status": "running"})
        assert running.json()["runs"] == []
        check = (await http.get(f"/runs/{run_id}/journal/check")).json()
        # The cancel stored one more record: the waiting step's journal ends in it.
        sealed = len(records) + len(live) + 1
        assert check["violations"] == [] and check["records"] == sealed


async def _waiting_for_input(http: httpx.AsyncClient, run_id: str) -> bool:
    step = await step_of(http, run_id)
    return bool(step["status"] == "waiting" and step["waiting_for_input"])


async def _take(stream: AsyncIterator[Event], n: int) -> AsyncIterator[Event]:
    for _ in range(n):
        yield await anext(stream)


class Releases:
    """A journaled loop that runs one iteration per release, so a test can
    decide what happens while a reader is connected or away."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.queue: asyncio.Queue[None] = asyncio.Queue()

    def release(self, n: int) -> None:
        for _ in range(n):
            self.queue.put_nowait(None)

    async def handler(self, tc: TaskContext) -> None:
        j = await tc.journal()
        await self.queue.get()

        async def respond() -> Any:
            return {"turn": tc.iteration}

        await j.model(respond)
        if tc.iteration + 1 == self.iterations:
            await tc.complete(tc.iteration)
        else:
            await tc.continue_()


async def start_loop(http: httpx.AsyncClient) -> tuple[str, str]:
    name, task = unique("sse"), unique("sse")
    assert (await http.post("/workflows", json=loop_workflow(name, task))).status_code == 200
    started = await http.post("/runs", json={"workflow": name})
    assert started.status_code == 201, started.text
    return task, started.json()["run_id"]


async def test_a_reconnect_with_last_event_id_gets_every_record_once_in_order(
    http: httpx.AsyncClient, engine: EngineServer
) -> None:
    loop = Releases(iterations=6)
    task, run_id = await start_loop(http)
    path = f"/runs/{run_id}/steps/agent/journal"
    async with Worker(engine.target, handlers={task: loop.handler}, poll_wait=1.0):
        async with events(http, path) as stream:
            loop.release(2)
            first = await collect(
                stream, until=lambda r: is_commit("continue")(r) and r["iteration"] == 1
            )
        # Away while two more iterations are written.
        loop.release(2)
        await wait_for(lambda: _commits(http, run_id, at_least=4), timeout=30)
        async with events(http, path, last_event_id=first[-1].id) as stream:
            loop.release(2)
            rest = await collect(stream, until=is_commit("complete"))

    seen = [e.id for e in first + rest]
    assert seen == [r["seq"] for r in await page(http, run_id)]
    assert len(seen) == len(set(seen))


async def _every_event(http: httpx.AsyncClient, path: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of every event of a stream, until the server closes it."""
    got: list[tuple[str, dict[str, Any]]] = []
    fields: dict[str, str] = {}
    async with http.stream("GET", path, timeout=None) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "":
                if "event" in fields:
                    got.append((fields["event"], json.loads(fields["data"])))
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
    return got


async def test_a_followed_step_that_finishes_or_is_cancelled_ends_its_stream(
    http: httpx.AsyncClient, engine: EngineServer
) -> None:
    loop = Releases(iterations=2)
    task, run_id = await start_loop(http)
    path = f"/runs/{run_id}/steps/agent/journal?follow=1"
    async with Worker(engine.target, handlers={task: loop.handler}, poll_wait=1.0):
        following = asyncio.create_task(_every_event(http, path))
        loop.release(2)  # both iterations run while the stream is open
        got = await asyncio.wait_for(following, timeout=60)
    records = await page(http, run_id)
    assert [data["seq"] for kind, data in got[:-1]] == [r["seq"] for r in records]
    assert got[-1] == ("end", {"run_status": "completed", "step_status": "completed"})

    # A cancel writes no commit but its cancel record, which seals the journal
    # of the step (its task was never taken), just after the run's write: the
    # stream ends once it sees the run ended, with or without that record.
    _task, idle = await start_loop(http)
    following = asyncio.create_task(
        _every_event(http, f"/runs/{idle}/steps/agent/journal?follow=1")
    )
    await wait_for(lambda: gateway_streams(http, at_least=1), timeout=30)
    assert (await http.post(f"/runs/{idle}/cancel")).status_code == 200
    got = await asyncio.wait_for(following, timeout=60)
    assert [(kind, data.get("kind")) for kind, data in got[:-1]] in ([], [("record", "cancel")])
    assert got[-1][0] == "end" and got[-1][1]["run_status"] == "cancelled"


async def gateway_streams(http: httpx.AsyncClient, *, at_least: int) -> bool:
    metrics = (await http.get("/metrics")).text
    line = next(x for x in metrics.splitlines() if x.startswith("dagnats_http_journal_streams "))
    return float(line.split()[1]) >= at_least


async def _commits(http: httpx.AsyncClient, run_id: str, *, at_least: int) -> bool:
    return sum(1 for r in await page(http, run_id) if r["kind"] == "commit") >= at_least


async def _journal_consumers(nats_server: NatsServer) -> int:
    nc = await nats.connect(nats_server.url)
    try:
        info = await nc.jetstream().stream_info(JOURNAL)
        return info.state.consumer_count
    finally:
        await nc.close()


async def test_a_hundred_followers_of_one_step_each_get_every_record(
    gateway: Any, engine: EngineServer, nats_server: NatsServer
) -> None:
    followers = 100
    limits = httpx.Limits(max_connections=followers + 10)
    async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=60) as http:
        loop = Releases(iterations=3)
        before = await _journal_consumers(nats_server)
        task, run_id = await start_loop(http)
        path = f"/runs/{run_id}/steps/agent/journal?follow=1"
        connected = 0
        all_connected = asyncio.Event()

        async def follow() -> list[int]:
            nonlocal connected
            async with events(http, path) as stream:
                connected += 1
                if connected == followers:
                    all_connected.set()
                return [e.id for e in await collect(stream, until=is_commit("complete"))]

        tasks = [asyncio.create_task(follow()) for _ in range(followers)]
        await asyncio.wait_for(all_connected.wait(), timeout=60)
        # The gateway follows the step once, however many clients follow it.
        assert await _journal_consumers(nats_server) <= before + 1
        async with Worker(engine.target, handlers={task: loop.handler}, poll_wait=1.0):
            loop.release(3)
            seen = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        records = await page(http, run_id)
        expected = [r["seq"] for r in records]
    assert all(ids == expected for ids in seen)
    # A commit with the model's response and the claim, each iteration: the
    # first delivery's claim fences nothing (so it rides), and the next ones are
    # handed over with the commit before (the hand-over).
    assert [(r["kind"], r["leading"], "leading_claim" in r) for r in records] == [
        ("commit", "leading_model", True) for _ in range(3)
    ]
    assert [r["leading_model"]["response"] for r in records] == [{"turn": i} for i in range(3)]


# ---- bad input --------------------------------------------------------------------


async def test_bad_input_is_a_json_error_and_stores_nothing(
    http: httpx.AsyncClient, engine: EngineServer
) -> None:
    name, task = unique("bad"), unique("bad")
    assert (await http.post("/workflows", json=loop_workflow(name, task))).status_code == 200
    run_id = (await http.post("/runs", json={"workflow": name})).json()["run_id"]
    inputs = f"/runs/{run_id}/steps/agent/inputs"
    runs_before = (await http.get("/runs", params={"workflow": name})).json()["runs"]
    json_headers = {"Content-Type": "application/json"}

    cases: list[tuple[str, str, dict[str, Any], int, str, str | None]] = [
        # method, path, request options, status, code, field
        (
            "POST",
            "/runs",
            {"content": b"{not json", "headers": json_headers},
            400,
            "invalid_argument",
            None,
        ),
        (
            "POST",
            "/runs",
            {"json": {"workflow": name, "extra": 1}},
            400,
            "invalid_argument",
            "extra",
        ),
        ("POST", "/runs", {"json": {"workflow": "a.b"}}, 400, "invalid_argument", "workflow"),
        ("POST", "/runs", {"json": {"workflow": "nope-" + name}}, 404, "not_found", None),
        ("GET", "/runs/" + "0" * 32, {}, 404, "not_found", None),
        ("GET", "/runs/a.b", {}, 400, "invalid_argument", "run_id"),
        ("GET", "/runs/*", {}, 400, "invalid_argument", "run_id"),
        ("GET", f"/runs/{run_id}/steps/>/journal", {}, 400, "invalid_argument", "step_id"),
        ("GET", f"/runs/{run_id}/steps/a.b/journal", {}, 400, "invalid_argument", "step_id"),
        ("GET", f"/runs/{run_id}/steps/nostep/journal", {}, 404, "not_found", "step_id"),
        ("GET", f"/runs/{run_id}/steps/agent/journal?from=-1", {}, 400, "invalid_argument", "from"),
        (
            "POST",
            inputs,
            {"content": b"[1,", "headers": json_headers},
            400,
            "invalid_argument",
            None,
        ),
        ("POST", inputs, {"json": {"request_id": "x"}}, 400, "invalid_argument", "content"),
        (
            "POST",
            inputs,
            {"json": {"request_id": "x", "content": 1, "mode": "shout"}},
            400,
            "invalid_argument",
            "mode",
        ),
        (
            "POST",
            inputs,
            {"json": {"request_id": "r" * 300, "content": 1}},
            400,
            "invalid_argument",
            "request_id",
        ),
        (
            "POST",
            inputs,
            {"json": {"request_id": "big", "content": "x" * 70_000}},
            400,
            "invalid_argument",
            "content",
        ),
        (
            "POST",
            inputs,
            {"content": b"x" * (2 << 20), "headers": json_headers},
            413,
            "too_large",
            None,
        ),
        (
            "POST",
            f"/runs/{'0' * 32}/steps/agent/inputs",
            {"json": {"request_id": "x", "content": 1}},
            404,
            "not_found",
            None,
        ),
        ("GET", f"{inputs}/x?wait=soon", {}, 400, "invalid_argument", "wait"),
        ("GET", f"{inputs}/never", {}, 404, "not_found", None),
        ("GET", "/workflows/a*b", {}, 400, "invalid_argument", "name"),
        # Errors that quote the request in a status message or field (found by
        # the OpenAPI property test: a 500, and a lone surrogate that hung).
        (
            "POST",
            "/workflows",
            {"content": rb'{"\u7dbb": null}', "headers": json_headers},
            400,
            "invalid_argument",
            None,
        ),
        (
            "POST",
            "/workflows",
            {"content": rb'{"a\udbab": {}}', "headers": json_headers},
            400,
            "invalid_argument",
            None,
        ),
    ]
    for method, path, options, status, code, field in cases:
        response = await http.request(method, path, **options)
        where = f"{method} {path}: {response.text}"
        assert response.status_code == status, where
        body = response.json()
        assert body["code"] == code and body["message"], where
        if field is not None:
            assert body.get("field") == field, where

    # Nothing was stored: no run started, no input queued.
    assert (await http.get("/runs", params={"workflow": name})).json()["runs"] == runs_before
    assert (await http.get(inputs)).json() == {"inputs": []}
    await http.post(f"/runs/{run_id}/cancel")


async def test_tokens_guard_the_api_and_the_inputs_alike(engine: EngineServer) -> None:
    config = GatewayConfig(
        engine_target=engine.target, port=0, api_token="api-secret", bridge_token="bridge-secret"
    )
    server = await start_gateway(config)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            run_path = "/runs/" + "0" * 32
            input_path = run_path + "/steps/agent/inputs"
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Bearer bridge-secret"},
                {"Authorization": "api-secret"},
            ):
                for method, path in (
                    ("GET", "/runs"),
                    ("GET", run_path),
                    ("POST", input_path),
                    ("GET", "/openapi.json"),
                    ("GET", "/docs"),
                ):
                    response = await http.request(method, path, headers=headers, json={})
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["code"] == "unauthenticated"
            good = {"Authorization": "Bearer api-secret"}
            assert (await http.get("/runs", headers=good)).status_code == 200
            assert (await http.get(run_path, headers=good)).status_code == 404
            document = await http.get("/openapi.json", headers=good)
            assert document.status_code == 200 and "/runs" in document.json()["paths"]
            assert (await http.get("/docs", headers=good)).status_code == 200
            # Health and metrics stay open for probes and scrapers.
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/metrics")).status_code == 200
    finally:
        await server.stop()


async def test_an_open_gateway_refuses_a_public_address(engine: EngineServer) -> None:
    from dagnats.core.errors import InvalidArgument

    config = GatewayConfig(engine_target=engine.target, host="0.0.0.0", port=0)
    try:
        await start_gateway(config)
    except InvalidArgument as err:
        assert err.field == "host" and "DAGNATS_API_TOKEN" in err.message
    else:
        raise AssertionError("an open gateway started on a public address")


async def test_health_readiness_metrics_and_openapi(http: httpx.AsyncClient) -> None:
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    assert (await http.get("/readyz")).json() == {"status": "ready"}
    await http.get("/runs")
    metrics = (await http.get("/metrics")).text
    assert 'dagnats_http_requests_total{method="GET",route="/runs",status="200"}' in metrics
    spec = (await http.get("/openapi.json")).json()
    assert "/runs/{run_id}/steps/{step_id}/journal" in spec["paths"]
    assert "/runs/{run_id}/steps/{step_id}/inputs/{request_id}" in spec["paths"]


async def test_a_kept_alive_connection_gets_each_answer_without_waiting_for_an_ack(
    gateway: GatewayServer, http: httpx.AsyncClient
) -> None:
    """Nagle's algorithm is off on the gateway's connections: a response's body
    is sent with its headers, not held until the client acknowledges them
    (a delayed ACK: 40 ms on every request of a kept-alive connection but its
    first, for every bridge worker, console and API client)."""
    for _ in range(2):
        assert (await http.get("/healthz")).status_code == 200
    connections = gateway._server.server_state.connections
    sockets = [c.transport.get_extra_info("socket") for c in connections]
    assert sockets, "the client's connection is not open on the gateway"
    assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


async def test_an_unreachable_engine_is_a_503_within_the_retry_budget() -> None:
    from dagnats.core.natsserver import free_port

    config = GatewayConfig(
        engine_target=f"127.0.0.1:{free_port()}", host="127.0.0.1", port=0, retry_for=0.5
    )
    server = await start_gateway(config)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            response = await http.get("/runs")
            assert response.status_code == 503, response.text
            assert response.json()["code"] == "unavailable"
            assert response.headers["retry-after"] == "1"
    finally:
        await server.stop()
