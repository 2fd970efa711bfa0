"""A conversation that grows 20 KB a turn for 1,000 turns: flat turns, and a
journal that stores what each turn adds (the state chain).

Run with ``make bench-state`` (also part of ``make bench``) or ``python -m
bench.bench_state [--turns N] [--turn-bytes B] [--form append|checkpoint]``.

One journaled loop on the in-process stack (engine, journal and worker in one
process, nats-server aside), one iteration a turn. Each turn appends one
message of ``--turn-bytes`` to the state (``tc.append_state``, or the whole
state again with ``tc.checkpoint`` for ``--form checkpoint``, which the SDK
diffs) and continues; the worker keeps its task, so the state stays in its
memory. Reported:

- the turn time (one iteration start to the next, seen by the handler) of the
  first and the last 100 turns, and their ratio;
- how long the final state takes to read back from the journal (what a
  claim after a crash costs: one snapshot and the deltas after it);
- the journal's bytes (the AGENT_JOURNAL stream's, one run on a fresh server)
  a turn, against what the turn added plus the snapshots' share (the bytes of
  the commits that store the whole state, spread over every turn).

Nothing here asserts on time; the numbers go to stdout and into ADR 67.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import nats

from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, JournalClient, TaskContext, Worker
from tests.stack import FAST, loop_workflow, unique

WINDOW = 100


async def bench(turns: int, turn_bytes: int, form: str) -> None:
    starts: list[float] = []
    history: list[str] = []

    async def handler(tc: TaskContext) -> None:
        starts.append(time.perf_counter())
        await tc.journal()
        state = await tc.load_checkpoint()
        n = len(state["messages"]) if state is not None else 0
        message = f"{n:08d}" + "x" * (turn_bytes - 8)
        if form == "append":
            await tc.append_state("messages", [message], turn=n + 1)
        else:
            history.append(message)
            await tc.checkpoint({"messages": history, "turn": n + 1})
        if n + 1 >= turns:
            await tc.complete({"turns": n + 1})
        else:
            await tc.continue_()

    with tempfile.TemporaryDirectory(prefix="dagnats-bench-state-") as store:
        server = await NatsServer.start(Path(store))
        engine = await start_engine(server.url, config=FAST)
        name, task = unique("bench-state"), unique("bench-state-task")
        try:
            async with (
                Client(engine.target) as client,
                Worker(engine.target, handlers={task: handler}, poll_wait=1.0),
            ):
                workflow = loop_workflow(name, task, max_iterations=turns + 1)
                await client.register_workflow(workflow)
                started = time.perf_counter()
                run = await client.start_run(name)
                done = await client.wait_for_run(run.run_id, timeout=3600)
                took = time.perf_counter() - started
                assert done.status == pb.RUN_STATUS_COMPLETED, done
                async with JournalClient(engine.target) as journal:
                    records = [r async for r in journal.read(run.run_id, "agent")]
                    read_from = time.perf_counter()
                    state = await journal.state(run.run_id, "agent")
                    rebuilt = time.perf_counter() - read_from
            nc = await nats.connect(server.url)
            info = await nc.jetstream().stream_info(jsx.JOURNAL)
            await nc.close()
        finally:
            await engine.stop()
            await server.stop()
    commits = [r.commit for r in records if r.HasField("commit")]
    snapshots = [c for c in commits if not c.HasField("state_delta")]
    snapshot_bytes = sum(len(c.state) for c in snapshots)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    first = statistics.mean(gaps[:WINDOW]) * 1e3
    last = statistics.mean(gaps[-WINDOW:]) * 1e3
    stored = int(info.state.bytes)
    added = turn_bytes + 4  # the message's quotes and comma, as JSON
    share = snapshot_bytes / turns
    print(f"{turns} turns of {turn_bytes:,} bytes ({form}): {took:.1f} s in all")
    print(f"  final state: {len(state or b''):,} bytes; {len(records):,} records")
    depth = commits[-1].state_delta.depth
    took_ms = rebuilt * 1e3
    print(f"  the final state read back (a snapshot and {depth} deltas): {took_ms:.0f} ms")
    print(f"  turn time, first {WINDOW}: {first:.2f} ms; last {WINDOW}: {last:.2f} ms")
    print(f"  last / first: {last / first:.2f}x")
    print(
        f"  journal: {stored:,} bytes, {stored / turns:,.0f} a turn; "
        f"{len(snapshots)} snapshots, {snapshot_bytes:,} bytes ({share:,.0f} a turn)"
    )
    ratio = stored / turns / (added + share)
    print(f"  stored a turn / (added {added:,} + snapshots' share): {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--turn-bytes", type=int, default=20_000)
    parser.add_argument("--form", choices=("append", "checkpoint"), default="append")
    args = parser.parse_args()
    asyncio.run(bench(args.turns, args.turn_bytes, args.form))


if __name__ == "__main__":
    main()
