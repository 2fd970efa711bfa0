"""Steering a running agent, follow-ups, and waits that hold no worker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from unittest import mock

import grpc.aio

from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import task_consumer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.store import InputStore
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, InputMode, TaskContext, Worker
from dagnats.sdk.testing import ScriptedModel
from examples.agent_turn.handler import make_agent_turn
from tests.helpers import wait_for
from tests.journal_agent import Crasher
from tests.secured import suite_security
from tests.stack import FAST, loop_workflow, steps_by_id, unique
from tests.test_journal import NO_HEARTBEAT, journal_check, read_journal


class GatedTools:
    """Tools whose ``search`` waits for a gate, so a test can act mid-turn."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.starts: dict[str, int] = {}

    async def run(self, name: str, input: Any, key: str) -> Any:
        self.starts[name] = self.starts.get(name, 0) + 1
        self.entered.set()
        await self.gate.wait()
        return {"tool": name}


def user_messages(request: list[Any]) -> list[Any]:
    return [m["content"] for m in request if m.get("role") == "user"]


async def step_of(client: Client, run_id: str) -> pb.StepState:
    return steps_by_id(await client.get_run(run_id))["agent"]


async def waiting_for_input(client: Client, run_id: str) -> bool:
    step = await step_of(client, run_id)
    return step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input


async def test_steer_is_placed_at_the_next_turn_once(client: Client, engine: EngineServer) -> None:
    task, name = unique("steer"), unique("steerwf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel(
        [
            {"done": False, "tool": "search", "input": {"q": "db"}},
            {"done": True, "answer": "used staging"},
        ]
    )
    second_turn = asyncio.Event()

    async def gated_model(history: list[Any]) -> Any:
        if model.calls == 1:
            await second_turn.wait()  # hold the turn that placed the input
        return await model(history)

    tools = GatedTools()
    async with Worker(engine.target, handlers={task: make_agent_turn(gated_model, tools.run)}):
        run = await client.start_run(name, "migrate the db")
        await wait_for(tools.entered.is_set, timeout=20)
        steer = {"text": "use the staging database"}
        stored, created = await client.submit_input(run.run_id, "agent", "msg-42", steer)
        assert created and stored.status == ipb.STATUS_QUEUED
        tools.gate.set()
        placed = await client.get_input(run.run_id, "agent", "msg-42", wait=20)
        assert placed.status == ipb.STATUS_PLACED and placed.placed_iteration == 1
        second_turn.set()
        await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
        final = await client.get_input(run.run_id, "agent", "msg-42")
    assert final.status == ipb.STATUS_DONE
    assert user_messages(model.requests[1]) == ["migrate the db", steer]
    assert (await step_of(client, run.run_id)).output == b'"used staging"'
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == []
    await client.cancel_run(run.run_id)


async def test_follow_up_wakes_a_waiting_step_that_holds_no_task(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("follow"), unique("followwf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel([{"done": True, "answer": "first"}, {"done": True, "answer": "second"}])
    tools = GatedTools()
    async with Worker(engine.target, handlers={task: make_agent_turn(model, tools.run)}) as worker:
        run = await client.start_run(name, "hello")
        await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
        await wait_for(lambda: worker.in_flight == 0, timeout=10)

        # The task is released after the commit is answered (its settle
        # follows), so its ack may still be on its way when the run shows
        # waiting; then no task is pending or held.
        async def holds_no_task() -> bool:
            info = await engine.nc.jetstream().consumer_info("TASKS", task_consumer(task))
            return info.num_pending == 0 and info.num_ack_pending == 0

        await wait_for(holds_no_task, timeout=10, message="no task while waiting")
        loop = asyncio.get_running_loop()
        sent = loop.time()
        await client.submit_input(
            run.run_id, "agent", "more", {"text": "and tomorrow?"}, mode=InputMode.FOLLOW_UP
        )
        await wait_for(lambda: model.calls == 2, timeout=10)
        woke_after = loop.time() - sent
        await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
    assert woke_after < 1.0, f"the follow-up woke the step in {woke_after:.2f}s"
    assert user_messages(model.requests[1]) == ["hello", {"text": "and tomorrow?"}]
    assert (await step_of(client, run.run_id)).output == b'"second"'
    await client.cancel_run(run.run_id)


async def test_input_during_the_waiting_turn_is_not_lost(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("race"), unique("racewf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel([{"done": True, "answer": "first"}, {"done": True, "answer": "second"}])
    submitted = asyncio.Event()
    handler = make_agent_turn(model, GatedTools().run)

    async def turn(tc: TaskContext) -> None:
        if tc.iteration == 0:
            # The follow-up lands while the turn that will wait is running.
            await client.submit_input(
                tc.run_id, "agent", "early", {"text": "still there?"}, mode=InputMode.FOLLOW_UP
            )
            submitted.set()
        await handler(tc)

    async with Worker(engine.target, handlers={task: turn}):
        run = await client.start_run(name, "hi")
        await wait_for(lambda: model.calls == 2, timeout=20)
    assert user_messages(model.requests[1]) == ["hi", {"text": "still there?"}]
    assert (await client.get_input(run.run_id, "agent", "early")).status in (
        ipb.STATUS_PLACED,
        ipb.STATUS_DONE,
    )
    await client.cancel_run(run.run_id)


async def test_queued_inputs_end_unanswered_and_later_submissions_conflict(
    client: Client, engine: EngineServer
) -> None:
    from dagnats.sdk import Conflict

    task, name = unique("fin"), unique("finwf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name)  # no worker: the step stays at its first dispatch
    await client.submit_input(run.run_id, "agent", "late-1", {"t": 1})
    await client.cancel_run(run.run_id)

    async def unanswered() -> bool:
        got = await client.get_input(run.run_id, "agent", "late-1")
        return got.status == ipb.STATUS_UNANSWERED

    await wait_for(unanswered, timeout=10)
    try:
        await client.submit_input(run.run_id, "agent", "late-2", {"t": 2})
    except Conflict as err:
        assert "finished" in err.message
    else:
        raise AssertionError("a finished step takes no inputs")


async def test_crash_between_claiming_and_recording_an_input(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("icrash"), unique("icrashwf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel(
        [{"done": False, "tool": "search", "input": {}}, {"done": True, "answer": "ok"}]
    )
    tools = GatedTools()
    tools.gate.set()
    handler = make_agent_turn(model, tools.run)
    with Crasher("after_input_claimed") as crash:
        async with Worker(
            engine.target, handlers={task: handler}, poll_wait=1.0, heartbeat_interval=NO_HEARTBEAT
        ) as first:
            run = await client.start_run(name, "go")
            await client.submit_input(run.run_id, "agent", "s1", {"steer": 1})
            await wait_for(crash.hit.is_set, timeout=20)
            async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                await first.stop(grace=0)
                await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=30)
    records = await read_journal(engine, run.run_id)
    placed = [r for r in records if r.HasField("input_placed") and not r.input_placed.carried]
    assert [p.input_placed.request_id for p in placed] == ["s1"]
    steered = [req for req in model.requests if {"steer": 1} in user_messages(req)]
    assert steered, "the model saw the input"
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == []
    await client.cancel_run(run.run_id)


async def test_time_wait_survives_an_engine_restart(tmp_path: Path) -> None:
    # A nats-server of its own: the engine restarted is the deployment's one
    # replica, which owns every partition (the module's engine would share them).
    nats_server = await NatsServer.start(tmp_path, security=suite_security())
    engine = await start_engine(nats_server.url, config=FAST)
    task, name = unique("tw"), unique("twwf")
    turns: list[int] = []

    async def turn(tc: TaskContext) -> None:
        turns.append(tc.iteration)
        if tc.iteration == 0:
            await tc.continue_(delay=1.5, until_input=True)
        else:
            await tc.complete("woke")

    try:
        async with Client(engine.target) as c:
            await c.register_workflow(loop_workflow(name, task))
            async with Worker(engine.target, handlers={task: turn}, poll_wait=1.0):
                run = await c.start_run(name)
                await wait_for(lambda: waiting_for_input(c, run.run_id), timeout=10)
        await engine.stop()
        restarted = len(turns)
        engine = await start_engine(nats_server.url, config=FAST)
        async with Client(engine.target) as c:
            async with Worker(engine.target, handlers={task: turn}, poll_wait=1.0):
                done = await c.wait_for_run(run.run_id, timeout=30)
    finally:
        await engine.stop()
        await nats_server.stop()
    assert done.status == pb.RUN_STATUS_COMPLETED
    # A handler without a journal runs at least once a dispatch: a stall past
    # FAST's 2-s lease delivers iteration 0 again before its continue is
    # applied, and that second report is dropped. What the restart must not
    # do is start the step over: after it, only the woken iteration runs.
    assert set(turns) == {0, 1} and turns == sorted(turns)
    assert 0 not in turns[restarted:], turns


async def test_crash_after_recording_an_input_places_it_once(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("icrash2"), unique("icrash2wf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel([{"done": True, "answer": "ok"}])
    handler = make_agent_turn(model, GatedTools().run)
    with Crasher("after_inputs_placed") as crash:
        async with Worker(
            engine.target, handlers={task: handler}, poll_wait=1.0, heartbeat_interval=NO_HEARTBEAT
        ) as first:
            run = await client.start_run(name, "go")
            await client.submit_input(run.run_id, "agent", "s1", {"steer": 1})
            await wait_for(crash.hit.is_set, timeout=20)
            async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                await first.stop(grace=0)
                await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=30)
    records = await read_journal(engine, run.run_id)
    placed = [r.input_placed.request_id for r in records if r.HasField("input_placed")]
    assert placed == ["s1"], "the redelivery got the recorded input back, nothing new"
    assert model.calls == 1
    assert user_messages(model.requests[0]) == ["go", {"steer": 1}]
    assert list((await journal_check(engine, run.run_id)).violations) == []
    await client.cancel_run(run.run_id)


async def test_a_withdrawn_input_is_never_placed(client: Client, engine: EngineServer) -> None:
    task, name = unique("wd"), unique("wdwf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel(
        [{"done": False, "tool": "search", "input": {}}, {"done": True, "answer": "ok"}]
    )
    tools = GatedTools()
    async with Worker(engine.target, handlers={task: make_agent_turn(model, tools.run)}):
        run = await client.start_run(name, "go")
        await wait_for(tools.entered.is_set, timeout=20)
        await client.submit_input(run.run_id, "agent", "keep", {"n": 1})
        await client.submit_input(run.run_id, "agent", "drop", {"n": 2})
        withdrawn = await client.withdraw_input(run.run_id, "agent", "drop")
        assert withdrawn.status == ipb.STATUS_WITHDRAWN
        tools.gate.set()
        await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
    assert user_messages(model.requests[1]) == ["go", {"n": 1}]
    assert (await client.get_input(run.run_id, "agent", "drop")).status == ipb.STATUS_WITHDRAWN
    from dagnats.sdk import Conflict

    try:
        await client.withdraw_input(run.run_id, "agent", "keep")
    except Conflict as err:
        assert "placed" in err.message
    else:
        raise AssertionError("a placed input cannot be withdrawn")
    await client.cancel_run(run.run_id)


async def test_a_withdrawal_between_a_placements_read_and_its_claim_wins(
    client: Client, engine: EngineServer
) -> None:
    # The placement lists the step's inputs and sees "w" queued; the user
    # withdraws it before the placement claims it. The withdrawal was answered
    # `withdrawn`, so the placement's claim, made on the revision it read,
    # must lose: the input is never placed, recorded or shown to a turn.
    task, name = unique("wdrace"), unique("wdracewf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, "go")  # no worker: the test is the worker
    await client.submit_input(run.run_id, "agent", "w", {"n": 1})
    listed = InputStore.list
    withdrawn: list[ipb.Input] = []

    async def list_then_withdraw(self: InputStore, run_id: str, step_id: str) -> Any:
        found = await listed(self, run_id, step_id)
        if not withdrawn:
            withdrawn.append(await client.withdraw_input(run_id, step_id, "w"))
        return found

    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        claimed = await stub.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
        )
        with mock.patch.object(InputStore, "list", list_then_withdraw):
            placed = await stub.PlaceInputs(
                jpb.PlaceInputsRequest(token=claimed.claimed.token, position=0, mode=1)
            )
    assert [w.status for w in withdrawn] == [ipb.STATUS_WITHDRAWN]
    assert list(placed.inputs) == []
    records = await read_journal(engine, run.run_id)
    assert [r.input_placed.request_id for r in records if r.HasField("input_placed")] == []
    assert (await client.get_input(run.run_id, "agent", "w")).status == ipb.STATUS_WITHDRAWN
    await client.cancel_run(run.run_id)
