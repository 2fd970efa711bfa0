"""A run parked for input leaves the active-run index, so the reconciler's
pass does not read it (ADR 32); the pass after the write that wakes it enters
it again."""

from __future__ import annotations

import asyncio
from typing import Any

from dagnats.core import seam
from dagnats.core.subjects import is_task_subject
from dagnats.engine.processor import Engine
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, TaskContext, Worker
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, steps_by_id, unique


async def wait_then_answer(tc: TaskContext) -> None:
    if tc.iteration == 0:
        await tc.continue_(until_input=True)
    else:
        await tc.complete("woken")


async def parked(engine: EngineServer, run_ids: list[str]) -> None:
    """Wait until every run waits for input with its outbox cleared, out of the index."""
    store = engine.engine.store

    async def out() -> bool:
        indexed = set(await store.active_run_ids())
        for run_id in run_ids:
            stored = await store.load_run(run_id)
            if run_id in indexed or stored is None or stored.record.outbox:
                return False
            step = steps_by_id(stored.record.run)["agent"]
            assert step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input
        return True

    await wait_for(out, timeout=30, message="a run waiting for input stays in the index")


async def test_a_run_waiting_for_input_leaves_the_index_and_an_input_wakes_it(
    engine: EngineServer,
) -> None:
    task, name = unique("parked"), unique("parkedwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(engine.target, handlers={task: wait_then_answer}, poll_wait=1.0):
            run = await client.start_run(name)
            await parked(engine, [run.run_id])
            await client.submit_input(run.run_id, "agent", "wake", {"hi": 1})
            done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert steps_by_id(done)["agent"].iteration == 1

    async def gone() -> bool:
        return run.run_id not in await engine.engine.store.active_run_ids()

    await wait_for(gone, timeout=20, message="a finished run stays in the index")


def finished_by_a_reconciler(engines: tuple[Engine, ...]) -> int:
    return sum(e.counters["outbox_recovered"] + e.counters["history_recovered"] for e in engines)


async def test_a_wake_stopped_after_its_write_is_entered_and_finished_by_the_reconciler(
    engine: EngineServer, nats_server: Any
) -> None:
    # A second engine shares the history consumer: the one whose wake stops
    # after its run write, before publishing the task, stays stopped there
    # while the other takes the run's later events.
    other = await start_engine(nats_server.url, config=FAST)
    engines = (engine.engine, other.engine)
    store = engine.engine.store
    task, name = unique("wake"), unique("wakewf")
    run_id = ""
    at_seam: list[StoredRun | None] = []
    stopped, release = asyncio.Event(), asyncio.Event()

    async def stop_the_wake(point: str) -> None:
        if point != "after_dispatch_saved" or at_seam:
            return
        at_seam.append(await store.load_run(run_id))
        stopped.set()
        await release.wait()

    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
            async with Worker(engine.target, handlers={task: wait_then_answer}, poll_wait=1.0):
                run_id = (await client.start_run(name)).run_id
                await parked(engine, [run_id])
                recovered = finished_by_a_reconciler(engines)
                seam.install(stop_the_wake)
                await client.submit_input(run_id, "agent", "wake", {"hi": 1})
                await asyncio.wait_for(stopped.wait(), timeout=30)
                (stored,) = at_seam
                # Stored with no entry in the index, its task not published.
                assert stored is not None and not stored.record.unindexed
                assert stored.record.parked_entry > 0, "the wake's write names no park"
                assert [e.subject for e in stored.record.outbox if is_task_subject(e.subject)]
                done = await client.wait_for_run(run_id, timeout=30)
        assert done.status == pb.RUN_STATUS_COMPLETED, done.error
        assert steps_by_id(done)["agent"].iteration == 1
        # Finished while the wake's engine stays stopped: a reconciler pass
        # entered the run, then published its outbox, or applied the input
        # event the stopped engine holds (and published the outbox it found).
        assert not release.is_set()
        assert finished_by_a_reconciler(engines) > recovered
    finally:
        release.set()
        seam.install(None)
        await other.stop()


async def test_a_reconcile_pass_reads_no_parked_run(engine: EngineServer) -> None:
    task, name = unique("many-parked"), unique("manyparkedwf")
    reconciler = engine.engine
    store = reconciler.store
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(
            engine.target, handlers={task: wait_then_answer}, concurrency=8, poll_wait=1.0
        ):
            run_ids = [(await client.start_run(name)).run_id for _ in range(20)]
            await parked(engine, run_ids)
            read: list[str] = []
            load_run = store.load_run

            async def counted(run_id: str) -> StoredRun | None:
                read.append(run_id)
                return await load_run(run_id)

            store.load_run = counted  # type: ignore[method-assign]
            try:
                before = reconciler.counters["reconcile_reads"]
                await reconciler.reconcile()
                reads = reconciler.counters["reconcile_reads"] - before
            finally:
                del store.load_run
            assert not set(read) & set(run_ids), "a parked run was read"
            assert reads < len(run_ids)
            for run_id in run_ids[:3]:
                await client.submit_input(run_id, "agent", "wake", {"hi": 1})
            for run_id in run_ids[:3]:
                done = await client.wait_for_run(run_id, timeout=30)
                assert done.status == pb.RUN_STATUS_COMPLETED, done.error
