"""The engine and the SDK together, over gRPC, on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from dagnats.core.errors import InvalidArgument, NotFound
from dagnats.core.subjects import history_subject
from dagnats.engine import model as m
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import StaleRevision
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.sdk import Client, TaskContext, Worker, run_output
from dagnats.sdk.testing import ScriptedModel
from tests.helpers import trailing, wait_for
from tests.stack import FAST, loop_workflow, spawn_worker, steps_by_id, unique


def scripted_agent(model: ScriptedModel, seen: Counter[int] | None = None) -> Any:
    """A tool-using agent: one model call per iteration, state in the checkpoint."""

    async def turn(tc: TaskContext) -> None:
        if seen is not None:
            seen[tc.iteration] += 1
        history = await tc.load_checkpoint() or []
        reply = await model(history)
        if "answer" in reply:
            await tc.complete(reply["answer"])
            return
        await tc.checkpoint([*history, reply])
        await tc.continue_({"tool": reply["tool"]})

    return turn


async def test_agent_loop_runs_to_the_scripted_answer(client: Client, engine: EngineServer) -> None:
    task, name = unique("agent"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    model = ScriptedModel([{"tool": "search"}, {"tool": "fetch"}, {"tool": "sum"}, {"answer": 42}])
    async with Worker(engine.target, handlers={task: scripted_agent(model)}, poll_wait=1.0):
        run = await client.start_run(name, {"question": "?"})
        run = await client.wait_for_run(run.run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == 42
    assert model.calls == 4
    assert model.requests[-1] == [{"tool": "search"}, {"tool": "fetch"}, {"tool": "sum"}]
    step = steps_by_id(run)["agent"]
    assert (step.iterations, step.iteration, step.attempt) == (3, 3, 1)


async def test_killed_worker_iteration_is_redelivered_and_counted_once(
    client: Client, engine: EngineServer, tmp_path: Path
) -> None:
    task, name = unique("crash"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    marker = tmp_path / "crashed"
    proc = spawn_worker(engine.target, task, crash_at=2, marker=marker)
    try:
        run = await client.start_run(name)
        await wait_for(marker.exists, timeout=30, message="worker never reached iteration 2")
    finally:
        proc.kill()
        proc.wait()
    assert marker.read_text() == "2 1"

    seen: Counter[int] = Counter()

    async def handler(tc: TaskContext) -> None:
        seen[tc.iteration] += 1
        if tc.iteration >= 4:
            await tc.complete({"iterations": tc.iteration})
        else:
            await tc.continue_({"iteration": tc.iteration})

    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
        done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == {"iterations": 4}
    assert seen == Counter({2: 1, 3: 1, 4: 1}), "the crashed iteration ran again, once"
    step = steps_by_id(done)["agent"]
    assert (step.iterations, step.iteration, step.attempt) == (4, 4, 1)


async def test_duplicate_and_stale_continues_are_dropped(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("dup"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    gate = asyncio.Event()
    reports: list[tuple[int, int]] = []

    async def handler(tc: TaskContext) -> None:
        reports.append((tc.iteration, tc.attempt))
        if tc.iteration == 1:
            await gate.wait()
            await tc.complete("done")
        else:
            await tc.continue_()

    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
        run = await client.start_run(name)
        await wait_for(lambda: (1, 1) in reports, timeout=20)
        dropped_before = engine.engine.counters["dropped"]
        js = engine.nc.jetstream()
        # The same continue again (a worker that crashed after reporting, seen
        # after the dedupe window) and a continue from an older attempt.
        for attempt, msg_id in ((1, "again"), (0, "stale")):
            event = ipb.HistoryEvent(run_id=run.run_id, step_id="agent", iteration=0)
            event.attempt = attempt if attempt else 7
            getattr(event, "continue").output = b"{}"
            await js.publish(
                history_subject(run.run_id),
                event.SerializeToString(),
                headers={"Nats-Msg-Id": msg_id},
            )
        await wait_for(lambda: engine.engine.counters["dropped"] >= dropped_before + 2, timeout=10)
        gate.set()
        done = await client.wait_for_run(run.run_id, timeout=20)
    step = steps_by_id(done)["agent"]
    assert done.status == pb.RUN_STATUS_COMPLETED
    assert step.iterations == 1, "the duplicates did not advance the loop"
    assert reports == [(0, 1), (1, 1)]


async def test_a_report_that_names_no_dispatch_is_refused_and_keeps_the_task(
    client: Client, engine: EngineServer
) -> None:
    # A worker on the raw stubs that leaves iteration and attempt unset: a
    # duplicate of such a report could advance the loop twice, so it is
    # refused at the edge, and the task stays the worker's to report again.
    task, name = unique("noid"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        wait = Duration()
        wait.FromMilliseconds(500)

        async def leased() -> pb.LeasedTask | None:
            got = await stub.PollTasks(
                pb.PollTasksRequest(task_types=[task], max_tasks=1, wait=wait)
            )
            return got.tasks[0] if got.tasks else None

        first = await wait_for(leased, timeout=20, message="the first task")
        bare = pb.ReportRequest(lease=first.lease, run_id=run.run_id, step_id="agent")
        getattr(bare, "continue").output = b"{}"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Report(bare)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert trailing(refused.value)["dagnats-error-field"] == "attempt"
        assert "iteration and attempt" in (refused.value.details() or "")
        bare.iteration, bare.attempt = first.task.iteration, first.task.attempt
        assert not (await stub.Report(bare)).stale, "the lease was still the worker's"
        second = await wait_for(leased, timeout=20, message="the next iteration's task")
    assert (second.task.iteration, second.task.attempt) == (1, 1)
    await client.cancel_run(run.run_id)


async def test_two_engines_run_twenty_loops(
    client: Client, engine: EngineServer, nats_server: Any
) -> None:
    second = await start_engine(nats_server.url, config=FAST)
    task, name = unique("pair"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    seen: Counter[tuple[str, int]] = Counter()

    async def handler(tc: TaskContext) -> None:
        seen[(tc.run_id, tc.iteration)] += 1
        if tc.iteration == 3:
            await tc.complete(tc.run_id)
        else:
            await tc.continue_()

    try:
        workers = [
            Worker(target, handlers={task: handler}, concurrency=8, poll_wait=1.0)
            for target in (engine.target, second.target)
        ]
        async with workers[0], workers[1]:
            runs = await asyncio.gather(*(client.start_run(name, i) for i in range(20)))
            done = await asyncio.gather(*(client.wait_for_run(r.run_id, timeout=60) for r in runs))
    finally:
        await second.stop()
    for run in done:
        assert run.status == pb.RUN_STATUS_COMPLETED, run.error
        assert run_output(run) == run.run_id
        assert steps_by_id(run)["agent"].iterations == 3
    assert len(seen) == 20 * 4
    assert max(seen.values()) == 1, "no iteration ran twice"


async def test_an_engine_whose_last_write_is_stale_applies_what_a_read_accepts(
    client: Client, engine: EngineServer, nats_server: Any
) -> None:
    """The engine decides on the run it wrote last without reading it (the guessed run).
    When another engine has moved the run on since, a report of the new
    dispatch would be dropped on that stale run: it must be decided again on
    the run as stored, and accepted."""
    second = await start_engine(nats_server.url, config=FAST)
    task, name = unique("guess"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    try:
        run = await client.start_run(name)  # written by the first engine, its last write
        ours, theirs = engine.engine, second.engine

        def report(iteration: int) -> m.StepReport:
            identity = m.Identity(iteration=iteration, attempt=1)
            return m.StepReport(step_id="agent", identity=identity, outcome=m.Continued())

        moved = await theirs.apply(run.run_id, report(0))  # the other engine moves it on
        assert moved is not None and isinstance(moved[1], m.Accepted)
        dropped = ours.counters["dropped"]
        applied = await ours.apply(run.run_id, report(1))  # a report of the new dispatch
        assert applied is not None and isinstance(applied[1], m.Accepted), applied
        assert ours.counters["dropped"] == dropped
        step = steps_by_id(await client.get_run(run.run_id))["agent"]
        assert (step.iteration, step.status) == (2, pb.STEP_STATUS_RUNNING)
        # And a report the run as stored does not accept is still dropped.
        stale = await ours.apply(run.run_id, report(0))
        assert stale is not None and isinstance(stale[1], m.Dropped)
        assert ours.counters["dropped"] == dropped + 1
    finally:
        await second.stop()
        await client.cancel_run(run.run_id)


@pytest.mark.parametrize("wait_kind", ["loop_delay", "retry_backoff"])
async def test_engine_restart_during_a_wait(
    client: Client, engine: EngineServer, nats_server: Any, wait_kind: str
) -> None:
    task, name = unique("restart"), unique("wf")
    step: dict[str, Any] = {
        "agent_loop": {"loop_delay": "1500ms"} if wait_kind == "loop_delay" else {},
        "retry": {"max_attempts": 3, "backoff": "fixed", "initial_delay": "1500ms"},
    }
    await client.register_workflow(loop_workflow(name, task, **step))
    standby = await start_engine(nats_server.url, config=FAST)
    attempts: list[tuple[int, int]] = []

    async def handler(tc: TaskContext) -> None:
        attempts.append((tc.iteration, tc.attempt))
        if tc.iteration == 1:
            await tc.complete("woke up")
        elif wait_kind == "retry_backoff" and tc.attempt == 1:
            await tc.fail("transient")
        else:
            await tc.continue_()

    try:
        async with Client(standby.target) as standby_client:
            async with Worker(standby.target, handlers={task: handler}, poll_wait=1.0):
                run = await standby_client.start_run(name)

                async def waiting() -> bool:
                    current = await standby_client.get_run(run.run_id)
                    return steps_by_id(current)["agent"].status == pb.STEP_STATUS_WAITING

                await wait_for(waiting, timeout=10, message="step never entered its wait")
                await standby.stop()  # the engine holding the wait goes away...
                standby = await start_engine(nats_server.url, config=FAST)  # ...a new one comes
            async with Client(standby.target) as fresh:
                async with Worker(standby.target, handlers={task: handler}, poll_wait=1.0):
                    done = await fresh.wait_for_run(run.run_id, timeout=30)
    finally:
        await standby.stop()
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == "woke up"
    expected = [(0, 1), (1, 1)] if wait_kind == "loop_delay" else [(0, 1), (0, 2), (1, 1)]
    assert attempts == expected


async def test_cancel_reaches_the_running_handler_and_children(
    client: Client, engine: EngineServer
) -> None:
    task, child_task = unique("cancel"), unique("child")
    parent_name, child_name = unique("parent"), unique("childwf")
    await client.register_workflow(loop_workflow(child_name, child_task))
    await client.register_workflow(
        {
            "name": parent_name,
            "steps": [
                {"id": "agent", "type": "agent_loop", "task": task},
                {"id": "helper", "type": "sub_workflow", "workflow": child_name},
            ],
        }
    )
    started: dict[str, float] = {}
    cancelled_at: dict[str, float] = {}

    async def long_turn(tc: TaskContext) -> None:
        started[tc.run_id] = time.monotonic()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled_at[tc.run_id] = time.monotonic()
            raise

    handlers = {task: long_turn, child_task: long_turn}
    async with Worker(
        engine.target, handlers=handlers, heartbeat_interval=0.2, poll_wait=1.0
    ) as worker:
        run = await client.start_run(parent_name)

        async def child_started() -> str | None:
            current = await client.get_run(run.run_id)
            child = steps_by_id(current)["helper"].child_run_id
            return child if child and child in started and run.run_id in started else None

        child_id = await wait_for(child_started, timeout=20)
        asked = time.monotonic()
        await client.cancel_run(run.run_id, "operator stop")
        await wait_for(lambda: len(cancelled_at) == 2, timeout=10, message="handlers not cancelled")
        child = await client.wait_for_run(child_id, timeout=10)
        await wait_for(lambda: worker.in_flight == 0, timeout=10)
    for run_id in (run.run_id, child_id):
        assert cancelled_at[run_id] - asked < 2 * 0.2 + 0.3, "cancelled within two heartbeats"
    assert child.status == pb.RUN_STATUS_CANCELLED
    parent = await client.get_run(run.run_id)
    assert parent.status == pb.RUN_STATUS_CANCELLED and parent.error == "operator stop"
    assert {s.status for s in parent.steps} == {pb.STEP_STATUS_CANCELLED}

    dropped = engine.engine.counters["dropped"]
    event = ipb.HistoryEvent(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
    event.complete.output = b'"late"'
    await engine.nc.jetstream().publish(
        history_subject(run.run_id), event.SerializeToString(), headers={"Nats-Msg-Id": "late"}
    )
    await wait_for(lambda: engine.engine.counters["dropped"] > dropped, timeout=10)
    assert (await client.get_run(run.run_id)).status == pb.RUN_STATUS_CANCELLED


async def test_checkpoint_larger_than_the_cap_is_refused(
    client: Client, engine: EngineServer
) -> None:
    task, name = unique("big"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    errors: list[BaseException] = []

    async def handler(tc: TaskContext) -> None:
        try:
            await tc.checkpoint("x" * (FAST.loop_state_max_bytes + 1))
        except InvalidArgument as err:
            errors.append(err)
        await tc.complete("ok")

    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
        run = await client.start_run(name)
        await client.wait_for_run(run.run_id, timeout=20)
    assert len(errors) == 1 and "loop_state_max_bytes" in str(errors[0])


@pytest.mark.parametrize(
    ("steps", "needle", "field"),
    [
        (
            [
                {"id": "a", "task": "t", "depends_on": ["b"]},
                {"id": "b", "task": "t", "depends_on": ["a"]},
            ],
            "cycle",
            "depends_on",
        ),
        ([{"id": "a", "task": "t", "depends_on": ["ghost"]}], "ghost", "depends_on"),
        ([{"id": "a.b", "task": "t"}], "a.b", "id"),
        ([{"id": "a", "task": "t", "colour": "red"}], "colour", "steps[0]"),
    ],
)
async def test_bad_definitions_are_rejected_by_name(
    client: Client, steps: list[dict[str, Any]], needle: str, field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await client.register_workflow({"name": unique("bad"), "steps": steps})
    assert needle in caught.value.message
    assert field in (caught.value.field or "")


async def test_unknown_and_malformed_runs(client: Client) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        await client.get_run("0" * 32)
    with pytest.raises(InvalidArgument) as caught:
        await client.get_run("run.>")
    assert caught.value.field == "run_id"
    with pytest.raises(NotFound, match="not registered"):
        await client.start_run(unique("nowhere"))


async def test_idempotent_start_returns_the_first_run(client: Client) -> None:
    name = unique("idem")
    await client.register_workflow(loop_workflow(name, unique("idle")))
    first, *repeats = await asyncio.gather(
        *(client.start_run(name, {"n": i}, idempotency_key="order-7") for i in range(5))
    )
    assert {r.run_id for r in repeats} == {first.run_id}
    assert json.loads((await client.get_run(first.run_id)).input) in [{"n": i} for i in range(5)]
    cancelled = await client.cancel_run(first.run_id)
    assert cancelled.status == pb.RUN_STATUS_CANCELLED
    await client.purge_run(first.run_id)
    with pytest.raises(NotFound):
        await client.get_run(first.run_id)


async def test_runs_being_written_are_still_listed(engine: EngineServer) -> None:
    # A listing must hold every run that existed when it began, even while the
    # engine rewrites runs: a KV watcher can end its initial values early while
    # keys change, and a run went missing from `dagnats run list` that way.
    store = engine.engine.store
    task, name = unique("listed"), unique("listedwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        started = {(await client.start_run(name)).run_id for _ in range(20)}
        writing = True

        async def rewrite() -> None:
            while writing:  # the same records again and again, each a new revision
                for run_id in started:
                    stored = await store.require_run(run_id)
                    # The reconciler writes too: it clears each run's outbox.
                    with contextlib.suppress(StaleRevision):
                        await store.update_run(stored.record, stored.revision)

        writer = asyncio.create_task(rewrite())
        try:
            for _ in range(30):
                listed = {r.run_id for r in await client.list_runs(workflow=name)}
                assert listed == started
        finally:
            writing = False
            await writer
        for run_id in started:
            await client.cancel_run(run_id)
