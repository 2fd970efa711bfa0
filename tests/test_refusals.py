"""A deterministic refusal ends the step at once and says why.

A record too large for the journal, a replay mismatch or an invalid argument
would be refused the same way on every delivery and every attempt: the step
fails for good with that error's message (and its numbers) within seconds,
rather than waiting out leases and failing minutes later with "restart
limit". Through the SDK's worker (its own process on gRPC, and in the
services' process), through the HTTP bridge, and shown where a user looks:
the run's error in ``GetRun``, ``dagnats run get`` and ``GET /runs/{id}``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from dagnats.cli.handlers import in_process_worker
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway.config import GatewayConfig
from dagnats.gateway.server import start_gateway
from dagnats.journal.limits import MAX_RECORD_BYTES
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from dagnats.sdk import _journal as sdk_journal
from tests.journal_agent import Crasher
from tests.stack import loop_workflow, unique
from tests.test_cli import adagnats
from tests.test_journal import NO_HEARTBEAT, read_journal

# Far below a lease's expiry and the restart limit's five deliveries, which
# took minutes: a refusal ends its step at once.
WITHIN = 15.0
STATE_BYTES = 2_105_245  # the state of a conversation that outgrew the journal
TOOL_BYTES = 3_000_000
RETRY = {"max_attempts": 3, "backoff": "fixed", "initial_delay": "100ms"}  # it would not help


def _size(n: int) -> str:
    return f"{n:,} bytes"


async def _fail_fast(client: Client, engine: EngineServer, handler: Any, worker: str) -> pb.Run:
    """Run ``handler`` once (no retry policy would help) on a ``worker`` and
    wait for the run to end; it must end within ``WITHIN`` seconds."""
    task, name = unique("refused"), unique("refusedwf")
    await client.register_workflow(loop_workflow(name, task, retry=RETRY))
    handlers = {task: handler}
    if worker == "own process":
        running = Worker(engine.target, handlers=handlers, poll_wait=1.0, local_socket="off")
    else:
        running = in_process_worker(engine, handlers, concurrency=4, poll_wait=1.0)
    async with running:
        started = time.monotonic()
        run = await client.start_run(name)
        done = await client.wait_for_run(run.run_id, timeout=60)
        took = time.monotonic() - started
    assert done.status == pb.RUN_STATUS_FAILED, done
    assert took < WITHIN, f"the step ended after {took:.1f}s"
    assert len(done.steps) == 1 and done.steps[0].attempt == 1, "no retry: it cannot help"
    return done


WORKERS = pytest.mark.parametrize("worker", ["own process", "services' process"])


@WORKERS
async def test_a_state_too_large_for_the_journal_fails_the_step_at_once(
    client: Client, engine: EngineServer, worker: str
) -> None:
    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        await tc.checkpoint("s" * (STATE_BYTES - 2))  # JSON: the quotes make it STATE_BYTES
        await tc.continue_()

    run = await _fail_fast(client, engine, handler, worker)
    said = f"the state is {_size(STATE_BYTES)}; a journal record is at most"
    assert said in run.error and _size(MAX_RECORD_BYTES) in run.error, run.error
    assert "restart limit" not in run.error
    commits = [r.commit for r in await read_journal(engine, run.run_id) if r.HasField("commit")]
    assert len(commits) == 1, "one failure, committed without the state that was refused"
    assert commits[0].reason == "record_too_large" and not commits[0].has_state


@WORKERS
async def test_a_tool_output_too_large_for_the_journal_fails_the_step_at_once(
    client: Client, engine: EngineServer, worker: str
) -> None:
    async def dump(run: ToolRun) -> str:
        return "y" * (TOOL_BYTES - 2)

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        await j.tool(ToolCall(name="dump", input={}), Replay.UNSAFE, dump)
        await tc.complete("went on")

    run = await _fail_fast(client, engine, handler, worker)
    assert f"the tool's output is {_size(TOOL_BYTES)}" in run.error, run.error
    records = await read_journal(engine, run.run_id)
    results = [r.tool_result for r in records if r.HasField("tool_result")]
    assert len(results) == 1 and results[0].error.startswith("tool result not recorded: ")
    assert _size(TOOL_BYTES) in results[0].error, "the intent is answered, saying why"


async def test_a_replay_mismatch_fails_the_step_at_once_with_its_message(
    client: Client, engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first delivery records a call to ``search`` and stalls before its
    commit; the redelivery's handler calls ``fetch`` at that position."""
    calls: list[str] = []

    async def tool(run: ToolRun) -> str:
        return "ok"

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        name = "search" if not calls else "fetch"
        calls.append(name)
        await j.tool(ToolCall(name=name, input={}), Replay.SAFE, tool)
        await tc.complete("went on")

    monkeypatch.setattr(sdk_journal, "PENDING_BYTES", 0)  # the result is stored at once
    task, name = unique("mismatch"), unique("mismatchwf")
    await client.register_workflow(loop_workflow(name, task, retry=RETRY))
    with Crasher("after_result"):  # the first holder stalls there, sending nothing
        async with Worker(
            engine.target,
            handlers={task: handler},
            poll_wait=1.0,
            concurrency=2,
            heartbeat_interval=NO_HEARTBEAT,
        ) as worker:
            run = await client.start_run(name)
            done = await client.wait_for_run(run.run_id, timeout=60)
            await worker.stop(grace=0)
    assert calls == ["search", "fetch"], "the redelivery ran once, and no retry followed"
    assert done.status == pb.RUN_STATUS_FAILED
    assert "ReplayMismatch: position 0 recorded tool 'search'" in done.error, done.error
    commits = [r.commit for r in await read_journal(engine, run.run_id) if r.HasField("commit")]
    assert [c.reason for c in commits] == ["replay_mismatch"]


async def test_the_refusal_is_the_runs_error_in_the_cli_and_the_rest_api(
    client: Client, engine: EngineServer, http: httpx.AsyncClient
) -> None:
    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        await tc.checkpoint("s" * (STATE_BYTES - 2))
        await tc.continue_()

    run = await _fail_fast(client, engine, handler, "own process")
    said = f"the state is {_size(STATE_BYTES)}"
    shown = await adagnats("run", "get", run.run_id, env={"DAGNATS_ENGINE": engine.target})
    assert shown.returncode == 0, shown.stderr
    assert said in shown.stdout, shown.stdout
    got = await http.get(f"/runs/{run.run_id}")
    assert got.status_code == 200
    body = got.json()
    assert body["status"] == "failed" and said in body["error"], body


# ---- the HTTP bridge ----------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roomy(engine: EngineServer) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway that takes bodies larger than a journal record: a refusal
    then comes from the journal, not from the gateway's body limit."""
    server = await start_gateway(
        GatewayConfig(engine_target=engine.target, port=0, max_body_bytes=8 << 20)
    )
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        yield http
    await server.stop()


async def _bridge_task(client: Client, http: httpx.AsyncClient) -> tuple[str, str]:
    """A run of a new loop workflow and its task's bridge token."""
    task, name = unique("bridged"), unique("bridgedwf")
    await client.register_workflow(loop_workflow(name, task, retry=RETRY))
    run = await client.start_run(name)
    while True:
        polled = await http.post("/bridge/poll", json={"task_types": [task], "wait": 5})
        assert polled.status_code == 200, polled.text
        if polled.json()["tasks"]:
            return run.run_id, polled.json()["tasks"][0]["token"]


@pytest.mark.parametrize("what", ["state", "tool output"])
async def test_a_refusal_through_the_bridge_is_a_4xx_and_fails_the_step(
    client: Client, roomy: httpx.AsyncClient, what: str
) -> None:
    run_id, token = await _bridge_task(client, roomy)
    if what == "state":
        read = await roomy.post("/bridge/journal/read", json={"token": token})
        assert read.status_code == 200, read.text
        big, size = "s" * (STATE_BYTES - 2), STATE_BYTES
        answer = await roomy.post(
            "/bridge/resolve",
            json={"token": read.json()["token"], "outcome": "continue", "state": big},
        )
        said = f"the state is {_size(size)}"
    else:
        begun = await roomy.post(
            "/bridge/journal/tool/begin",
            json={"token": token, "name": "dump", "input": {}, "replay": "unsafe"},
        )
        assert begun.status_code == 200, begun.text
        big, size = "y" * (TOOL_BYTES - 2), TOOL_BYTES
        answer = await roomy.post(
            "/bridge/journal/tool/finish", json={"token": begun.json()["token"], "output": big}
        )
        said = f"the tool's output is {_size(size)}"
    assert answer.status_code == 413, answer.text
    body = answer.json()
    assert body["code"] == "record_too_large" and said in body["message"], body
    assert "the step failed" in body["message"]
    run = await client.wait_for_run(run_id, timeout=WITHIN)
    assert run.status == pb.RUN_STATUS_FAILED
    assert said in run.error, run.error
