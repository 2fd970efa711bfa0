"""Retention counts from a run's end, and every input ends in a status a
client sees: a run waiting past the retention wakes with its state, an ended
run is purged once its retention is over (across an engine restart too), a
queued input older than the dedupe window ends ``expired``, and an input
placed into an iteration that never committed ends ``dropped``.

Each test starts its own engine on the module's nats-server with the periods
set to seconds, and stops it before the next starts: the purge timers are
taken by whichever engine runs, so a test that stops its engine knows that
no other one took them meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from nats.js.api import StreamConfig

from dagnats.core import jetstream as jsx
from dagnats.core.errors import Conflict, InvalidArgument, NotFound
from dagnats.core.natsserver import NatsServer, free_port
from dagnats.core.subjects import history_subject, purge_timer_subject, run_timers
from dagnats.engine.config import EngineConfig
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as eipb
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.inputs.rules import InputState, Mode, Status
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.inputs.v1 import inputs_pb2_grpc as ipb_grpc
from dagnats.sdk import Client, InputMode, TaskContext, Worker
from dagnats.sdk.testing import ScriptedModel
from examples.agent_turn.handler import make_agent_turn
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, steps_by_id, unique
from tests.test_journal import journal_check, read_journal

# No test here waits for the default periods: they are days.
RETENTION = 2.0


@contextlib.asynccontextmanager
async def engine_with(
    nats_server: NatsServer,
    *,
    run_retention: float = FAST.run_retention,
    input_dedupe_window: float = FAST.input_dedupe_window,
) -> AsyncIterator[EngineServer]:
    """An engine (with the journal and inputs services) with these periods,
    stopped on the way out."""
    config = dataclasses.replace(
        FAST, run_retention=run_retention, input_dedupe_window=input_dedupe_window
    )
    server = await start_engine(nats_server.url, config=config)
    try:
        yield server
    finally:
        await server.stop()


async def gone(client: Client, run_id: str) -> bool:
    try:
        await client.get_run(run_id)
    except NotFound:
        return True
    return False


async def journal_gone(engine: EngineServer, run_id: str) -> bool:
    """Whether the journal's read API answers that the run has no journal."""
    try:
        await read_journal(engine, run_id)
    except grpc.aio.AioRpcError as err:
        return err.code() == grpc.StatusCode.NOT_FOUND
    return False


async def waiting_for_input(client: Client, run_id: str) -> bool:
    step = steps_by_id(await client.get_run(run_id))["agent"]
    return bool(step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input)


async def input_status(client: Client, run_id: str, request_id: str) -> ipb.Input:
    return await client.get_input(run_id, "agent", request_id)


async def purge_timer_stored(server: EngineServer, run_id: str) -> bool:
    info = await server.nc.jetstream().stream_info(
        jsx.TIMERS, subjects_filter=purge_timer_subject(run_id)
    )
    return bool(info.state.subjects)


async def ended_and_cancelled(client: Client) -> str:
    """A run cancelled at once (an ended run), of a workflow of its own whose
    tasks no worker takes."""
    name = unique("endedwf")
    await client.register_workflow(loop_workflow(name, unique("nobody")))
    run = await client.start_run(name, "ended")
    await client.cancel_run(run.run_id)
    return run.run_id


# ---- a wait past the retention keeps its state; an ended run is purged ------------------


async def test_a_wait_past_the_retention_keeps_its_state_and_the_ended_run_is_purged(
    nats_server: NatsServer,
) -> None:
    async with (
        engine_with(nats_server, run_retention=RETENTION) as engine,
        Client(engine.target) as client,
    ):
        task, name = unique("kept"), unique("keptwf")
        await client.register_workflow(loop_workflow(name, task))
        model = ScriptedModel(
            [{"done": True, "answer": "first"}, {"done": True, "answer": "second"}]
        )

        async def search(name: str, input: Any, key: str) -> Any:
            return {"tool": name}

        async with Worker(engine.target, handlers={task: make_agent_turn(model, search)}):
            run = await client.start_run(name, "hello")
            await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
            before = await read_journal(engine, run.run_id)
            # A run that ends now, while the other waits: once it is purged,
            # the wait has lasted longer than the retention.
            ended = await ended_and_cancelled(client)
            await wait_for(lambda: gone(client, ended), timeout=30, message="ended run purged")
            assert await waiting_for_input(client, run.run_id)
            assert [r.seq for r in await read_journal(engine, run.run_id)] == [
                r.seq for r in before
            ], "the waiting run's journal is whole"
            await client.submit_input(
                run.run_id, "agent", "more", {"text": "and then?"}, mode=InputMode.FOLLOW_UP
            )
            await wait_for(lambda: model.calls == 2, timeout=20)
            await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
        # The second turn went on from the checkpoint: the first answer is in
        # its history, not a conversation started over from the run's input.
        second = [m for m in model.requests[1] if m.get("role") in ("user", "assistant")]
        assert [m["content"] for m in second if m["role"] == "user"] == [
            "hello",
            {"text": "and then?"},
        ]
        assert any(m["role"] == "assistant" for m in second), second
        assert steps_by_id(await client.get_run(run.run_id))["agent"].output == b'"second"'
        assert list((await journal_check(engine, run.run_id)).violations) == []
        assert (await input_status(client, run.run_id, "more")).status == ipb.STATUS_DONE

        # Ended, it is purged once its retention is over: the run, its
        # journal and its inputs.
        await client.cancel_run(run.run_id)
        await wait_for(lambda: gone(client, run.run_id), timeout=30, message="run purged")
        assert await journal_gone(engine, run.run_id)
        with pytest.raises(NotFound):
            await input_status(client, run.run_id, "more")
        js = engine.nc.jetstream()
        for stream, subject in (
            (jsx.JOURNAL, f"journal.{run.run_id}.>"),
            (jsx.HISTORY, history_subject(run.run_id)),
            (f"KV_{jsx.KV_INPUTS}", f"$KV.{jsx.KV_INPUTS}.{run.run_id}.>"),
            (jsx.TIMERS, run_timers(run.run_id)),
        ):
            info = await js.stream_info(stream, subjects_filter=subject)
            assert not info.state.subjects, f"{stream} holds nothing of the purged run"


async def test_an_ended_run_is_purged_by_the_engine_that_starts_after_a_restart(
    nats_server: NatsServer,
) -> None:
    retention = 8.0  # long enough for the first engine to stop well before it
    async with (
        engine_with(nats_server, run_retention=retention) as first,
        Client(first.target) as client,
    ):
        run_id = await ended_and_cancelled(client)
        await wait_for(lambda: purge_timer_stored(first, run_id), timeout=10)
        ended = await client.get_run(run_id)
    assert ended.status == pb.RUN_STATUS_CANCELLED
    ended_at = ended.finished_at.ToNanoseconds() / 1e9
    assert time.time() < ended_at + retention, "the first engine stopped before the purge was due"
    async with engine_with(nats_server, run_retention=retention) as second:
        async with Client(second.target) as client:
            assert not await gone(client, run_id), "nothing purged it while no engine ran"
            await wait_for(lambda: gone(client, run_id), timeout=30, message="purged after restart")
        assert time.time() >= ended_at + retention, "not purged before its retention was over"
        assert await journal_gone(second, run_id)
        assert not await purge_timer_stored(second, run_id), "the timer was taken"


async def test_a_purge_timer_never_purges_a_running_run(nats_server: NatsServer) -> None:
    """The purge-only-after-end guard: a purge timer for a run that is
    running (none is ever set, but one may be forged or misrouted) leaves the
    run, its journal and its inputs as they are."""
    async with (
        engine_with(nats_server, run_retention=RETENTION) as engine,
        Client(engine.target) as client,
    ):
        task, name = unique("live"), unique("livewf")
        await client.register_workflow(loop_workflow(name, task))
        model = ScriptedModel([{"done": True, "answer": "first"}])

        async def search(name: str, input: Any, key: str) -> Any:
            return {"tool": name}

        async with Worker(engine.target, handlers={task: make_agent_turn(model, search)}):
            run = await client.start_run(name, "hello")
            await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
        await client.submit_input(run.run_id, "agent", "steer", {"text": "x"})
        records = [r.seq for r in await read_journal(engine, run.run_id)]
        forged = eipb.Timer(run_id=run.run_id, kind=eipb.TIMER_KIND_PURGE)
        forged.due.GetCurrentTime()
        js = engine.nc.jetstream()
        await js.publish(purge_timer_subject(run.run_id), forged.SerializeToString())
        await wait_for(lambda: purge_timer_stored(engine, run.run_id), timeout=5)
        # The engine takes the timer, and acknowledges it once decided.
        await wait_for(
            lambda: _not(purge_timer_stored(engine, run.run_id)), timeout=20, message="timer taken"
        )
        assert (await client.get_run(run.run_id)).status == pb.RUN_STATUS_RUNNING
        assert [r.seq for r in await read_journal(engine, run.run_id)] == records
        assert (await input_status(client, run.run_id, "steer")).status == ipb.STATUS_QUEUED
        with pytest.raises(Conflict):
            await client.purge_run(run.run_id)  # asked for: refused, with the reason
        await client.cancel_run(run.run_id)
        await wait_for(lambda: gone(client, run.run_id), timeout=30, message="purged once ended")


async def _not(check: Any) -> bool:
    return not await check


# ---- an old queued input is accounted for ---------------------------------------------


async def test_a_queued_input_older_than_the_dedupe_window_ends_expired(
    nats_server: NatsServer,
) -> None:
    window = 1.5
    async with (
        engine_with(nats_server, input_dedupe_window=window) as engine,
        Client(engine.target) as client,
    ):
        task, name = unique("old"), unique("oldwf")
        await client.register_workflow(loop_workflow(name, task))
        placed: list[list[str]] = []
        woken = asyncio.Event()

        async def turn(tc: TaskContext) -> None:
            await tc.journal()
            if tc.iteration == 0:
                # Waits for a time only: nothing places the step's inputs meanwhile.
                await tc.continue_(delay=3 * window)
                return
            placed.append([p.request_id for p in await tc.place_inputs(InputMode.STEER)])
            woken.set()
            await tc.complete("done")

        async with Worker(engine.target, handlers={task: turn}):
            run = await client.start_run(name, "go")

            async def waiting() -> bool:
                step = steps_by_id(await client.get_run(run.run_id))["agent"]
                return bool(step.status == pb.STEP_STATUS_WAITING)

            await wait_for(waiting, timeout=20)
            stored, created = await client.submit_input(run.run_id, "agent", "old", {"t": 1})
            assert created and stored.status == ipb.STATUS_QUEUED
            # A wait on it ends when it expires: no write tells the watch.
            seen = await client.get_input(
                run.run_id, "agent", "old", wait=30, if_status=ipb.STATUS_QUEUED
            )
            assert seen.status == ipb.STATUS_EXPIRED
            assert seen.reason == (
                f"queued for longer than the dedupe window ({window:g} s) without being placed"
            )
            await wait_for(woken.is_set, timeout=30, message="the step woke")
            await client.wait_for_run(run.run_id, timeout=20)
        assert placed == [[]], "an expired input is never placed"
        # Stored so by the placement that met it, and a repeat returns it.
        assert await stored_as(engine, run.run_id, "old", Status.EXPIRED)
        repeat, created = await client.submit_input(run.run_id, "agent", "old", {"t": 1})
        assert not created and repeat.status == ipb.STATUS_EXPIRED
        with pytest.raises(Conflict, match="expired"):
            await client.withdraw_input(run.run_id, "agent", "old")


# ---- an input placed into an iteration that never committed ends dropped ------------------


def _failing_workflow(name: str, task: str) -> dict[str, Any]:
    retry = {"max_attempts": 2, "backoff": "fixed", "initial_delay": 0.1}
    return loop_workflow(name, task, retry=retry)


async def test_an_input_placed_into_an_iteration_that_fails_ends_dropped(
    nats_server: NatsServer,
) -> None:
    async with engine_with(nats_server) as engine, Client(engine.target) as client:
        task, name = unique("drop"), unique("dropwf")
        await client.register_workflow(_failing_workflow(name, task))
        carried: list[list[str]] = []
        between = asyncio.Event()
        go_on = asyncio.Event()

        async def turn(tc: TaskContext) -> None:
            await tc.journal()
            if tc.iteration == 0:
                await tc.continue_(until_input=True)
                return
            carried.append([p.request_id for p in await tc.place_inputs(InputMode.STEER)])
            if tc.attempt == 1:
                await tc.fail("the model timed out")  # retriable: attempt 2 follows
                between.set()
                return
            await go_on.wait()
            await tc.fail_permanent("the tool refused")

        async with Worker(engine.target, handlers={task: turn}):
            run = await client.start_run(name, "go")
            await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
            await client.submit_input(run.run_id, "agent", "msg", {"text": "steer"})
            await wait_for(between.is_set, timeout=20)
            # The step may still retry the iteration that placed it: placed.
            assert (await input_status(client, run.run_id, "msg")).status == ipb.STATUS_PLACED
            await wait_for(lambda: len(carried) == 2, timeout=20, message="the retry ran")
            go_on.set()
            ended = await client.get_input(
                run.run_id, "agent", "msg", wait=30, if_status=ipb.STATUS_PLACED
            )
            finished = await client.wait_for_run(run.run_id, timeout=20)
        assert carried == [["msg"], ["msg"]], "the retry carried the input the first attempt placed"
        assert finished.status == pb.RUN_STATUS_FAILED
        assert ended.status == ipb.STATUS_DROPPED
        assert (
            ended.reason == "placed into iteration 1, which never committed: the step failed first"
        )
        # Stored so by the engine's close at the step's end, not only shown.
        await wait_for(lambda: stored_as(engine, run.run_id, "msg", Status.DROPPED), timeout=10)


async def test_an_input_placed_by_a_turn_the_cancel_cut_short_ends_dropped(
    nats_server: NatsServer,
) -> None:
    async with engine_with(nats_server) as engine, Client(engine.target) as client:
        task, name = unique("cut"), unique("cutwf")
        await client.register_workflow(loop_workflow(name, task))
        placing = asyncio.Event()

        async def turn(tc: TaskContext) -> None:
            await tc.journal()
            if tc.iteration == 0:
                await tc.continue_(until_input=True)
                return
            await tc.place_inputs(InputMode.STEER)
            placing.set()
            await tc.cancellation.wait()  # the turn never commits

        async with Worker(engine.target, handlers={task: turn}):
            run = await client.start_run(name, "go")
            await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
            await client.submit_input(run.run_id, "agent", "msg", {"text": "steer"})
            await wait_for(placing.is_set, timeout=20)
            assert (await input_status(client, run.run_id, "msg")).status == ipb.STATUS_PLACED
            await client.cancel_run(run.run_id)
            ended = await client.get_input(
                run.run_id, "agent", "msg", wait=30, if_status=ipb.STATUS_PLACED
            )
        assert ended.status == ipb.STATUS_DROPPED
        assert ended.reason == (
            "placed into iteration 1, which never committed: the step was cancelled first"
        )
        async with grpc.aio.insecure_channel(engine.target) as channel:
            listed = await ipb_grpc.InputsServiceStub(channel).List(
                ipb.ListRequest(run_id=run.run_id, step_id="agent", status=ipb.STATUS_DROPPED)
            )
        assert [i.request_id for i in listed.inputs] == ["msg"]
        # The REST API answers the same, with the reason.
        gateway = await start_gateway(GatewayConfig(engine_target=engine.target, port=0))
        try:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http:
                answer = await http.get(f"/runs/{run.run_id}/steps/agent/inputs/msg")
        finally:
            await gateway.stop()
        assert answer.status_code == 200
        assert (answer.json()["status"], answer.json()["reason"]) == ("dropped", ended.reason)
        await wait_for(lambda: stored_as(engine, run.run_id, "msg", Status.DROPPED), timeout=10)


async def stored_as(
    engine: EngineServer, run_id: str, request_id: str, want: Status, step_id: str = "agent"
) -> bool:
    """Whether the input is stored with status ``want`` (read from the
    bucket, not as a client sees it)."""
    inputs = engine.engine.inputs
    assert inputs is not None
    stored = await inputs.get(run_id, step_id, request_id)
    return stored is not None and stored[0].status is want


async def test_a_close_event_of_an_earlier_release_reads_the_run_to_end_its_inputs(
    nats_server: NatsServer,
) -> None:
    """An event stored by a release whose close carried no step status (still
    on the history at the upgrade) ends the inputs by the run as stored."""
    async with engine_with(nats_server) as engine, Client(engine.target) as client:
        name = unique("legacywf")
        await client.register_workflow(loop_workflow(name, unique("nobody")))
        run = await client.start_run(name, "go")
        await client.cancel_run(run.run_id)
        inputs = engine.engine.inputs
        assert inputs is not None
        # Placed into iteration 0, which never committed, and not closed yet.
        left = InputState(
            run_id=run.run_id,
            step_id="agent",
            request_id="left",
            mode=Mode.STEER,
            content=b"{}",
            status=Status.PLACED,
            created_at=time.time(),
            placed_iteration=0,
            placed_attempt=1,
            placed_by="w" * 16,
            created_by="n" * 16,
        )
        await inputs.create(left)
        legacy = eipb.HistoryEvent(
            run_id=run.run_id, step_id="agent", inputs=eipb.StepInputs(close=True)
        )
        await engine.engine.store.publish_event(legacy, unique("legacy-close"))
        await wait_for(lambda: stored_as(engine, run.run_id, "left", Status.DROPPED), timeout=10)
        shown = await input_status(client, run.run_id, "left")
        assert shown.reason == (
            "placed into iteration 0, which never committed: the step was cancelled first"
        )


async def test_an_input_of_a_step_that_never_started_ends_unanswered_with_its_run(
    nats_server: NatsServer,
) -> None:
    async with engine_with(nats_server) as engine, Client(engine.target) as client:
        name, task = unique("pendingwf"), unique("nobody")
        steps = [
            {"id": "first", "type": "task", "task": task},
            {"id": "later", "type": "task", "task": task, "depends_on": ["first"]},
        ]
        await client.register_workflow({"name": name, "steps": steps})
        run = await client.start_run(name, "go")
        queued, _ = await client.submit_input(run.run_id, "later", "early", {"t": 1})
        assert queued.status == ipb.STATUS_QUEUED
        await client.cancel_run(run.run_id)
        ended = await client.get_input(
            run.run_id, "later", "early", wait=30, if_status=ipb.STATUS_QUEUED
        )
        assert ended.status == ipb.STATUS_UNANSWERED
        await wait_for(
            lambda: stored_as(engine, run.run_id, "early", Status.UNANSWERED, "later"),
            timeout=10,
        )


# ---- existing deployments and settings ----------------------------------------------------


async def test_provisioning_removes_the_age_limits_an_earlier_release_set(
    nats_server: NatsServer,
) -> None:
    """A deployment made by a release whose journal and history expired after
    30 days and whose inputs and run keys had TTLs is brought to the new
    configuration by the next start's provisioning."""
    async with engine_with(nats_server) as engine:
        js = engine.nc.jetstream()
        day = 24 * 3600.0
        earlier = {
            jsx.JOURNAL: 30 * day,
            jsx.HISTORY: 30 * day,
            f"KV_{jsx.KV_INPUTS}": 7 * day,
            f"KV_{jsx.KV_RUN_KEYS}": 30 * day,
        }
        for stream, age in earlier.items():
            config: StreamConfig = (await js.stream_info(stream)).config
            config.max_age = age
            await js.update_stream(config)
        await jsx.provision(js)
        for stream in earlier:
            assert not (await js.stream_info(stream)).config.max_age, stream
        for stream in (jsx.TASKS, jsx.TIMERS, f"KV_{jsx.KV_RUNS}", f"KV_{jsx.KV_CHECKPOINTS}"):
            assert not (await js.stream_info(stream)).config.max_age, stream


def test_the_periods_are_settings_and_a_bad_one_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DAGNATS_RUN_RETENTION", "90")
    monkeypatch.setenv("DAGNATS_INPUT_DEDUPE_WINDOW", "60")
    config = EngineConfig.from_env()
    assert (config.run_retention, config.input_dedupe_window) == (90.0, 60.0)
    monkeypatch.setenv("DAGNATS_RUN_RETENTION", "0")
    with pytest.raises(InvalidArgument, match="DAGNATS_RUN_RETENTION must be a positive"):
        EngineConfig.from_env()
    env = {**os.environ, "DAGNATS_INPUT_DEDUPE_WINDOW": "a week"}
    env.pop("DAGNATS_RUN_RETENTION")
    refused = subprocess.run(
        [sys.executable, "-m", "dagnats.cli.main", "serve", "engine", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        "error: DAGNATS_INPUT_DEDUPE_WINDOW must be a positive number of seconds, got 'a week'"
    ]
