"""Parallel tool calls: five 200 ms tools asked for in one model response,
run as one parallel group (``j.tools``) and, in the same run, one at a time
(``j.tool``, five positions).

Run with ``python -m bench.bench_parallel``. A nats-server (``sync_interval:
always``), the engine with the journal service, and a worker in this
process on gRPC. One ``agent_loop`` run of ``2 * BENCH_ROUNDS`` iterations;
each iteration asks the model (answered at once) for five ``sleep`` calls of
``BENCH_TOOL_MS`` (200) ms, safe, and runs them: the even iterations as one
group, the odd ones one at a time, so both see the machine alike. A round is
timed from just before the tools are called to just after their results are
back (every intent and result stored); the iteration, from the handler's
first line to its commit answered. Prints the median and p90 of each after
``BENCH_WARMUP`` (2) warm-up rounds of each. Nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import start_engine
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from tests.stack import FAST, loop_workflow, unique

CALLS = 5


def knob(name: str, default: int) -> int:
    return max(1, int(os.environ.get(name, default)))


async def main() -> None:
    rounds, warmup = knob("BENCH_ROUNDS", 10), knob("BENCH_WARMUP", 2)
    tool_seconds = knob("BENCH_TOOL_MS", 200) / 1000
    timed: dict[str, list[float]] = {"parallel": [], "sequential": []}
    turns: dict[str, list[float]] = {"parallel": [], "sequential": []}

    async def sleep(run: ToolRun) -> Any:
        await asyncio.sleep(tool_seconds)  # the tool's own latency, not a fence
        return {"slept": run.call.input["n"]}

    async def handler(tc: TaskContext) -> None:
        began = time.perf_counter()
        j = await tc.journal()
        reply = await j.model(lambda: _reply(tc.iteration, rounds + warmup))
        if reply is None:
            await tc.complete("done")
            return
        mode = "parallel" if tc.iteration % 2 == 0 else "sequential"
        calls = [(ToolCall(name="sleep", input={"n": n}), Replay.SAFE, sleep) for n in reply]
        started = time.perf_counter()
        if mode == "parallel":
            results = await j.tools(calls)
        else:
            results = [await j.tool(call, replay, fn) for call, replay, fn in calls]
        took = time.perf_counter() - started
        assert [r.output for r in results] == [{"slept": n} for n in reply]
        await tc.continue_()
        if tc.iteration // 2 >= warmup:
            timed[mode].append(took)
            turns[mode].append(time.perf_counter() - began)

    with tempfile.TemporaryDirectory(prefix="dagnats-bench-parallel-") as tmp:
        nats = await NatsServer.start(Path(tmp) / "nats")
        engine = await start_engine(nats.url, config=FAST)
        try:
            async with (
                Client(engine.target) as client,
                Worker(
                    engine.target,
                    handlers={"bench-parallel": handler},
                    poll_wait=1.0,
                    local_socket="off",
                ),
            ):
                name = unique("bench-parallel")
                iterations = 2 * (rounds + warmup) + 1
                workflow = loop_workflow(name, "bench-parallel", max_iterations=iterations)
                await client.register_workflow(workflow)
                run = await client.start_run(name, {})
                await client.wait_for_run(run.run_id, timeout=600)
        finally:
            await engine.stop()
            await nats.stop()
    print(f"five {tool_seconds * 1000:.0f} ms tools in one response, {rounds} rounds each")
    for mode in ("parallel", "sequential"):
        print(
            f"{mode:>10}: round median {_ms(statistics.median(timed[mode]))}, "
            f"p90 {_ms(_p90(timed[mode]))}; iteration median "
            f"{_ms(statistics.median(turns[mode]))}"
        )


async def _reply(iteration: int, rounds: int) -> list[int] | None:
    """The model: five calls, until every round of both kinds ran."""
    return list(range(CALLS)) if iteration < 2 * rounds else None


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


if __name__ == "__main__":
    asyncio.run(main())
