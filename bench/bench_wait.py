"""How soon a client learns that a run ended: a K=1 run, start to result seen.

Run with ``make bench`` (after the other benches) or ``python -m
bench.bench_wait [--runs N]``.

A one-iteration run whose handler completes at once, ``--runs`` times each
way, the two ways taking turns so both see the machine in the same state:

- ``wait_for_run``: the SDK's wait, on ``WatchRun`` (the engine pushes the
  run's end);
- polling: ``GetRun`` every 100 ms until the run has ended, which is what
  ``wait_for_run`` did before ``WatchRun``.

Reported: start to result seen by the client, and the part of it after the
run's end was stored (the run's ``finished_at`` to the moment the client had
it; one clock, one process). Everything runs in one process and one event
loop, nats-server aside. Nothing here asserts on time; the numbers go to
stdout and into ADR 16.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, TaskContext, Worker
from tests.stack import FAST, loop_workflow, unique

POLL = 0.1  # the interval of the old wait_for_run
Wait = Callable[[Client, str], Awaitable[pb.Run]]


async def by_watch(client: Client, run_id: str) -> pb.Run:
    return await client.wait_for_run(run_id, timeout=60)


async def by_polling(client: Client, run_id: str) -> pb.Run:
    while True:
        run = await client.get_run(run_id)
        if run.status != pb.RUN_STATUS_RUNNING:
            return run
        await asyncio.sleep(POLL)  # the polling being measured


async def complete(tc: TaskContext) -> None:
    await tc.complete({"done": True})


async def one_run(client: Client, workflow: str, wait: Wait) -> tuple[float, float]:
    """Seconds from start to result seen, and from the stored end to seen."""
    started = time.perf_counter()
    run = await client.start_run(workflow)
    done = await wait(client, run.run_id)
    seen_at, elapsed = time.time(), time.perf_counter() - started
    assert done.status == pb.RUN_STATUS_COMPLETED, done
    return elapsed, seen_at - done.finished_at.ToNanoseconds() / 1e9


async def bench(runs: int) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {"wait_for_run (WatchRun)": [], "polling": []}
    with tempfile.TemporaryDirectory(prefix="dagnats-bench-wait-") as store:
        server = await NatsServer.start(Path(store))
        engine = await start_engine(server.url, config=FAST)
        name, task = unique("bench-wait"), unique("bench-wait-task")
        try:
            async with (
                Client(engine.target) as client,
                Worker(engine.target, handlers={task: complete}, poll_wait=1.0),
            ):
                await client.register_workflow(loop_workflow(name, task, max_iterations=1))
                for _ in range(3):  # warm every path, untimed
                    await one_run(client, name, by_watch)
                    await one_run(client, name, by_polling)
                for _ in range(runs):
                    results["wait_for_run (WatchRun)"].append(await one_run(client, name, by_watch))
                    results["polling"].append(await one_run(client, name, by_polling))
        finally:
            await engine.stop()
            await server.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_wait", description=__doc__)
    parser.add_argument("--runs", type=int, default=50, help="timed runs of each way")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2")
    results = asyncio.run(bench(args.runs))
    print(f"a K=1 run, start to result seen by the client ({args.runs} runs each way)")
    print(f"{'':28} {'start->seen median':>19} {'p90':>9} {'end->seen median':>17} {'p90':>9}")
    for label, samples in results.items():
        totals = sorted(s[0] for s in samples)
        after = sorted(s[1] for s in samples)
        p90 = int(0.9 * len(samples))
        print(
            f"{label:28} {statistics.median(totals) * 1000:17.1f}ms "
            f"{totals[p90] * 1000:7.1f}ms {statistics.median(after) * 1000:15.1f}ms "
            f"{after[p90] * 1000:7.1f}ms"
        )


if __name__ == "__main__":
    main()
