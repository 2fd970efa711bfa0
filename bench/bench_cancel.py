"""How soon a handler hears that its run was cancelled.

Run with ``make bench`` or ``python -m bench.bench_cancel [--cancels N]``.

A journaled handler is inside an unsafe tool call when its run is cancelled
with ``Client.cancel_run``; measured is the time from the call to the moment
the handler's task is cancelled (its ``CancelledError``), and from
``cancel_run``'s return to it. Two workers take turns, ``--cancels`` runs
each, so both see the machine in the same state:

- gRPC: its journal calls and its polls (the watch among them) on gRPC;
- socket: on the services' local socket (ADRs 45, 49).

The lease is a minute, so heartbeats are 20 s apart: what is measured is
the watching poll (ADR 54), not a heartbeat. Everything runs in one process
and one event loop, nats-server aside. Nothing here asserts on time; the
numbers go to stdout and into ADR 54.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from tests.stack import FAST, loop_workflow, socket_dir, unique

CONFIG = dataclasses.replace(FAST, task_ack_wait=60.0)


class Agent:
    """A handler that waits inside an unsafe tool until it is cancelled."""

    def __init__(self) -> None:
        self.inside: dict[str, asyncio.Event] = {}
        self.stopped: dict[str, float] = {}

    async def wait(self, run: ToolRun) -> Any:
        self.inside[run.call.key.split(".")[0]].set()
        await asyncio.Event().wait()

    async def handler(self, tc: TaskContext) -> None:
        self.inside.setdefault(tc.run_id, asyncio.Event())
        try:
            j = await tc.journal()
            await j.tool(ToolCall(name="wait", input={}), Replay.UNSAFE, self.wait)
        except asyncio.CancelledError:
            self.stopped[tc.run_id] = time.perf_counter()
            raise


async def one_cancel(client: Client, workflow: str, agent: Agent) -> tuple[float, float]:
    """Seconds from cancel_run called, and from its return, to the handler stopped."""
    run = await client.start_run(workflow)
    inside = agent.inside.setdefault(run.run_id, asyncio.Event())
    await asyncio.wait_for(inside.wait(), 30)
    asked = time.perf_counter()
    await client.cancel_run(run.run_id, "bench")
    returned = time.perf_counter()
    while run.run_id not in agent.stopped:
        if time.perf_counter() - asked > 30:
            raise TimeoutError(f"run {run.run_id}: the handler never heard the cancel")
        await asyncio.sleep(0.001)  # the wait being measured; 1 ms resolution
    stopped = agent.stopped[run.run_id]
    return stopped - asked, stopped - returned


async def bench(cancels: int) -> dict[str, list[tuple[float, float]]]:
    kinds = ("gRPC", "socket")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="dagnats-bench-cancel-") as store, socket_dir() as d:
        server = await NatsServer.start(Path(store))
        engine = await start_engine(server.url, config=CONFIG, local_socket=d / "j.sock")
        try:
            async with Client(engine.target) as client:
                workers = {k: await _worker(client, engine, k) for k in kinds}
                try:
                    for name, agent, _ in workers.values():
                        await one_cancel(client, name, agent)  # warm the path, untimed
                    for _ in range(cancels):
                        for kind in kinds:
                            name, agent, _ = workers[kind]
                            results[kind].append(await one_cancel(client, name, agent))
                finally:
                    for _, _, worker in workers.values():
                        await worker.stop(grace=1.0)
        finally:
            await engine.stop()
            await server.stop()
    return results


async def _worker(client: Client, engine: EngineServer, kind: str) -> tuple[str, Agent, Worker]:
    name, task = unique("bench-cancel"), unique("bench-cancel-task")
    await client.register_workflow(loop_workflow(name, task))
    agent = Agent()
    assert engine.local_socket is not None
    socket = str(engine.local_socket.path) if kind == "socket" else "off"
    worker = Worker(
        engine.target,
        handlers={task: agent.handler},
        poll_wait=5.0,
        local_socket=socket,
        concurrency=4,
    )
    await worker.__aenter__()
    return name, agent, worker


def _ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:7.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cancels", type=int, default=50)
    args = parser.parse_args()
    results = asyncio.run(bench(args.cancels))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"cancel -> handler cancelled, {args.cancels} cancels each (load average {load})")
    print(f"{'worker':8} {'from':8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'mean ms':>8}")
    for kind, pairs in results.items():
        called, returned = [a for a, _ in pairs], [r for _, r in pairs]
        for label, values in (("called", called), ("returned", returned)):
            print(
                f"{kind:8} {label:8} {_ms(values, 0.5)} {_ms(values, 0.99)} "
                f"{max(values) * 1000:7.1f} {statistics.mean(values) * 1000:8.1f}"
            )


if __name__ == "__main__":
    main()
