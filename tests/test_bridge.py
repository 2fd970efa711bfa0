"""The HTTP bridge for workers, through a real gateway, engine and nats-server:
a journaled run driven over HTTP only, fencing of a stalled worker, late
resolves of finished tasks, cancelled runs, a missing journal stream, and bad
input."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from dagnats.core import jetstream as jsx
from dagnats.core.errors import InvalidArgument
from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import GatewayConfig, GatewayServer, start_gateway
from dagnats.gateway.bridge_token import BridgeToken
from dagnats.journal import convert, replay
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, JournalClient, run_output
from tests.stack import FAST, loop_workflow, unique
from tests.test_journal import read_journal

# Long enough for a lease (FAST: 2s) to run out while a poll waits.
POLL_WAIT = "10s"


async def call(http: httpx.AsyncClient, path: str, status: int = 200, **body: Any) -> Any:
    response = await http.post(f"/bridge/{path}", json=body)
    assert response.status_code == status, response.text
    return response.json()


async def poll(http: httpx.AsyncClient, task: str, worker: str = "w") -> dict[str, Any]:
    answer = await call(http, "poll", task_types=[task], wait=POLL_WAIT, worker_id=worker)
    assert len(answer["tasks"]) == 1, answer
    leased: dict[str, Any] = answer["tasks"][0]
    return leased


async def start(client: Client, run_input: Any = None) -> tuple[str, str]:
    task, name = unique("bridge"), unique("bridgewf")
    await client.register_workflow(loop_workflow(name, task, max_iterations=5))
    run = await client.start_run(name, run_input)
    return task, run.run_id


async def check(engine: EngineServer, run_id: str) -> list[jpb.Violation]:
    async with JournalClient(engine.target) as journal:
        return list((await journal.check(run_id)).violations)


def error(answer: Any, code: str) -> None:
    assert set(answer) >= {"code", "message"}, answer
    assert answer["code"] == code, answer


# ---- the token and the fence rules, without a server ----------------------------------------

RUN = "0123456789abcdef0123456789abcdef"
LEASE = "$JS.ACK.TASKS.tasks-t.1.2.3.4.5"


def test_a_token_survives_its_round_trip_and_a_damaged_one_is_invalid() -> None:
    writer = jpb.WriterToken(
        run_id=RUN, step_id="agent", iteration=2, attempt=1, writer="ab" * 8, last_seq=9
    )
    token = BridgeToken(
        lease=LEASE, run_id=RUN, step_id="agent", iteration=2, attempt=1, writer=writer
    )
    token = BridgeToken.decode(token.encode())
    assert token.writer == writer and (token.iteration, token.position) == (2, 0)
    text = token.encode()
    for damaged in ("", "x", text[:-4], text + "!", base64.urlsafe_b64encode(b"[1]").decode()):
        with pytest.raises(InvalidArgument) as err:
            BridgeToken.decode(damaged)
        assert err.value.field == "token"


def test_what_follows_a_writers_last_record_says_why_it_was_fenced() -> None:
    mine, dispatch = "a" * 16, (1, 2)

    def why(*records: jpb.Record) -> str:
        entries = convert.all_entries(records)
        return replay.why_fenced(entries, writer=mine, dispatch=dispatch)

    def record(iteration: int, attempt: int, who: str = "b" * 16, **kind: Any) -> jpb.Record:
        return jpb.Record(iteration=iteration, attempt=attempt, writer=who, **kind)

    assert why(record(1, 2, mine, claim=jpb.Claim())) == "own"
    assert why(record(1, 2, claim=jpb.Claim())) == "fenced"
    assert why(record(1, 3, claim=jpb.Claim())) == "stale"
    assert why(record(2, 1, claim=jpb.Claim())) == "stale"
    paused = jpb.Commit(action=jpb.ACTION_PAUSE)
    assert why(record(1, 2, commit=paused)) == "committed"
    assert why(record(1, 1, commit=paused)) == "fenced"
    done = jpb.Commit(action=jpb.ACTION_COMPLETE)
    assert why(record(1, 1, commit=done)) == "committed"
    # Another writer's record, then the commit that finished the dispatch.
    assert why(record(1, 3, claim=jpb.Claim()), record(1, 2, mine, claim=jpb.Claim())) == "stale"
    assert why(record(1, 2, claim=jpb.Claim()), record(1, 1, commit=done)) == "committed"
    assert why() == "own"


# ---- (1) a journaled run over HTTP only ---------------------------------------------------


async def test_a_journaled_run_over_the_bridge(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    task, run_id = await start(client, {"q": "hello"})

    leased = await poll(http, task)
    assert leased["task"]["run_id"] == run_id
    assert (leased["task"]["iteration"], leased["task"]["attempt"]) == (0, 1)
    assert leased["task"]["input"] == {"q": "hello"}
    assert leased["delivery"] == 1 and leased["lease_seconds"] == FAST.task_ack_wait
    token = leased["token"]
    loaded = await call(http, "checkpoint/load", token=token)
    assert loaded == {"state": None, "source": "none"}

    read = await call(http, "journal/read", token=token)
    assert [r["kind"] for r in read["records"]] == ["claim"]
    assert read["state"] is None and not read["has_state"]
    begin = await call(http, "journal/model/begin", token=read["token"])
    assert begin["position"] == 0 and not begin["recorded"]
    reply = {"tool": "charge", "input": {"cents": 5}}
    token = (await call(http, "journal/model/record", token=begin["token"], response=reply))[
        "token"
    ]
    tool = await call(http, "journal/tool/begin", token=token, name="charge", input={"cents": 5})
    assert tool["run"] and tool["result"] is None
    assert tool["key"] == f"{run_id}.agent.0.1"
    token = (await call(http, "journal/tool/output", token=tool["token"], chunk="charging;"))[
        "token"
    ]
    token = (await call(http, "journal/tool/finish", token=token, output={"ok": True}))["token"]
    again = await call(http, "journal/read", token=token)
    kinds = [r["kind"] for r in again["records"]]
    assert kinds == ["claim", "model", "tool_intent", "tool_output", "tool_result"]
    history = [{"q": "hello"}, reply, {"ok": True}]
    saved = await call(http, "checkpoint/save", token=token, state=history)
    assert saved["journaled"]
    token = saved["token"]
    assert await call(http, "checkpoint/load", token=token) == {
        "state": history,
        "source": "journal",
    }
    assert (await call(http, "heartbeat", token=token))["token"] == token
    resolved = await call(http, "resolve", token=token, outcome="continue", output={"turn": 0})
    assert resolved["outcome"] == "continue" and resolved["journal_seq"] > 0

    await client.submit_input(run_id, "agent", "msg-1", {"text": "be brief"})
    leased = await poll(http, task)
    assert leased["task"]["iteration"] == 1
    read = await call(http, "journal/read", token=leased["token"])
    assert read["state"] == history and read["has_state"]
    placed = await call(http, "journal/inputs/place", token=read["token"], mode="steer")
    assert [(i["request_id"], i["content"]) for i in placed["inputs"]] == [
        ("msg-1", {"text": "be brief"})
    ]
    appended = await call(
        http,
        "journal/append",
        token=placed["token"],
        record={"kind": "model", "response": {"answer": 42}},
    )
    assert appended["position"] == 1 and not appended["recorded"] and appended["seq"] > 0
    # No state in the resolve: the commit carries the loaded state forward.
    done = await call(http, "resolve", token=appended["token"], outcome="complete", output=42)

    run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED and run_output(run) == 42
    records = await read_journal(engine, run_id)
    last = records[-1]
    assert last.seq == done["journal_seq"] and last.commit.action == jpb.ACTION_COMPLETE
    assert json.loads(last.commit.state) == history
    assert await check(engine, run_id) == []


async def test_a_parallel_group_over_the_bridge_and_its_redelivery(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    # The worker begins the three calls of one response at once, reports
    # output of one, finishes the two safe ones, then dies; the redelivery
    # reuses those results and gets the unsafe one interrupted; another group
    # at that position is a replay mismatch.
    task, run_id = await start(client)
    token = (await call(http, "journal/read", token=(await poll(http, task))["token"]))["token"]
    calls = [
        {"name": "search", "input": {"q": "a"}, "replay": "safe"},
        {"name": "send", "input": {"to": "ops"}},
        {"name": "search", "input": {"q": "b"}, "replay": "safe"},
    ]
    begun = await call(http, "journal/tools/begin", token=token, calls=calls)
    assert begun["position"] == 0
    assert [c["position"] for c in begun["calls"]] == [0, 1, 2]
    assert [c["key"] for c in begun["calls"]] == [f"{run_id}.agent.0.{n}" for n in range(3)]
    assert all(c["run"] for c in begun["calls"])
    seq = begun["calls"][0]["intent_seq"]
    assert [(c["intent_seq"], c["intent_index"]) for c in begun["calls"]] == [
        (seq, 0),
        (seq, 1),
        (seq, 2),
    ]
    token = (
        await call(
            http,
            "journal/tool/output",
            token=begun["token"],
            chunk="sending;",
            intent_seq=seq,
            intent_index=1,
        )
    )["token"]
    await call(
        http,
        "journal/tools/finish",
        token=token,
        results=[
            {"intent_seq": seq, "intent_index": 2, "output": {"hits": 2}},
            {"intent_seq": seq, "intent_index": 0, "output": {"hits": 0}},
        ],
    )
    leased = await poll(http, task, worker="w2")  # the lease ran out: redelivered
    token = (await call(http, "journal/read", token=leased["token"]))["token"]
    other = await call(http, "journal/tools/begin", 409, token=token, calls=calls[:2])
    error(other, "replay_mismatch")
    again = await call(http, "journal/tools/begin", token=token, calls=calls)
    assert [c["run"] for c in again["calls"]] == [False, False, False]
    views = [c["result"] for c in again["calls"]]
    assert views[0]["output"] == {"hits": 0} and views[2]["output"] == {"hits": 2}
    assert views[1]["interrupted"] and views[1]["partial"] == "sending;"
    await call(http, "resolve", token=again["token"], outcome="complete", output="done")
    run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert await check(engine, run_id) == []


# ---- (2) and (3): stalled workers and finished tasks ---------------------------------------


async def test_a_tool_stopped_by_its_worker_is_recorded_interrupted(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    # A worker whose run was cancelled while a tool ran answers the intent as
    # the SDK does: interrupted, with what the tool reported.
    task, run_id = await start(client)
    token = (await call(http, "journal/read", token=(await poll(http, task))["token"]))["token"]
    tool = await call(http, "journal/tool/begin", token=token, name="send", input={"to": "ops"})
    token = (await call(http, "journal/tool/output", token=tool["token"], chunk="half"))["token"]
    mixed = await call(
        http, "journal/tool/finish", 400, token=token, interrupted=True, output={"ok": 1}
    )
    error(mixed, "invalid_argument")
    assert mixed["field"] == "interrupted"
    alone = await call(http, "journal/tool/finish", 400, token=token, partial="half")
    assert alone["field"] == "partial"
    await call(http, "journal/tool/finish", token=token, interrupted=True, partial="half")
    records = await read_journal(engine, run_id)
    assert [r.WhichOneof("kind") for r in records] == [
        "claim",
        "tool_intent",
        "tool_output",
        "tool_result",
    ]
    result = records[-1].tool_result
    assert (result.interrupted, result.partial, result.output) == (True, "half", b"")


async def test_a_stalled_workers_late_calls_are_fenced_and_change_nothing(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    task, run_id = await start(client)
    stalled = await poll(http, task, "stalled")
    begin = await call(http, "journal/model/begin", token=stalled["token"])
    zombie = (await call(http, "journal/model/record", token=begin["token"], response="a"))["token"]

    # No heartbeat: the lease runs out and the task goes to a successor.
    successor = await poll(http, task, "successor")
    assert successor["delivery"] == 2
    read = await call(http, "journal/read", token=successor["token"])
    assert [r["kind"] for r in read["records"]] == ["claim", "model", "claim"]
    run_before = await client.get_run(run_id)
    records_before = await read_journal(engine, run_id)

    late = await call(http, "resolve", 409, token=zombie, outcome="complete", output="zombie")
    error(late, "fenced")
    error(await call(http, "heartbeat", 409, token=zombie), "fenced")
    error(await call(http, "journal/model/begin", 409, token=zombie), "fenced")
    error(await call(http, "journal/tool/begin", 409, token=zombie, name="t"), "fenced")

    assert await client.get_run(run_id) == run_before
    assert await read_journal(engine, run_id) == records_before
    assert await check(engine, run_id) == []

    # The successor replays the zombie's model response and finishes the run;
    # a different call at that position is refused and writes nothing.
    mismatch = await call(http, "journal/tool/begin", 409, token=read["token"], name="t")
    error(mismatch, "replay_mismatch")
    begin = await call(http, "journal/model/begin", token=read["token"])
    assert begin["recorded"] and begin["response"] == "a"
    await call(http, "resolve", token=begin["token"], outcome="complete", output="successor")
    run = await client.wait_for_run(run_id, timeout=30)
    assert run_output(run) == "successor"
    assert await check(engine, run_id) == []


async def test_a_finished_tasks_late_resolve_is_gone(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    # A worker that claimed, stalled, and resolves after its successor committed.
    task, claimed_run = await start(client)
    stalled = await poll(http, task, "stalled")
    zombie = (await call(http, "journal/read", token=stalled["token"]))["token"]
    successor = await poll(http, task, "successor")
    token = (await call(http, "journal/read", token=successor["token"]))["token"]
    await call(http, "resolve", token=token, outcome="complete", output="successor")
    late = await call(http, "resolve", 410, token=zombie, outcome="complete", output="zombie")
    error(late, "committed")
    error(await call(http, "heartbeat", 410, token=zombie), "committed")

    # A worker that never touched the journal resolves after the run finished.
    task, unclaimed_run = await start(client)
    stalled = await poll(http, task, "stalled")
    successor = await poll(http, task, "successor")
    token = (await call(http, "journal/read", token=successor["token"]))["token"]
    await call(http, "resolve", token=token, outcome="complete", output="successor")
    await client.wait_for_run(unclaimed_run, timeout=30)
    late = await call(http, "resolve", 410, token=stalled["token"], outcome="fail", error="x")
    error(late, "stale")
    error(await call(http, "heartbeat", 410, token=stalled["token"]), "stale")
    # Its first journal action finds the journal past it: settled, not run.
    error(await call(http, "journal/read", 410, token=stalled["token"]), "stale")

    for run_id in (claimed_run, unclaimed_run):
        run = await client.get_run(run_id)
        assert run.status == pb.RUN_STATUS_COMPLETED and run_output(run) == "successor"
        assert await check(engine, run_id) == []


# ---- (4) cancelled runs ----------------------------------------------------------------------


async def test_a_cancelled_run_answers_cancelled_on_resolve_and_heartbeat(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    task, run_id = await start(client)
    claimed = await poll(http, task)
    token = (await call(http, "journal/read", token=claimed["token"]))["token"]
    await client.cancel_run(run_id, "stop")
    error(await call(http, "heartbeat", 409, token=token), "cancelled")
    late = await call(http, "resolve", 409, token=token, outcome="complete", output=1)
    error(late, "cancelled")
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_CANCELLED
    assert await check(engine, run_id) == []

    task, run_id = await start(client)
    unclaimed = await poll(http, task)
    await client.cancel_run(run_id, "stop")
    error(await call(http, "heartbeat", 409, token=unclaimed["token"]), "cancelled")
    late = await call(http, "resolve", 409, token=unclaimed["token"], outcome="complete")
    error(late, "cancelled")
    assert (await client.get_run(run_id)).status == pb.RUN_STATUS_CANCELLED


# ---- (5) a missing journal stream ------------------------------------------------------------


@asynccontextmanager
async def stack_without_journal(tmp_path: Path) -> AsyncIterator[tuple[Client, str]]:
    """A nats-server, engine and gateway of their own, the journal stream deleted."""
    server = await NatsServer.start(tmp_path)
    engine = await start_engine(server.url, config=FAST)
    gateway = await start_gateway(GatewayConfig(engine_target=engine.target, port=0))
    try:
        nc = await nats.connect(server.url)
        await nc.jetstream().delete_stream(jsx.JOURNAL)
        await nc.close()
        async with Client(engine.target) as client:
            yield client, gateway.url
    finally:
        await gateway.stop()
        await engine.stop()
        await server.stop()


async def test_a_missing_journal_stream_is_not_provisioned(tmp_path: Path) -> None:
    async with stack_without_journal(tmp_path) as (client, url):
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            task, run_id = await start(client)
            leased = await poll(http, task)
            error(await call(http, "journal/read", 503, token=leased["token"]), "not_provisioned")
            tool = await call(http, "journal/tool/begin", 503, token=leased["token"], name="t")
            error(tool, "not_provisioned")
            assert (await client.get_run(run_id)).status == pb.RUN_STATUS_RUNNING


# ---- (6) bad input ---------------------------------------------------------------------------


def forge(token: str, **writer: Any) -> str:
    """The token with a writer the journal never issued."""
    data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    fields = {
        "run_id": data["run"],
        "step_id": data["step"],
        "iteration": data["it"],
        "attempt": data["at"],
        "writer": "0123456789abcdef",
        **writer,
    }
    data["w"] = base64.b64encode(jpb.WriterToken(**fields).SerializeToString()).decode()
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


async def test_bad_requests_are_json_errors_and_store_nothing(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    response = await http.post(
        "/bridge/poll", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error(response.json(), "invalid_argument")
    bad = await call(http, "poll", 400, task_types=["a.b"], wait="1s")
    assert bad["field"] == "task_types.0"
    assert (await call(http, "poll", 400, task_types=["t"], wait="2h"))["field"] == "wait"
    assert (await call(http, "poll", 400, task_types=["t"], extra=1))["field"] == "extra"
    surrogate = b'{"task_types": ["t"], "wait": 0, "worker_id": "w\\ud800"}'
    response = await http.post(
        "/bridge/poll", content=surrogate, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["field"] == "worker_id"

    for path in ("heartbeat", "journal/read", "checkpoint/load"):
        answer = await call(http, path, 400, token="not-a-token")
        assert answer["field"] == "token", answer

    task, run_id = await start(client)
    leased = await poll(http, task)
    token = (await call(http, "journal/read", token=leased["token"]))["token"]
    before = await read_journal(engine, run_id)
    forged = forge(leased["token"], last_seq=before[-1].seq - 1)
    late = await call(http, "resolve", 409, token=forged, outcome="complete", output="forged")
    error(late, "fenced")
    error(await call(http, "journal/tool/begin", 409, token=forged, name="t"), "fenced")
    other_step = forge(leased["token"], step_id="other")
    assert (await call(http, "journal/read", 400, token=other_step))["field"] == "token"
    no_pause = await call(http, "resolve", 400, token=token, outcome="pause")
    assert no_pause["field"] == "pause"
    assert await read_journal(engine, run_id) == before
    await call(http, "resolve", token=token, outcome="complete", output="real")
    run = await client.wait_for_run(run_id, timeout=30)
    assert run_output(run) == "real"
    assert await check(engine, run_id) == []


async def test_a_token_behind_the_workers_own_writes_writes_nothing(
    engine: EngineServer, client: Client, http: httpx.AsyncClient
) -> None:
    task, run_id = await start(client)
    leased = await poll(http, task)
    begun = (await call(http, "journal/model/begin", token=leased["token"]))["token"]
    await call(http, "journal/model/record", token=begun, response={"answer": 1})
    before = await read_journal(engine, run_id)
    # A worker that lost track of its token: the write it would make with the
    # old one is not mistaken for a retry of the write that token already made.
    late = await call(http, "resolve", 409, token=begun, outcome="continue", output="old")
    error(late, "fenced")
    error(await call(http, "journal/tool/begin", 409, token=begun, name="t"), "fenced")
    assert await read_journal(engine, run_id) == before
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_RUNNING and run.steps[0].iterations == 0
    assert await check(engine, run_id) == []


async def test_the_bridge_needs_its_bearer_token(engine: EngineServer) -> None:
    config = GatewayConfig(engine_target=engine.target, port=0, bridge_token="s3cret")
    gateway: GatewayServer = await start_gateway(config)
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http:
            body = {"task_types": [unique("nobody")], "wait": "0s"}
            for headers in ({}, {"authorization": "Bearer wrong"}):
                response = await http.post("/bridge/poll", json=body, headers=headers)
                assert response.status_code == 401
                error(response.json(), "unauthenticated")
                response = await http.post(
                    "/bridge/journal/read", json={"token": "x"}, headers=headers
                )
                assert response.status_code == 401
            ok = await http.post(
                "/bridge/poll", json=body, headers={"authorization": "Bearer s3cret"}
            )
            assert ok.status_code == 200 and ok.json() == {"tasks": []}
    finally:
        await gateway.stop()
