"""Races inside one Python worker: the keep-alive against the handler's own
journal writes, a cancel that lands while a tool runs, and two claims of one
dispatch at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import pytest

from dagnats.core import jetstream as jsx
from dagnats.core.subjects import task_consumer
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import (
    Client,
    DagnatsError,
    Fenced,
    JournalSignal,
    Replay,
    TaskContext,
    ToolCall,
    ToolRun,
    Worker,
    run_output,
)
from dagnats.sdk._rpc import EngineRpc
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, steps_by_id, unique
from tests.test_journal import journal_check, read_journal

# The tool reports for this many leases, so the worker's default keep-alive
# (a Hold, then a heartbeat, every third of a lease) runs while writes are in flight.
LEASES_OF_REPORTING = 3
RIVALS = 4
LIMIT = 1000  # the rivals' claims in a row must not reach the restart limit


async def register(client: Client, **step: Any) -> tuple[str, str]:
    task, name = unique("races"), unique("raceswf")
    await client.register_workflow(loop_workflow(name, task, **step))
    return task, name


async def no_task_left(engine: EngineServer, task: str) -> bool:
    """The task type's consumer holds nothing: every message was settled."""
    info = await engine.nc.jetstream().consumer_info(jsx.TASKS, task_consumer(task))
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_keep_alive_does_not_fence_a_handler_whose_tool_reports(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    loop = asyncio.get_running_loop()
    starts, deliveries, signals = Counter[str](), [], []

    async def stream(run: ToolRun) -> Any:
        starts[run.call.name] += 1
        end = loop.time() + LEASES_OF_REPORTING * FAST.task_ack_wait
        chunks = 0
        while loop.time() < end:
            await run.report(f"line {chunks}\n")
            chunks += 1
        return {"chunks": chunks}

    async def handler(tc: TaskContext) -> None:
        deliveries.append(tc.delivery)
        try:
            j = await tc.journal()
            result = await j.tool(ToolCall(name="stream"), Replay.UNSAFE, stream)
            await tc.complete(result.output)
        except BaseException as signal:
            signals.append(type(signal).__name__)
            raise

    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
        run = await client.start_run(name)
        done = await client.wait_for_run(run.run_id, timeout=40)
    assert signals == [], "the holder was never fenced nor cancelled"
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done)["chunks"] > 0
    assert deliveries == [1], "the lease was kept alive: no redelivery"
    assert starts == Counter(stream=1)
    records = await read_journal(engine, run.run_id)
    assert len({r.writer for r in records}) == 1, "one holder wrote the whole journal"
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


@pytest.mark.parametrize("tool", ["waits", "streams"])
async def test_cancel_while_an_unsafe_tool_runs_answers_its_intent(
    client: Client, engine: EngineServer, tool: str
) -> None:
    # The tool waits for the cancel, or reports output until then, so that the
    # cancel mostly lands on a write in flight.
    task, name = await register(client)
    starts, started = Counter[str](), asyncio.Event()

    async def send_email(run: ToolRun) -> Any:
        starts[run.call.name] += 1
        await run.report("connecting;")
        started.set()
        if tool == "waits":
            await asyncio.Event().wait()
        while True:
            await run.report("sending;")

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        await j.tool(ToolCall(name="send_email", input={"to": "ops"}), Replay.UNSAFE, send_email)
        await tc.complete("sent")

    async with Worker(
        engine.target, handlers={task: handler}, poll_wait=1.0, heartbeat_interval=0.1
    ) as worker:
        run = await client.start_run(name)
        await wait_for(started.is_set, timeout=20, message="the tool never started")
        await client.cancel_run(run.run_id, "operator stop")
        await wait_for(lambda: worker.in_flight == 0, timeout=20, message="handler still running")
        await wait_for(lambda: no_task_left(engine, task), timeout=20)
    done = await client.get_run(run.run_id)
    assert done.status == pb.RUN_STATUS_CANCELLED
    assert starts == Counter(send_email=1)
    records = await read_journal(engine, run.run_id)
    (intent,) = [r for r in records if r.HasField("tool_intent")]
    # Its result is stored on its own, or (once the cancel sealed the journal)
    # ahead of a copy of the cancel.
    (result,) = [
        r.tool_result if r.HasField("tool_result") else r.leading_tool_result
        for r in records
        if r.HasField("tool_result") or r.HasField("leading_tool_result")
    ]
    assert result.intent_seq == intent.seq and result.interrupted
    reported = "".join(r.tool_output.chunk for r in records if r.HasField("tool_output"))
    assert result.partial == reported, "the partial output is all it reported"
    # The run's cancel ends the journal: no commit follows it.
    assert records[-1].HasField("cancel")
    assert not [r for r in records if r.HasField("commit")]
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


async def test_a_claim_that_loses_a_race_settles_without_a_report(
    client: Client, engine: EngineServer
) -> None:
    # Rivals keep claiming the worker's dispatch while the worker claims it, as
    # a stalled holder and the worker its task was redelivered to may: each
    # claim reads the tail, then appends after it, and loses when another
    # claim landed in between. The worker's losing claim must settle without a
    # report; a reported failure would fail this step, which has no retry left.
    # The race is run by the second attempt: the first attempt's first
    # delivery fences nothing, so its claim rides the first record and races
    # nobody.
    retry = {"max_attempts": 2, "backoff": "fixed", "initial_delay": "10ms"}
    task, name = await register(client, retry=retry)
    lost: list[BaseException] = []

    async def race(tc: TaskContext) -> None:
        rpc = EngineRpc(engine.target, timeout=10.0)
        claims, settled = [0], asyncio.Event()

        async def rival(i: int) -> None:
            while not settled.is_set():
                holder = TaskContext(tc._leased, rpc, worker_id=f"rival-{i}", restart_limit=LIMIT)
                with contextlib.suppress(DagnatsError, JournalSignal):
                    await holder.journal()
                claims[0] += 1

        rivals = [asyncio.create_task(rival(i)) for i in range(RIVALS)]
        try:
            await wait_for(lambda: claims[0] >= RIVALS, timeout=10)
            mine = await asyncio.gather(tc.journal(), return_exceptions=True)
        finally:
            settled.set()
            await asyncio.gather(*rivals)
            await rpc.close()
        if isinstance(mine[0], BaseException):
            lost.append(mine[0])
            raise mine[0]

    async def handler(tc: TaskContext) -> None:
        if tc.attempt == 1:
            await tc.fail("the first attempt fails before it claims")
            return
        if tc.delivery == 1:
            await race(tc)
        await tc.journal()
        await tc.complete(tc.delivery)

    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0, restart_limit=LIMIT):
        for _ in range(10):  # runs until the worker's claim lost (almost always the first)
            run = await client.start_run(name)
            done = await client.wait_for_run(run.run_id, timeout=30)
            assert done.status == pb.RUN_STATUS_COMPLETED, done.error
            assert steps_by_id(done)["agent"].attempt == 2, "the last attempt was not retried"
            if lost:
                break
    assert lost, "the worker's claim never lost a race"
    assert all(isinstance(e, Fenced) for e in lost), lost
