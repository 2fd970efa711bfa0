"""The engine recovers work that a crash or a stray acknowledgement stranded."""

from __future__ import annotations

import asyncio

from dagnats.core import jetstream as jsx
from dagnats.core import seam
from dagnats.core.partitions import TASK_GROUP
from dagnats.core.subjects import task_consumer
from dagnats.engine.server import EngineServer
from dagnats.engine.store import INDEX_THROUGH
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, TaskContext, Worker, run_output
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, steps_by_id, unique


async def counting_loop(tc: TaskContext) -> None:
    if tc.iteration == 2:
        await tc.complete(tc.iteration)
    else:
        await tc.continue_()


async def test_crash_between_saving_a_dispatch_and_publishing_it(engine: EngineServer) -> None:
    task, name = unique("outbox"), unique("outboxwf")
    crashes: list[str] = []
    in_iteration_1, release = asyncio.Event(), asyncio.Event()

    async def crash_once(point: str) -> None:
        # The engine dies right after saving the next dispatch: nothing after
        # this line runs, so the task is not published by this engine.
        if point == "after_dispatch_saved" and not crashes:
            crashes.append(point)
            raise RuntimeError("engine crashed after saving a dispatch")

    async def gated_loop(tc: TaskContext) -> None:
        # Iteration 1 waits for the hook, so the crash hits the dispatch of
        # iteration 2 whatever the machine's speed.
        if tc.iteration == 1:
            in_iteration_1.set()
            await release.wait()
        await counting_loop(tc)

    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(engine.target, handlers={task: gated_loop}, poll_wait=1.0):
            run = await client.start_run(name)
            await asyncio.wait_for(in_iteration_1.wait(), timeout=20)
            seam.install(crash_once)
            try:
                release.set()
                done = await client.wait_for_run(run.run_id, timeout=30)
            finally:
                seam.install(None)
    assert crashes == ["after_dispatch_saved"]
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == 2 and steps_by_id(done)["agent"].iterations == 2


async def lose_the_task(engine: EngineServer, task: str) -> None:
    """A stalled worker's late ack deletes the task from the work queue while
    the step is still at its dispatch (acks are not fenced); returns once the
    reconciler has dispatched it again."""
    await engine.engine.store.ensure_task_consumer(task, FAST.task_ack_wait)
    (msg,) = await jsx.pull_now(
        engine.nc, jsx.TASKS, task_consumer(task), 1, 10.0, priority=(TASK_GROUP, 0)
    )
    before = engine.engine.counters["redispatched"]
    await msg.ack_sync()
    await wait_for(lambda: engine.engine.counters["redispatched"] > before, timeout=20)


async def test_a_task_acknowledged_without_an_outcome_is_dispatched_again(
    engine: EngineServer,
) -> None:
    task, name = unique("lost"), unique("lostwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name)
        await lose_the_task(engine, task)
        async with Worker(engine.target, handlers={task: counting_loop}, poll_wait=1.0):
            done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert steps_by_id(done)["agent"].iterations == 2


async def test_the_reconciler_reads_running_runs_from_an_index_that_lets_finished_ones_go(
    engine: EngineServer,
) -> None:
    store = engine.engine.store
    task, name = unique("indexed"), unique("indexedwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name)  # no worker: it stays running

        async def entered() -> bool:
            return run.run_id in await store.active_run_ids()

        # Stored without an entry: the reconciler's next pass enters it.
        await wait_for(entered, timeout=20, message="a running run stays out of the index")
        await client.cancel_run(run.run_id)

        async def gone() -> bool:
            return run.run_id not in await store.active_run_ids()

        await wait_for(gone, timeout=20, message="a finished run stays in the index")
        assert (await client.get_run(run.run_id)).status == pb.RUN_STATUS_CANCELLED


async def test_a_run_out_of_an_index_with_no_mark_is_entered_and_recovered(
    engine: EngineServer,
) -> None:
    # A deployment whose index has no mark yet (new, or upgraded from a
    # release that indexed each run before storing it): the reconciler's
    # pass reads the whole runs bucket and enters its running runs. Then a
    # vanished task of such a run is dispatched again, as for any other.
    store = engine.engine.store
    task, name = unique("older"), unique("olderwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name)

        async def settled() -> bool:  # indexed, and written for the last time before the mark
            stored = await store.load_run(run.run_id)
            indexed = run.run_id in await store.active_run_ids()
            return indexed and stored is not None and not stored.record.outbox

        await wait_for(settled, timeout=20, message="the run was not indexed")
        await store.leave_active(run.run_id)
        await store.leave_active(INDEX_THROUGH)

        async def entered() -> bool:
            return run.run_id in await store.active_run_ids()

        await wait_for(entered, timeout=20, message="a run stays out of an index with no mark")
        await lose_the_task(engine, task)
        async with Worker(engine.target, handlers={task: counting_loop}, poll_wait=1.0):
            done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
