"""Many steps waiting for input at once hold no worker and no task; an input
still wakes any one of them."""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any

import pytest

from dagnats.core.subjects import task_consumer
from dagnats.engine.config import EngineConfig
from dagnats.engine.server import start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, TaskContext, Worker
from tests.helpers import wait_for
from tests.stack import loop_workflow, steps_by_id, unique

# 2,000 in the suite; `make test-chaos` runs 10,000 (about two minutes).
RUNS = int(os.environ.get("DAGNATS_TEST_WAITS", "2000"))


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_thousands_of_waits_hold_no_worker_and_no_task(nats_server: Any) -> None:
    # The reconciler scans every run; at this many runs it runs rarely.
    config = EngineConfig(task_ack_wait=30.0, reconcile_interval=120.0)
    engine = await start_engine(nats_server.url, config=config)
    task, name = unique("many"), unique("manywf")
    waited = 0
    answered: set[str] = set()

    async def turn(tc: TaskContext) -> None:
        nonlocal waited
        if tc.iteration == 0:
            await tc.continue_(until_input=True)
            waited += 1
        else:
            answered.add(tc.run_id)
            await tc.complete("woken")

    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
            async with Worker(
                engine.target, handlers={task: turn}, concurrency=64, poll_wait=1.0
            ) as worker:
                gate = asyncio.Semaphore(64)

                async def start(i: int) -> str:
                    async with gate:
                        return (await client.start_run(name, i)).run_id

                run_ids = await asyncio.gather(*(start(i) for i in range(RUNS)))
                await wait_for(lambda: waited == RUNS, timeout=480, interval=0.5)
                await wait_for(lambda: worker.in_flight == 0, timeout=30)
                info = await engine.nc.jetstream().consumer_info("TASKS", task_consumer(task))
                assert (info.num_pending, info.num_ack_pending) == (0, 0), "no task in flight"
                sample = run_ids[:: max(1, RUNS // 50)]

                async def waits(run_id: str) -> bool:
                    step = steps_by_id(await client.get_run(run_id))["agent"]
                    return step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input

                # A report is answered once its event is stored; the engine
                # applies it after: each sampled step waits within a deadline.
                for run_id in sample:
                    await wait_for(
                        functools.partial(waits, run_id), timeout=60, message=f"{run_id} waits"
                    )
                woken = sample[:5]
                for run_id in woken:
                    await client.submit_input(run_id, "agent", "ping", {"hi": 1})
                await wait_for(lambda: answered == set(woken), timeout=60)
    finally:
        await engine.stop()
