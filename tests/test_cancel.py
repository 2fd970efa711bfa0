"""A cancel stops a run's side effects at once and reaches its handler fast.

The handler of each test calls a model and then an unsafe tool, in a loop;
the tool counts its starts outside the journal and runs for a while, so the
cancel lands while it runs. Once ``Client.cancel_run`` returns, no tool
starts and no model is called: the journal refuses the run's new calls
(``RunCancelled``), for a worker on gRPC, on the local socket, in the
services' process and on the HTTP bridge, and for a child run. The tool that
was running keeps its result. The handler hears the cancel within a few
seconds although its heartbeats are minutes apart (the module's lease is
long): a poll that watches the run tells it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
import httpx
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration

from dagnats.core.errors import InvalidArgument, RunCancelled
from dagnats.core.grpcutil import WireError, error_from_rpc
from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.gateway import GatewayConfig, GatewayServer, start_gateway
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, socket_dir, steps_by_id, unique
from tests.test_journal import hosted, journal_check, read_journal, remote, socketed

# Heartbeats every 20 s: a handler that hears of the cancel sooner heard it
# from the watching poll, not from a heartbeat.
LONG_LEASE = dataclasses.replace(FAST, task_ack_wait=60.0)
HEARD_WITHIN = 3.0  # seconds; the promise is 0.5 s at the 99th percentile
TOOL_RUNS = 0.3  # seconds a tool call takes: the cancel lands while one runs


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    with socket_dir() as sockets:
        server = await start_engine(
            nats_server.url, config=LONG_LEASE, local_socket=sockets / "local.sock"
        )
        yield server
        await server.stop()


@dataclass
class Agent:
    """A handler that calls a model, then an unsafe tool, until it is stopped;
    what it did, timed, counted outside the journal."""

    tool_starts: list[float] = field(default_factory=list)
    model_calls: list[float] = field(default_factory=list)
    heard: dict[str, float] = field(default_factory=dict)  # run -> when it stopped
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def act(self, run: ToolRun) -> Any:
        self.tool_starts.append(time.monotonic())
        self.started.set()
        await asyncio.sleep(TOOL_RUNS)
        return {"done": run.call.input}

    async def ask(self) -> Any:
        self.model_calls.append(time.monotonic())
        return {"next": len(self.model_calls)}

    async def handler(self, tc: TaskContext) -> None:
        try:
            j = await tc.journal()
            n = 0
            while True:
                await j.model(self.ask)
                await j.tool(ToolCall(name="act", input={"n": n}), Replay.UNSAFE, self.act)
                n += 1
        except (asyncio.CancelledError, RunCancelled):
            self.heard[tc.run_id] = time.monotonic()
            raise

    def after(self, moment: float) -> tuple[int, int]:
        """Tool starts and model calls after ``moment``."""
        return (
            len([t for t in self.tool_starts if t > moment]),
            len([t for t in self.model_calls if t > moment]),
        )


async def cancelled_at_once(client: Client, run_id: str) -> float:
    """Cancel the run; when the cancel returned."""
    await client.cancel_run(run_id, "operator stop")
    return time.monotonic()


def ends_in_a_cancel(records: list[jpb.Record]) -> None:
    """The journal holds no call after the run's cancel but the result of
    the tool that was running, and every intent has its result."""
    (first,) = [i for i, r in enumerate(records) if r.HasField("cancel") and not r.writer]
    after = records[first + 1 :]
    assert all(r.HasField("cancel") for r in after), [r.WhichOneof("kind") for r in after]
    intents = [r for r in records if r.HasField("tool_intent")]
    results = {
        (r.tool_result if r.HasField("tool_result") else r.leading_tool_result).intent_seq
        for r in records
        if r.HasField("tool_result") or r.HasField("leading_tool_result")
    }
    assert {i.seq for i in intents} == results, "every intent has a result"


WORKERS = pytest.mark.parametrize(
    "worker", [remote, socketed, hosted], ids=["grpc", "socket", "services"]
)


@WORKERS
async def test_a_cancelled_run_starts_no_tool_after_the_cancel_returns(
    client: Client, engine: EngineServer, worker: Callable[..., Worker]
) -> None:
    task, name = unique("cancel"), unique("cancelwf")
    await client.register_workflow(loop_workflow(name, task))
    agent = Agent()
    async with worker(engine, {task: agent.handler}) as running:
        run = await client.start_run(name)
        await wait_for(agent.started.is_set, timeout=20, message="no tool started")
        returned = await cancelled_at_once(client, run.run_id)
        await wait_for(
            lambda: run.run_id in agent.heard,
            timeout=HEARD_WITHIN,
            message=f"the handler did not hear the cancel within {HEARD_WITHIN}s",
        )
        await wait_for(lambda: running.in_flight == 0, timeout=20, message="handler running")
    assert agent.after(returned) == (0, 0), "no tool start or model call after the cancel"
    assert agent.heard[run.run_id] - returned < HEARD_WITHIN
    done = await client.get_run(run.run_id)
    assert done.status == pb.RUN_STATUS_CANCELLED
    ends_in_a_cancel(await read_journal(engine, run.run_id))
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


async def test_a_child_run_is_cancelled_before_the_cancel_of_its_parent_returns(
    client: Client, engine: EngineServer
) -> None:
    child_task = unique("child")
    parent_name, child_name = unique("parentwf"), unique("childwf")
    await client.register_workflow(loop_workflow(child_name, child_task))
    await client.register_workflow(
        {
            "name": parent_name,
            "steps": [{"id": "helper", "type": "sub_workflow", "workflow": child_name}],
        }
    )
    agent = Agent()
    async with remote(engine, {child_task: agent.handler}) as running:
        run = await client.start_run(parent_name)
        await wait_for(agent.started.is_set, timeout=20, message="no tool started")
        child_id = steps_by_id(await client.get_run(run.run_id))["helper"].child_run_id
        returned = await cancelled_at_once(client, run.run_id)
        child = await client.get_run(child_id)
        assert child.status == pb.RUN_STATUS_CANCELLED, "cancelled before the answer"
        await wait_for(lambda: child_id in agent.heard, timeout=HEARD_WITHIN)
        await wait_for(lambda: running.in_flight == 0, timeout=20, message="handler running")
    assert agent.after(returned) == (0, 0)
    ends_in_a_cancel(await read_journal(engine, child_id))
    check = await journal_check(engine, child_id)
    assert list(check.violations) == [], check.violations


async def test_a_handler_without_a_journal_hears_the_cancel(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("plain"), unique("plainwf")
    await client.register_workflow(loop_workflow(name, task))
    started, heard = asyncio.Event(), asyncio.Event()

    async def handler(tc: TaskContext) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            heard.set()
            raise

    async with remote(engine, {task: handler}) as running:
        run = await client.start_run(name)
        await wait_for(started.is_set, timeout=20, message="the handler did not start")
        await client.cancel_run(run.run_id, "operator stop")
        await wait_for(heard.is_set, timeout=HEARD_WITHIN, message="the cancel was not heard")
        await wait_for(lambda: running.in_flight == 0, timeout=20, message="handler running")
    assert (await client.get_run(run.run_id)).status == pb.RUN_STATUS_CANCELLED
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


# ---- the HTTP bridge ---------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(engine: EngineServer) -> AsyncIterator[GatewayServer]:
    server = await start_gateway(GatewayConfig(engine_target=engine.target, port=0))
    yield server
    await server.stop()


async def bridge(http: httpx.AsyncClient, path: str, status: int = 200, **body: Any) -> Any:
    response = await http.post(f"/bridge/{path}", json=body)
    assert response.status_code == status, response.text
    return response.json()


async def test_a_bridge_worker_is_refused_new_calls_once_the_cancel_returns(
    client: Client, engine: EngineServer, gateway: GatewayServer
) -> None:
    task, name = unique("bcancel"), unique("bcancelwf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http:
        polled = await bridge(http, "poll", task_types=[task], wait="10s", worker_id="w")
        (leased,) = polled["tasks"]
        token = (await bridge(http, "journal/read", token=leased["token"]))["token"]
        begun = await bridge(http, "journal/tool/begin", token=token, name="act", input={"n": 0})
        assert begun["run"], begun  # the tool runs now
        await client.cancel_run(run.run_id, "operator stop")
        # The running tool's result is stored; nothing new is.
        token = (await bridge(http, "journal/tool/finish", token=begun["token"], output=1))["token"]
        refused = await bridge(http, "journal/tool/begin", 409, token=token, name="act", input=1)
        assert refused["code"] == "cancelled", refused
        refused = await bridge(http, "journal/model/begin", 409, token=token)
        assert refused["code"] == "cancelled", refused
        late = await bridge(http, "resolve", 409, token=token, outcome="complete", output=1)
        assert late["code"] == "cancelled", late
    records = await read_journal(engine, run.run_id)
    assert len([r for r in records if r.HasField("tool_intent")]) == 1
    ends_in_a_cancel(records)
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


# ---- the journal's refusals, call by call ------------------------------------------


async def refused(call: Any) -> WireError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return error_from_rpc(caught.value)


async def test_the_journal_refuses_every_new_call_of_a_cancelled_run_and_writes_nothing(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("jcancel"), unique("jcancelwf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name)  # no worker: the journal is driven by hand
    async with grpc.aio.insecure_channel(engine.target) as channel:
        j = jgrpc.JournalServiceStub(channel)

        def claim(iteration: int, attempt: int = 1) -> jpb.ClaimRequest:
            return jpb.ClaimRequest(
                run_id=run.run_id, step_id="agent", iteration=iteration, attempt=attempt
            )

        token = (await j.Claim(claim(0))).claimed.token
        running = await j.BeginTool(
            jpb.BeginToolRequest(token=token, position=0, name="act", input=b"1")
        )
        token = running.token
        await client.cancel_run(run.run_id, "operator stop")
        before = await read_journal(engine, run.run_id)
        assert before[-1].HasField("cancel") and before[-1].cancel.reason == "operator stop"

        calls: dict[str, Callable[[], Any]] = {
            "a tool intent": lambda: j.BeginTool(
                jpb.BeginToolRequest(token=token, position=1, name="act", input=b"2")
            ),
            "a model call": lambda: j.BeginModel(jpb.BeginModelRequest(token=token, position=1)),
            "a model response": lambda: j.RecordModel(
                jpb.RecordModelRequest(token=token, position=1, response=b"{}")
            ),
            "a tool's output": lambda: j.ToolOutput(
                jpb.ToolOutputRequest(token=token, intent_seq=running.intent_seq, chunk="x")
            ),
            "a commit": lambda: j.Commit(
                jpb.CommitRequest(token=token, commit=jpb.Commit(action=jpb.ACTION_COMPLETE))
            ),
            "a claim": lambda: j.Claim(claim(0, attempt=2)),
            "a hold": lambda: j.CheckTail(jpb.CheckTailRequest(token=token)),
        }
        for what, call in calls.items():
            err = await refused(call())
            assert isinstance(err, RunCancelled), (what, err)
            assert err.code == "cancelled" and err.run_id == run.run_id, what
        assert await read_journal(engine, run.run_id) == before, "nothing was written"

        # The tool that was running when the cancel came keeps its result.
        finished = await j.FinishTool(
            jpb.FinishToolRequest(token=token, intent_seq=running.intent_seq, output=b"1")
        )
        again = await j.FinishTool(  # its answer was lost: sent again, stored once
            jpb.FinishToolRequest(token=token, intent_seq=running.intent_seq, output=b"1")
        )
        assert again.token.last_seq == finished.token.last_seq
        after = await read_journal(engine, run.run_id)
        assert len(after) == len(before) + 1
        kept = after[-1]
        assert kept.HasField("cancel") and kept.leading_tool_result.intent_seq == running.intent_seq
        err = await refused(
            j.Commit(
                jpb.CommitRequest(
                    token=finished.token, commit=jpb.Commit(action=jpb.ACTION_COMPLETE)
                )
            )
        )
        assert isinstance(err, RunCancelled)
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


# ---- the watch ---------------------------------------------------------------------


async def test_a_watch_sent_after_the_cancel_hears_it_at_once_and_bad_ones_are_refused(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("watch"), unique("watchwf")
    await client.register_workflow(loop_workflow(name, task))
    cancelled, running = await client.start_run(name), await client.start_run(name)
    await client.cancel_run(cancelled.run_id, "operator stop")
    await wait_for(lambda: engine.cancels.was_heard(cancelled.run_id), timeout=10)

    async def announced_for_good() -> bool:  # a reconciler pass read its end: announced no more
        store = engine.engine.store
        stored = await store.load_run(cancelled.run_id)
        return stored is not None and await store.index_mark() >= stored.revision

    await wait_for(announced_for_good, timeout=20)
    wait = Duration()
    wait.FromSeconds(30)

    def watch(*runs: str) -> pb.PollTasksRequest:
        return pb.PollTasksRequest(
            task_types=[task], worker_id="w", wait=wait, cancel_watch=list(runs)
        )

    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        # Heard when it was announced, before this watch: answered at once.
        answer = await stub.PollTasks(watch(running.run_id, cancelled.run_id), timeout=10)
        assert list(answer.cancelled_runs) == [cancelled.run_id] and not answer.tasks
        # Waiting: answered when the cancel comes.
        pending = asyncio.ensure_future(stub.PollTasks(watch(running.run_id), timeout=10))
        await client.cancel_run(running.run_id, "operator stop")
        assert list((await pending).cancelled_runs) == [running.run_id]
        for bad, field_name in (
            (watch("not-a-run"), "cancel_watch[0]"),
            (watch(*(f"{n:032x}" for n in range(1025))), "cancel_watch"),
        ):
            err = await refused(stub.PollTasks(bad, timeout=10))
            assert isinstance(err, InvalidArgument) and err.field == field_name, err
