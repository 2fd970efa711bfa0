"""Riding out the restarts and elections a production system has every day.

- The engine process (engine, journal and inputs services) is SIGKILLed while
  a worker is between an unsafe tool's end and its result record, and a fresh
  process starts on its port 1 s or 5 s later: the worker keeps its lease
  alive and retries the result until the service is back. The result is
  recorded (not ``interrupted``), no attempt is spent, and no recorded model
  call is asked again (the scripted model counts its requests).
- The same across stream-leader step-downs of ``AGENT_JOURNAL`` and
  ``HISTORY`` on a 3-node cluster.
- A NATS request that times out inside a journal call answers that call with
  a retriable status and the error trailers, on a unary call and on a
  ``Session`` stream (which stays open), instead of ``UNKNOWN``.
- An engine killed after it took a continue's event from the history and
  before it applied it: another engine's reconciler applies it, so the next
  iteration is dispatched within a few reconciler intervals, long before the
  event's redelivery (``history_ack_wait``) could have done it.

Leases here are long (``LEASE``) so that the longest outage is within one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import nats
import nats.errors
import pytest
import pytest_asyncio

from dagnats.core import jetstream as jsx
from dagnats.core import seam
from dagnats.core.natsserver import NatsCluster, NatsServer
from dagnats.engine.config import EngineConfig
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import (
    Client,
    JournalClient,
    Replay,
    TaskContext,
    ToolCall,
    ToolRun,
    Worker,
    run_output,
)
from dagnats.sdk.testing import ScriptedModel
from tests.helpers import body, holds, trailing, wait_for
from tests.matrix import EngineProcess
from tests.stack import FAST, loop_workflow, steps_by_id, unique

LEASE = 20.0  # seconds; a 5 s outage and a process start fit well within it
RECONCILE = 2.0
HISTORY_ACK_WAIT = 60.0
STORM = 4.0  # seconds of step-downs
SCRIPT = [{"tool": "send", "input": {"to": "ops"}}, {"answer": "done"}]

Fault = Callable[[], Awaitable[None]]


class Agent:
    """One unsafe tool call, then the answer. ``fault`` runs inside the tool,
    after its effect and before it returns, i.e. before its result is recorded."""

    def __init__(self, fault: Fault) -> None:
        self.model = ScriptedModel(SCRIPT)
        self.fault = fault
        self.starts = 0

    async def tool(self, run: ToolRun) -> Any:
        self.starts += 1
        if self.starts == 1:
            await self.fault()
        return {"sent": run.call.input["to"]}

    async def turn(self, tc: TaskContext) -> None:
        j = await tc.journal()
        history = await tc.load_checkpoint() or [tc.input]
        reply = await j.model(lambda: self.model(history))
        if "answer" in reply:
            await tc.complete(reply["answer"])
            return
        call = ToolCall(name=reply["tool"], input=reply["input"])
        result = await j.tool(call, Replay.UNSAFE, self.tool)
        await tc.checkpoint([*history, {"reply": reply, "output": result.output}])
        await tc.continue_()


async def run_agent(target: str, agent: Agent) -> tuple[pb.Run, list[jpb.Record], list[Any]]:
    """Run the agent's workflow to its end; the run, its journal and the audit."""
    task, name = unique("restart"), unique("restartwf")
    async with Client(target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(target, handlers={task: agent.turn}, poll_wait=0.5, concurrency=1):
            run = await client.start_run(name, {"ask": "notify ops"})
            done = await client.wait_for_run(run.run_id, timeout=120)
    async with JournalClient(target) as journal:
        records = [r async for r in journal.read(run.run_id, "agent")]
        violations = list((await journal.check(run.run_id)).violations)
    return done, records, violations


def assert_nothing_lost(
    agent: Agent, done: pb.Run, records: list[jpb.Record], violations: list[Any]
) -> None:
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == "done"
    assert violations == []
    results = [body(r, "tool_result") for r in records if holds(r, "tool_result")]
    assert [(r.interrupted, json.loads(r.output or b"null")) for r in results] == [
        (False, {"sent": "ops"})
    ], "the tool's own result is recorded, not interrupted"
    assert {r.attempt for r in records} == {1}, "no attempt was spent"
    assert steps_by_id(done)["agent"].attempt == 1
    assert agent.model.calls == len(SCRIPT), "a recorded model call was asked again"
    assert agent.starts == 1


@pytest_asyncio.fixture(loop_scope="module")
async def engine_process(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[EngineProcess]:
    engine = EngineProcess(
        nats_server.url, tmp_path, "engine", env={"DAGNATS_TASK_ACK_WAIT": str(LEASE)}
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.mark.slow
@pytest.mark.parametrize("down", [1.0, 5.0])
async def test_an_engine_restart_between_a_tool_and_its_result_loses_nothing(
    engine_process: EngineProcess, down: float
) -> None:
    restarted: list[asyncio.Task[None]] = []

    async def restart_later() -> None:
        await asyncio.sleep(down)  # the outage being ridden out, not a wait for a condition
        await engine_process.start()

    async def kill_the_engine() -> None:
        engine_process.kill()  # SIGKILL, and reaped
        restarted.append(asyncio.create_task(restart_later()))

    agent = Agent(kill_the_engine)
    done, records, violations = await run_agent(engine_process.target, agent)

    assert restarted and restarted[0].done() and restarted[0].exception() is None
    assert engine_process.starts == 2
    assert_nothing_lost(agent, done, records, violations)


@pytest.mark.slow
async def test_stream_leader_step_downs_between_a_tool_and_its_result_lose_nothing(
    nats_cluster: NatsCluster,
) -> None:
    config = EngineConfig.from_env(FAST, task_ack_wait=LEASE)
    engine = await start_engine(nats_cluster.url, config=config, topology=jsx.Topology(replicas=3))
    nc = await nats.connect(servers=nats_cluster.urls)
    answers: list[bytes] = []
    storm: list[asyncio.Task[None]] = []

    async def step_down(stream: str) -> None:
        subject = f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}"
        with contextlib.suppress(nats.errors.Error):  # no leader to step down yet
            answers.append((await nc.request(subject, b"", timeout=5)).data)

    async def step_downs() -> None:
        # The journal's and the history's leaders step down again and again
        # while the rest of the run (the result, the commit, the next claim,
        # the model call, the answer) is written.
        end = asyncio.get_running_loop().time() + STORM
        while asyncio.get_running_loop().time() < end:
            await asyncio.gather(step_down(jsx.JOURNAL), step_down(jsx.HISTORY))

    async def first_step_downs() -> None:
        await asyncio.gather(step_down(jsx.JOURNAL), step_down(jsx.HISTORY))
        storm.append(asyncio.create_task(step_downs()))

    agent = Agent(first_step_downs)
    try:
        done, records, violations = await run_agent(engine.target, agent)
        await asyncio.gather(*storm)
    finally:
        await nc.close()
        await engine.stop()

    assert sum(b'"success":true' in a for a in answers) >= 2, answers
    assert_nothing_lost(agent, done, records, violations)


@pytest_asyncio.fixture(loop_scope="module")
async def two_engines(
    nats_server: NatsServer, tmp_path: Path
) -> AsyncIterator[tuple[EngineProcess, EngineProcess, Path, Path]]:
    arm, hit = tmp_path / "arm", tmp_path / "hit"
    env = {
        "DAGNATS_TASK_ACK_WAIT": str(LEASE),
        "DAGNATS_RECONCILE_INTERVAL": str(RECONCILE),
        "DAGNATS_HISTORY_ACK_WAIT": str(HISTORY_ACK_WAIT),
    }
    engines = [
        EngineProcess(nats_server.url, tmp_path, f"engine-{i}", arm=arm, hit=hit, env=env)
        for i in (1, 2)
    ]
    try:
        for engine in engines:
            await engine.start()
        yield engines[0], engines[1], arm, hit
    finally:
        for engine in engines:
            await engine.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "journaled", [False, True], ids=["reported, on the history", "journaled, sent directly"]
)
async def test_an_engine_killed_after_taking_a_continue_stalls_the_run_for_a_reconcile_only(
    two_engines: tuple[EngineProcess, EngineProcess, Path, Path], journaled: bool
) -> None:
    # Reported without a journal, the continue's event is on the history, and
    # the reconciler applies it; a journal's commit sent its event to one
    # engine directly, and the journal service publishes it on the
    # history after a third of its wait.
    first, second, arm, hit = two_engines
    target = "ipv4:" + ",".join(e.target for e in (first, second))
    loop = asyncio.get_running_loop()
    claimed: dict[int, float] = {}

    async def turn(tc: TaskContext) -> None:
        if journaled:
            await tc.journal()
        claimed.setdefault(tc.iteration, loop.time())
        if tc.iteration == 0:
            # The first engine to take the continue's event dies before applying it.
            arm.write_text("before_event_applied kill")
            await tc.continue_()
        else:
            await tc.complete("done")

    task, name = unique("stall"), unique("stallwf")
    async with Client(target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(target, handlers={task: turn}, poll_wait=0.5, concurrency=1):
            run = await client.start_run(name, {"ask": "go on"})
            await wait_for(hit.exists, timeout=30, message="no engine took the event")
            killed = loop.time()
            # The event's redelivery comes HISTORY_ACK_WAIT after the kill; the
            # reconciler needs two of its passes.
            await wait_for(
                lambda: 1 in claimed,
                timeout=HISTORY_ACK_WAIT / 2,
                message="iteration 1 was not dispatched before the event's redelivery",
            )
            done = await client.wait_for_run(run.run_id, timeout=60)
    stopped = int(hit.read_text().split()[0])
    dead = next(e for e in (first, second) if e.starts == 1 and e.pid == stopped)
    assert not dead.running
    with contextlib.suppress(AssertionError):
        await dead.start()  # back for the fixture's stop
    assert claimed[1] - killed < HISTORY_ACK_WAIT
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert steps_by_id(done)["agent"].iterations == 1


def nats_timeout_once() -> seam.Hook:
    """A journal service whose NATS request times out once, inside PlaceInputs."""

    async def hook(name: str) -> None:
        if name == "after_input_claimed":
            seam.install(None)
            raise nats.errors.TimeoutError

    return hook


@pytest_asyncio.fixture(loop_scope="module")
async def journal(engine: EngineServer) -> AsyncIterator[jgrpc.JournalServiceAsyncStub]:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        yield jgrpc.JournalServiceStub(channel)


async def place_inputs_request(
    client: Client, journal: jgrpc.JournalServiceAsyncStub
) -> jpb.PlaceInputsRequest:
    """A PlaceInputs call of a claimed iteration 0, with one input queued."""
    task, name = unique("timeout"), unique("timeoutwf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, "go")
    claim = await journal.Claim(
        jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
    )
    await client.submit_input(run.run_id, "agent", "s1", {"steer": 1})
    return jpb.PlaceInputsRequest(token=claim.claimed.token, position=0, mode=1)


async def test_a_nats_timeout_in_a_unary_journal_call_is_a_retriable_status(
    client: Client, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    request = await place_inputs_request(client, journal)
    seam.install(nats_timeout_once())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await journal.PlaceInputs(request)
    finally:
        seam.install(None)
    retried = await journal.PlaceInputs(request)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ("dagnats-error-code", "deadline_exceeded") in tuple(trailing(failed.value).items())
    assert [p.request_id for p in retried.inputs] == ["s1"]


async def test_a_nats_timeout_in_a_session_call_answers_it_and_keeps_the_stream(
    client: Client, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    request = await place_inputs_request(client, journal)
    stream = journal.Session(None)
    seam.install(nats_timeout_once())
    try:
        await stream.write(jpb.SessionRequest(id=1, place_inputs=request))
        first = await stream.read()
    finally:
        seam.install(None)
    await stream.write(jpb.SessionRequest(id=2, place_inputs=request))
    second = await stream.read()
    await stream.done_writing()
    assert isinstance(first, jpb.SessionResponse) and isinstance(second, jpb.SessionResponse)
    assert first.id == 1 and first.WhichOneof("result") == "error"
    assert first.error.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert first.error.code == "deadline_exceeded"
    assert second.id == 2 and [p.request_id for p in second.place_inputs.inputs] == ["s1"]
