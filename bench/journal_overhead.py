"""Per-iteration journal overhead of a journaled agent, against a raw JetStream floor.

Run with ``make bench`` or ``python -m bench.journal_overhead [--iterations N]``.

One scripted agent turn per iteration (claim, model, one unsafe tool, commit),
with a model and a tool that return at once and are timed apart. The journal
overhead of an iteration is the wall time from just before ``tc.journal()`` to
just after ``tc.continue_()`` returns, minus the time inside the model and the
tool functions. ``continue_()`` is the commit: the journal service answers once
it is stored, then publishes its lifecycle event and releases the task (ADR 9),
so no engine report follows. The window thus holds the floor's own operations:
the tail read before the model call and five fenced appends. The claim appends
after the commit it stored last instead of reading the tail; a claim whose
guess misses reads it as well.

The floor is what the same journal writes cost when done directly with nats-py
on the same server, in the same process: one tail read plus as many fenced
appends as an iteration makes, with payloads the size of the real records.
Machines are noisy, so the result is a ratio against that floor, measured in
the same run and paired with the agent: one floor round just before each timed
iteration, so both see the machine in the same state. Nothing here asserts on
time.

Everything runs in one process and one event loop (nats-server aside): the
engine, the journal service, the worker and the floor's client. A last, untimed
run taps every subject to count what one iteration sends to nats-server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import platform
import secrets
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.engine.config import EngineConfig
from dagnats.engine.server import start_engine
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from tests.stack import loop_workflow, unique

TARGET = 2.5  # the bound: journal overhead at most 2.5x the floor
APPENDS = 5  # fenced appends per iteration: claim, model, tool intent, tool result, commit
STALL = 0.5  # seconds between a commit and the next task that count as a stall
# Long leases keep heartbeats (a tail read and an RPC each) out of the timed turns.
# A short history ack wait bounds the stall when the engine drops a fetched
# history event (it is redelivered after this wait); stalls are counted apart.
CONFIG = EngineConfig(task_ack_wait=60.0, history_ack_wait=2.0, reconcile_interval=30.0)


# ---- the agent ------------------------------------------------------------------------


@dataclass
class Turn:
    """The timestamps and durations of one iteration, in seconds (perf_counter)."""

    iteration: int
    received: float = 0.0  # the handler was invoked
    floor: float = 0.0  # a floor round, run first
    start: float = 0.0  # just before tc.journal()
    claim: float = 0.0
    model: float = 0.0  # inside the model function
    tool: float = 0.0  # inside the tool function
    model_call: float = 0.0  # j.model() as a whole
    tool_call: float = 0.0  # j.tool() as a whole
    commit: float = 0.0  # continue_(): the commit, answered once stored
    end: float = 0.0  # continue_() returned

    @property
    def overhead(self) -> float:
        return self.end - self.start - self.model - self.tool


@dataclass
class Probe:
    """A journaled handler that times itself; the last iteration completes."""

    iterations: int
    floor: Floor | None = None
    turns: list[Turn] = field(default_factory=list)

    async def handle(self, tc: TaskContext) -> None:
        turn = Turn(iteration=tc.iteration, received=time.perf_counter())
        if self.floor is not None:
            turn.floor = await self.floor.round()
        turn.start = time.perf_counter()
        j = await tc.journal()
        turn.claim = time.perf_counter() - turn.start
        started = time.perf_counter()
        reply = await j.model(_timed(_model, turn, "model"))
        turn.model_call = time.perf_counter() - started
        started = time.perf_counter()
        call = ToolCall(name=reply["tool"], input=reply["input"])
        result = await j.tool(call, Replay.UNSAFE, _timed(_send, turn, "tool"))
        turn.tool_call = time.perf_counter() - started
        await tc.checkpoint({"iteration": tc.iteration, "last": result.output})
        started = time.perf_counter()
        if tc.iteration + 1 < self.iterations:
            await tc.continue_()
        else:
            await tc.complete("done")
        turn.end = time.perf_counter()
        turn.commit = turn.end - started
        self.turns.append(turn)


async def _model() -> dict[str, Any]:
    return {"tool": "send", "input": {"to": "ops", "body": "status report"}}


async def _send(run: ToolRun) -> dict[str, Any]:
    return {"sent": True, "key": run.call.key}


def _timed(fn: Callable[..., Awaitable[Any]], turn: Turn, name: str) -> Callable[..., Any]:
    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            setattr(turn, name, getattr(turn, name) + time.perf_counter() - started)

    return timed


async def run_agent(target: str, iterations: int, floor: Floor | None = None) -> tuple[Probe, str]:
    """One run of ``iterations`` iterations on one worker, each after a round of
    ``floor`` if given; returns the probe and the run id."""
    task, name = unique("bench"), unique("bench-wf")
    probe = Probe(iterations, floor)
    async with Client(target) as client:
        await client.register_workflow(loop_workflow(name, task, max_iterations=iterations + 1))
        # One slot: polls then ask for one task, as a sequential agent loop needs.
        async with Worker(target, handlers={task: probe.handle}, poll_wait=1.0, concurrency=1):
            run = await client.start_run(name, {"ask": "bench"})
            done = await client.wait_for_run(run.run_id, timeout=60 + iterations)
    if len(probe.turns) != iterations:
        raise SystemExit(f"run ended {done.status} after {len(probe.turns)} iterations: {done}")
    return probe, run.run_id


# ---- the floor -------------------------------------------------------------------------


async def record_sizes(js: JetStreamContext, run_id: str, limit: int = 100) -> list[int]:
    """Payload sizes of the first ``limit`` journal records of the run's agent step."""
    subject, seq, sizes = f"journal.{run_id}.agent", 1, list[int]()
    while len(sizes) < limit:
        try:
            msg = await js.get_msg(jsx.JOURNAL, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            break
        sizes.append(len(msg.data or b""))
        seq = int(msg.seq or 0) + 1
    return sizes


@dataclass
class Floor:
    """Rounds of one tail read and APPENDS fenced appends, on a subject of its own."""

    js: JetStreamContext
    data: bytes
    subject: str = field(default_factory=lambda: f"journal.{secrets.token_hex(16)}.bench")
    opened: bool = False

    async def round(self) -> float:
        """One round; returns its wall time."""
        if not self.opened:
            await self.js.publish(self.subject, self.data, headers=_fence(0))
            self.opened = True
        started = time.perf_counter()
        last = int((await self.js.get_last_msg(jsx.JOURNAL, self.subject)).seq or 0)
        for _ in range(APPENDS):
            ack = await self.js.publish(self.subject, self.data, headers=_fence(last))
            last = int(ack.seq)
        return time.perf_counter() - started


def _fence(last: int) -> dict[str, str]:
    return {
        "Nats-Expected-Last-Subject-Sequence": str(last),
        "Nats-Msg-Id": secrets.token_hex(16),
    }


# ---- traffic and logs ------------------------------------------------------------------


def kind_of(subject: str, reply: str) -> str | None:
    """What a message a client sent to nats-server is, by subject; None for
    replies, consumer deliveries and the server's own advisories."""
    if reply.startswith("$JS.ACK."):
        return None  # a pull consumer delivering a stored message
    match subject.split("."):
        case ["_INBOX", *_] | ["$JS", "EVENT", *_]:
            return None
        case ["$JS", "API", "STREAM", "MSG", "GET", stream]:
            return f"read  {stream} (msg get)"
        case ["$JS", "API", "DIRECT", "GET", stream, *_]:
            return f"read  {stream} (direct get)"
        case ["$JS", "API", "CONSUMER", "MSG", "NEXT", stream, *_]:
            return f"pull  {stream}"
        case ["$JS", "API", *rest]:
            return "api   " + ".".join(rest[:2])
        case ["$JS", "ACK", stream, *_]:
            return f"ack   {stream}"
        case ["$KV", bucket, *_]:
            return f"write KV {bucket}"
        case [prefix, *_]:
            return f"write {prefix}.>"
    return None


async def traffic(nc: NATS, work: Awaitable[Any]) -> tuple[Any, Counter[str]]:
    """Count every message clients send to nats-server while ``work`` runs."""
    seen: Counter[str] = Counter()

    async def tap(msg: Msg) -> None:
        if (kind := kind_of(msg.subject, msg.reply)) is not None:
            seen[kind] += 1

    sub = await nc.subscribe(">", cb=tap)
    try:
        result = await work
        await nc.flush()
    finally:
        await sub.unsubscribe()
    return result, seen


class LogTally(logging.Handler):
    """Counts warnings and errors by message, so the report stays readable."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        cause = f" ({type(exc).__name__})" if exc is not None else ""
        self.seen[f"{record.levelname} {record.name}: {record.getMessage()}{cause}"] += 1


# ---- the report ------------------------------------------------------------------------


def ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(rows: list[tuple[str, list[float]]], base_ms: float) -> None:
    print(f"{'':48} {'median':>9} {'p90':>9} {'x floor':>8}")
    for label, samples in rows:
        median = 1000 * statistics.median(samples)
        print(f"{label:48} {median:7.2f}ms {ms(samples, 0.9):7.2f}ms {median / base_ms:7.2f}x")


def report(turns: list[Turn], floors: list[float]) -> None:
    # Both leave out the floor round each handler runs first.
    gaps = [b.received - a.end for a, b in itertools.pairwise(turns)]
    periods = [b.received - a.received - a.floor for a, b in itertools.pairwise(turns)]
    base = 1000 * statistics.median(floors)
    table(
        [
            (f"floor: 1 tail read + {APPENDS} fenced appends, nats-py", floors),
            ("journal overhead per iteration (claim..commit)", [t.overhead for t in turns]),
            ("  claim           Claim", [t.claim for t in turns]),
            ("  model           BeginModel + RecordModel", [t.model_call - t.model for t in turns]),
            ("  tool            BeginTool + FinishTool", [t.tool_call - t.tool for t in turns]),
            ("  commit          Commit (its event follows)", [t.commit for t in turns]),
            ("reference: commit -> next task received", gaps),
            ("reference: full period, task -> next task", periods),
        ],
        base,
    )
    stalls = [g for g in gaps if g > STALL]
    if stalls:
        print(
            f"{len(stalls)} of {len(gaps)} iterations waited over {STALL}s for the next task "
            f"(longest {max(stalls):.2f}s); medians are unaffected, the run time is not"
        )
    overhead = 1000 * statistics.median(t.overhead for t in turns)
    ratio = overhead / base
    verdict = "within" if ratio <= TARGET else "ABOVE"
    print(
        f"\nfloor {base:.2f}ms, journal overhead {overhead:.2f}ms: "
        f"ratio {ratio:.2f}x, {verdict} the {TARGET}x target"
    )


def print_traffic(seen: Counter[str], iterations: int) -> None:
    print(f"\nmessages sent to nats-server per iteration (untimed run of {iterations}):")
    for kind, count in sorted(seen.items()):
        print(f"  {kind:44} {count / iterations:6.2f}")
    print(f"  {'all':44} {sum(seen.values()) / iterations:6.2f}   (floor: 1 read + {APPENDS})")


def print_facts(facts: dict[str, str]) -> None:
    for key, value in facts.items():
        print(f"{key:>12}: {value}")
    print()


# ---- main ------------------------------------------------------------------------------


@dataclass
class Results:
    turns: list[Turn] = field(default_factory=list)
    floors: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)


async def bench(iterations: int, warmup: int) -> Results:
    with tempfile.TemporaryDirectory(prefix="dagnats-bench-") as store:
        server = await NatsServer.start(Path(store))
        try:
            nc = await jsx.connect(server.url, name="bench")
            try:
                return await _measure(server.url, nc, iterations, warmup)
            finally:
                await nc.close()
        finally:
            await server.stop()


async def _measure(url: str, nc: NATS, iterations: int, warmup: int) -> Results:
    results = Results()
    engine = await start_engine(url, config=CONFIG)
    try:
        js = nc.jetstream()
        await jsx.provision(js)
        # A short run, not timed, warms every code path and gives the record size.
        _, warm_run = await run_agent(engine.target, warmup)
        results.sizes = await record_sizes(js, warm_run)
        floor = Floor(js, os.urandom(round(statistics.mean(results.sizes))))
        for _ in range(warmup):
            await floor.round()
        probe, _ = await run_agent(engine.target, iterations, floor)
        results.turns = probe.turns
        results.floors = [t.floor for t in probe.turns]
        _, results.seen = await traffic(nc, run_agent(engine.target, warmup))
    finally:
        await engine.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.journal_overhead", description=__doc__)
    parser.add_argument("--iterations", type=int, default=200, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=20, help="iterations of each untimed run")
    args = parser.parse_args(argv)
    if args.iterations < 2 or args.warmup < 1:
        parser.error("--iterations must be at least 2 and --warmup at least 1")
    tally = LogTally()
    logging.basicConfig(level=logging.WARNING, handlers=[tally], force=True)
    started = time.perf_counter()
    results = asyncio.run(bench(args.iterations, args.warmup))
    print_facts(
        {
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "platform": platform.platform(),
            "cores": str(os.cpu_count()),
            "iterations": f"{args.iterations} timed; untimed runs of {args.warmup}",
            "records": f"mean {round(statistics.mean(results.sizes))} bytes "
            f"over {len(results.sizes)} journal records",
            "server": "one nats-server, sync_interval: always (fsync before every ack)",
            "wall time": f"{time.perf_counter() - started:.1f}s",
        }
    )
    report(results.turns, results.floors)
    print_traffic(results.seen, args.warmup)
    if tally.seen:
        print("\nlogged while measuring:")
        for line, count in tally.seen.most_common():
            print(f"  {count:4}x {line}")


if __name__ == "__main__":
    main()
