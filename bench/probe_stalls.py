"""Rounds of runs on replicas that come and go, and what holds a slow round.

Run with ``python -m bench.probe_stalls [server|cluster]``. Replicas (``dagnats
serve all`` and a worker each, as ``make bench-replicas`` deploys them) with
``BENCH_PARTITIONS`` (6) partitions run ``BENCH_ROUNDS`` (60) rounds of
``BENCH_C`` (20) runs of ``BENCH_K`` (50) iterations; every third round a
replica is added, or stopped (SIGTERM) when there are two. A round that takes
longer than ``SLOW`` seconds prints the task consumers holding
unacknowledged deliveries and the runs still going: a task delivered to no
one waits out its lease (``DAGNATS_TASK_ACK_WAIT``, 30 s by default) before
it is delivered again. The last line counts the slow rounds. Nothing here
asserts; the replicas' logs (``BENCH_VERBOSE=1`` logs every lease) are kept
in the directory it names.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import bench_replicas as br
from bench import bench_turn as bt

SLOW = 8.0


async def held(nc: Any, client: Any, going: dict[str, float]) -> None:
    js = nc.jetstream()
    for ci in await js.consumers_info("TASKS"):
        if ci.num_ack_pending or ci.num_pending:
            print(
                f"  {ci.name}: pending {ci.num_pending}, unacknowledged {ci.num_ack_pending}, "
                f"redelivered {ci.num_redelivered}, pulls waiting {ci.num_waiting}",
                flush=True,
            )
    for run_id in list(going)[:5]:
        run = await client.get_run(run_id)
        steps = [(s.step_id, s.status, s.iterations) for s in run.steps]
        print(f"  run {run_id}: status {run.status}, steps {steps}", flush=True)


async def one_run(client: Any, k: int, going: dict[str, float]) -> None:
    """A run of ``k`` iterations, in ``going`` until it ends."""
    run = await client.start_run(bt.TASK, {"k": k})
    going[run.run_id] = time.monotonic()
    await client.wait_for_run(run.run_id, timeout=300)
    going.pop(run.run_id)


async def probe(topology: str) -> int:
    import nats

    from dagnats.sdk import Client

    env = os.environ
    k = br.Knobs(
        partitions=bt.knob(env, "BENCH_PARTITIONS", 6, 1, 64),
        c=bt.knob(env, "BENCH_C", 20, 1),
        k=bt.knob(env, "BENCH_K", 50, 1),
    )
    rounds = bt.knob(env, "BENCH_ROUNDS", 60, 1)
    data = Path(tempfile.mkdtemp(prefix="dagnats-probe-stalls-"))
    logs = data / "logs"
    logs.mkdir()
    servers = await br.start_servers(topology, data)
    d = br.Deployment(servers, br.replica_env(servers, k), k, logs, model_ms=0)
    slow = 0
    nc = await nats.connect(servers.url.split(","))
    d.add()
    await br.register(d.replicas[0].served.target)
    clients = [Client(d.replicas[0].served.target)]
    try:
        for n in range(rounds):
            if n % 3 == 2:
                for client in clients:
                    await client.close()
                if len(d.replicas) == 1:
                    d.add()
                else:
                    d.replicas.pop().stop()
                await br.settled(nc.jetstream(), d.names(), k.partitions)
                clients = [Client(r.served.target) for r in d.replicas]
            going: dict[str, float] = {}

            t0 = time.monotonic()
            runs = [
                asyncio.create_task(one_run(clients[i % len(clients)], k.k, going))
                for i in range(k.c)
            ]
            told = False
            while not all(r.done() for r in runs):
                await asyncio.sleep(0.25)  # the round's progress, polled
                if not told and time.monotonic() - t0 > SLOW:
                    told = True
                    slow += 1
                    print(f"round {n + 1}: {len(going)} runs going after {SLOW:.0f}s", flush=True)
                    await held(nc, clients[0], going)
            for r in runs:
                r.result()
            took = time.monotonic() - t0
            print(f"round {n + 1}: {took:.1f}s, {len(d.replicas)} replicas", flush=True)
    finally:
        await nc.close()
        for client in clients:
            await client.close()
        d.stop()
        await servers.stop()
    print(f"slow rounds: {slow} of {rounds}; logs in {logs}")
    return slow


if __name__ == "__main__":
    asyncio.run(probe(sys.argv[1] if len(sys.argv) > 1 else "server"))
