"""What waiting agents, wakes, long runs and a second engine cost, through
the product as a user deploys it.

Run with ``make bench-scale`` or ``python -m bench.bench_scale``.

The processes are ``make bench``'s (``bench/bench_turn.py``): ``dagnats dev
--no-demo``, which starts nats-server (``sync_interval: always``) as its child;
a worker process (``python -m bench.bench_scale worker``: the agent-turn
handler, and a handler that waits for input); this process as the client.
In order, on that one server:

- ``thr``: the agent-turn workload (``BENCH_K`` = 50 iterations a run,
  ``BENCH_C`` = 20 runs at once, ``BENCH_THR_ROUNDS`` = 3 timed rounds after one
  untimed), after the raw JetStream floor; then again with a second engine
  process (``dagnats serve all`` on the same nats-server), the worker
  polling both and runs started on each in turn, and with one again;
- ``long``: one run of ``BENCH_LONG_K`` (1,000) iterations. An iteration's
  period is from its first journal record to the next iteration's (the
  records' own times); the median over the first ``BENCH_WINDOW`` (50)
  iterations against the median over the last, and the floor's run alike;
- ``wake``: ``BENCH_WAKES`` (200) runs one at a time, each parked in a wait
  for input and then sent an input (``Client.submit_input``); from the submit
  to the woken handler's start, to its ``place_inputs`` returned, and to the
  run's end seen here;
- ``park``: ``BENCH_WAITERS`` (10,000) runs parked in a wait for input at once
  (each wrote one journaled model call first): how long parking took, each
  process's resident memory and the store on disk before and after, each
  process's CPU while idle for ``BENCH_IDLE_SECONDS`` (20) before and after,
  the waiting task's consumer (nothing pending, nothing unacknowledged), then
  a round of the workload while they all wait (the worker's slots are free);
- ``wake`` again: ``BENCH_WAKES`` of the waiting runs, one at a time.

Then, unless ``BENCH_CLUSTER=0``, on a 3-node loopback cluster (``NatsCluster``)
with R3 streams (``dagnats serve all`` with ``DAGNATS_REPLICAS=3``): the
floor on an R3 stream, ``thr`` with one engine, then with two.

Every figure is printed beside its baseline from the same run (the floor, one
engine, or the same measure with nothing waiting) and the load average; the
record goes to ``$BENCH_OUT`` (``/tmp/peers-results``). Nothing here asserts
on time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import bench_turn as bt
from bench.harness import Procs, Served, per_second, pooled, runner, serve, thr_of
from dagnats.core.jetstream import KV_ACTIVE_RUNS, KV_RUNS
from dagnats.engine.store import INDEX_THROUGH
from dagnats.engine.v1 import engine_pb2 as pb

WAIT_TASK = "bench-scale-wait"  # the waiting handler's task type and workflow
STEP = "agent"  # the step of ``loop_workflow``
MODULE = "bench.bench_scale"
AFTER_ROUND = 5  # wakes right after a round of the workload
MESSAGES_K = 20  # iterations of the untimed runs that count messages


# ---- knobs ------------------------------------------------------------------------------


# The ``thr`` rounds: the agent-turn bench's K and C, fewer rounds.
THR = bt.Params(thr_rounds=3)


@dataclass(frozen=True)
class Knobs:
    waiters: int = 10_000  # BENCH_WAITERS: runs parked at once
    wakes: int = 200  # BENCH_WAKES: wakes with nothing waiting, and among the waiting
    long_k: int = 1_000  # BENCH_LONG_K: iterations of the long run
    window: int = 50  # BENCH_WINDOW: iterations timed at its start and at its end
    idle_seconds: int = 20  # BENCH_IDLE_SECONDS: CPU while idle, before and while waiting
    cluster: bool = True  # BENCH_CLUSTER=0: no 3-node cluster
    turn: bt.Params = THR  # BENCH_K, BENCH_C, BENCH_THR_ROUNDS

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Knobs:
        """The knobs from ``BENCH_*`` variables; a bad one stops with its name."""
        long_k = bt.knob(env, "BENCH_LONG_K", cls.long_k, 4)
        window = bt.knob(env, "BENCH_WINDOW", min(cls.window, (long_k - 2) // 2), 1)
        if 2 * window + 2 > long_k:
            raise SystemExit(
                f"BENCH_WINDOW ({window}) leaves no two windows in BENCH_LONG_K ({long_k}): "
                "it must be at most (BENCH_LONG_K - 2) / 2"
            )
        turn = bt.Params(
            k=bt.knob(env, "BENCH_K", cls.turn.k, 1),
            c=bt.knob(env, "BENCH_C", cls.turn.c, 1),
            thr_rounds=bt.knob(env, "BENCH_THR_ROUNDS", cls.turn.thr_rounds, 1),
        )
        return cls(
            waiters=bt.knob(env, "BENCH_WAITERS", cls.waiters, 1),
            wakes=bt.knob(env, "BENCH_WAKES", cls.wakes, 2),
            long_k=long_k,
            window=window,
            idle_seconds=bt.knob(env, "BENCH_IDLE_SECONDS", cls.idle_seconds, 1),
            cluster=env.get("BENCH_CLUSTER", "1") not in ("0", "", "no", "false"),
            turn=turn,
        )


# ---- the worker -------------------------------------------------------------------------


async def wait_turn(tc: Any) -> None:
    """Iteration 0: a journaled model call, then a wait for input. The
    iteration an input wakes places it and ends the run with when the handler
    began and when the input was placed (this machine's clock)."""
    from dagnats.sdk import InputMode

    began = time.time()
    j = await tc.journal()
    if tc.iteration == 0:

        async def model() -> dict[str, Any]:
            return {"text": "waiting for a person"}

        await j.model(model)
        await tc.continue_(until_input=True)
        return
    placed = await tc.place_inputs(InputMode.STEER)
    out = {"began": began, "placed": time.time(), "inputs": len(placed), "delivery": tc.delivery}
    await tc.complete(out)


# ---- what the processes hold ------------------------------------------------------------


def disk_bytes(root: Path) -> int:
    """Bytes on disk (allocated blocks) of every file under ``root``."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


# ---- the long run -----------------------------------------------------------------------


def iteration_times(records: Iterable[Any]) -> tuple[dict[int, float], dict[int, float]]:
    """When each iteration's first journal record and its commit were written
    (seconds), from a step's records."""
    first: dict[int, float] = {}
    commit: dict[int, float] = {}
    for record in records:
        at = record.time.ToNanoseconds() / 1e9
        first[record.iteration] = min(first.get(record.iteration, at), at)
        if record.WhichOneof("kind") == "commit":
            commit[record.iteration] = at
    return first, commit


def window(
    first: Mapping[int, float], commit: Mapping[int, float], lo: int, hi: int
) -> dict[str, float]:
    """Medians over iterations ``lo``..``hi - 1``, in ms: the period (an
    iteration's first record to the next's), and with commits its parts: the
    journal's (first record to commit) and the rest (commit to the next
    iteration's first record)."""
    its = [i for i in range(lo, hi) if i in first and i + 1 in first]
    if not its:
        raise SystemExit(f"no iteration in {lo}..{hi - 1} has a next one")
    out = {
        "from": lo,
        "to": hi - 1,
        "iterations": len(its),
        "period_ms": statistics.median(first[i + 1] - first[i] for i in its) * 1000,
        "mean_ms": statistics.fmean(first[i + 1] - first[i] for i in its) * 1000,
    }
    ended = [i for i in its if i in commit]
    if ended:
        out["journal_ms"] = statistics.median(commit[i] - first[i] for i in ended) * 1000
        out["after_commit_ms"] = statistics.median(first[i + 1] - commit[i] for i in ended) * 1000
    return {key: round(v, 3) for key, v in out.items()}


def windows(
    first: Mapping[int, float], commit: Mapping[int, float], k: int, w: int
) -> dict[str, Any]:
    """The first ``w`` iterations after the first (iteration 0 carries the
    run's start) against the last ``w`` that have a next one."""
    early, late = window(first, commit, 1, 1 + w), window(first, commit, k - 1 - w, k - 1)
    return {"first": early, "last": late, "ratio": round(late["period_ms"] / early["period_ms"], 3)}


Times = tuple[dict[int, float], dict[int, float]]  # iteration_times: first records, commits


def long_result(long: Times, early: Times, late: Times, k: Knobs) -> dict[str, Any]:
    """The long run's first and last windows, and beside each the first
    window of a new run that ran at the same time (``early``, ``late``): the
    same load, the journal short."""
    out = windows(*long, k.long_k, k.window)
    out["twin_first"] = window(*early, 1, 1 + k.window)
    out["twin_last"] = window(*late, 1, 1 + k.window)
    beside = out["last"]["period_ms"] / out["twin_last"]["period_ms"]
    out["ratio_same_time"] = round(beside, 3)
    return out


async def with_twins(
    long: Callable[[], Coroutine[Any, Any, Any]],
    twin: Callable[[], Awaitable[Any]],
    reached: Callable[[], bool],
) -> tuple[Any, Any, Any]:
    """``long()`` with a ``twin()`` beside its start, and another once
    ``reached()`` (the long one is about to enter its last window)."""
    task = asyncio.create_task(long())
    early = await twin()
    await bt.wait_until(lambda: reached() or task.done(), 1800, "the long run's last window")
    late = await twin()
    return await task, early, late


async def long_run(client: Any, target: str, k: Knobs) -> dict[str, Any]:
    """A run of ``k.long_k`` iterations with a new run beside its first and
    its last window; their journals read back."""
    from dagnats.sdk import JournalClient

    at = [0]

    async def run(n: int, follow: bool = False) -> Times:
        started = await client.start_run(bt.TASK, {"k": n})
        async for state in client.watch_run(started.run_id):
            if follow:
                at[0] = max(s.iteration for s in state.steps)
        if state.status != pb.RUN_STATUS_COMPLETED:
            raise SystemExit(f"a run of {n} ended {state}")
        async with JournalClient(target) as journal:
            return iteration_times([r async for r in journal.read(started.run_id, STEP)])

    long, early, late = await with_twins(
        lambda: run(k.long_k, follow=True),
        lambda: run(k.window + 3),
        lambda: at[0] >= k.long_k - k.window - 3,
    )
    return long_result(long, early, late, k)


async def floor_long_run(floor: bt.Floor, k: Knobs) -> dict[str, Any]:
    """The floor's the same, each iteration's start taken here."""
    stamps: list[float] = []

    async def run(n: int, into: list[float]) -> Times:
        await floor.run(n, into)
        return dict(enumerate(into)), {}

    long, early, late = await with_twins(
        lambda: run(k.long_k, stamps),
        lambda: run(k.window + 3, []),
        lambda: len(stamps) >= k.long_k - k.window - 3,
    )
    return long_result(long, early, late, k)


# ---- waits and wakes --------------------------------------------------------------------


def is_waiting(run: Any) -> bool:
    """The run's step waits for input."""
    return any(s.status == pb.STEP_STATUS_WAITING and s.waiting_for_input for s in run.steps)


async def wake(client: Any, run_id: str, n: int) -> dict[str, float]:
    """Once ``run_id`` waits for input, send it one; seconds from the submit
    to the woken handler's start, to its input placed, and to the run's end
    seen here."""
    submitted = 0.0
    last = None
    async for run in client.watch_run(run_id):
        last = run
        if not submitted and is_waiting(run):
            submitted = time.time()
            await client.submit_input(run_id, STEP, f"wake-{n}", {"n": n})
    seen = time.time()
    if last is None or last.status != pb.RUN_STATUS_COMPLETED or not submitted:
        raise SystemExit(f"run {run_id} was not woken to its end: {last}")
    out = json.loads(last.output)
    if out["inputs"] != 1:
        raise SystemExit(f"run {run_id} placed {out['inputs']} inputs, not 1")
    return {
        "began": out["began"] - submitted,
        "placed": out["placed"] - submitted,
        "seen": seen - submitted,
        "delivery": out["delivery"],
    }


def latencies(wakes: list[dict[str, float]]) -> dict[str, Any]:
    """p50 and p99 in ms of each part of the wakes."""
    out: dict[str, Any] = {"n": len(wakes), "deliveries": [w["delivery"] for w in wakes]}
    for part in ("began", "placed", "seen"):
        xs = [w[part] * 1000 for w in wakes]
        out[part] = {
            "p50": round(bt.pct(xs, 50), 3),
            "p99": round(bt.pct(xs, 99), 3),
            "first": round(xs[0], 3),
        }
    return out


async def wakes_idle(client: Any, n: int) -> dict[str, Any]:
    """``n`` runs one at a time, each woken once it waits."""
    got = []
    for i in range(n):
        run = await client.start_run(WAIT_TASK)
        got.append(await wake(client, run.run_id, i))
    return latencies(got)


async def wakes_of(client: Any, run_ids: Sequence[str], n: int) -> dict[str, Any]:
    """``n`` of the waiting ``run_ids``, spread over them, woken one at a time."""
    picked = run_ids[:: max(1, len(run_ids) // n)][:n]
    return latencies([await wake(client, run_id, i) for i, run_id in enumerate(picked)])


async def polls_settled(js: Any, most: int = 1) -> None:
    """Until at most ``most`` pulls wait on the waiting task's consumer. A
    poll of several task types that one type answers leaves its pull on the
    others waiting out the poll's wait, and the next task there goes to those
    first (see ADR 26); the wakes are measured without them."""
    from dagnats.core.subjects import task_consumer

    deadline = time.monotonic() + 30
    while (await js.consumer_info("TASKS", task_consumer(WAIT_TASK))).num_waiting > most:
        if time.monotonic() > deadline:
            raise SystemExit("the pulls left by answered polls did not expire in 30s")
        await asyncio.sleep(0.25)  # they expire at the end of their poll's wait


async def consumers_idle(js: Any, *names: tuple[str, str]) -> bool:
    """Nothing pending and nothing unacknowledged on each (stream, consumer)."""
    for stream, consumer in names:
        info = await js.consumer_info(stream, consumer)
        if info.num_pending or info.num_ack_pending:
            return False
    return True


async def park(client: Any, js: Any, n: int) -> tuple[list[str], float]:
    """Start ``n`` runs that wait for input (64 starts at a time) and return
    their ids once every one waits, with the seconds it took."""
    from dagnats.core.subjects import history_consumer, task_consumer

    gate = asyncio.Semaphore(64)
    started = time.perf_counter()

    async def start(i: int) -> str:
        async with gate:
            run = await client.start_run(WAIT_TASK, {"i": i})
            if i % 1000 == 999:
                bt.progress(f"park: {i + 1} started")
            return str(run.run_id)

    run_ids = await asyncio.gather(*(start(i) for i in range(n)))
    quiet = (("TASKS", task_consumer(WAIT_TASK)), ("HISTORY", history_consumer(0)))
    unsure, seconds = set(run_ids), 300 + n / 10
    deadline = time.monotonic() + seconds

    async def waits(run_id: str) -> bool:
        async with gate:
            return is_waiting(await client.get_run(run_id))

    while True:
        if await consumers_idle(js, *quiet):
            ids = sorted(unsure)
            found = await asyncio.gather(*map(waits, ids))
            unsure -= {run_id for run_id, yes in zip(ids, found, strict=True) if yes}
            if not unsure:
                return run_ids, time.perf_counter() - started
            bt.progress(f"park: {n - len(unsure)} of {n} wait")
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(unsure)} of the {n} runs did not wait within {seconds:.0f}s")
        await asyncio.sleep(1.0)  # the engine is still applying what the starts caused


async def index_drained(js: Any, n: int) -> float:
    """Seconds until the reconciler's passes have read every write of the
    runs bucket (ADR 48: the index's mark has reached its last sequence) and
    the active-run index holds none of the ``n`` parked runs (ADR 32: a pass
    enters them, the next parks them and takes them out), so that what is
    measured next is a wait's steady state, not the passes that park it."""
    from nats.js.errors import KeyNotFoundError

    index = await js.key_value(KV_ACTIVE_RUNS)
    started = time.perf_counter()
    deadline = time.monotonic() + 300 + n / 20
    while True:
        runs = await js.stream_info(f"KV_{KV_RUNS}")
        try:
            mark = int((await index.get(INDEX_THROUGH)).value or b"0")
        except KeyNotFoundError:
            mark = 0
        info = await js.stream_info(f"KV_{KV_ACTIVE_RUNS}")
        # The mark, and the key that says every run has its entry by creation time.
        if mark >= runs.state.last_seq and info.state.messages <= 2:
            return time.perf_counter() - started
        if time.monotonic() > deadline:
            raise SystemExit(
                f"the reconciler did not settle: its mark at {mark} of the runs"
                f" bucket's {runs.state.last_seq}, {info.state.messages} keys in the index"
            )
        await asyncio.sleep(1.0)  # a reconcile pass takes seconds


async def list_time(target: str) -> float | None:
    """Seconds a ``ListRuns`` of the newest 100 runs takes (one try, at most
    120 s); None when it did not answer in that time."""
    from dagnats.sdk import Client, DeadlineExceeded, Unavailable

    async with Client(target, timeout=120.0, retry_for=0.0) as client:
        try:
            return await bt.timed(lambda: client.list_runs(limit=100))
        except (DeadlineExceeded, Unavailable):
            return None


async def held(js: Any, monitor: str) -> dict[str, Any]:
    """What the waiting task's consumer holds, and the server's consumers."""
    from dagnats.core.subjects import task_consumer

    info = await js.consumer_info("TASKS", task_consumer(WAIT_TASK))
    jsz = bt.get_json(f"{monitor}/jsz")
    return {
        "tasks_pending": info.num_pending,
        "tasks_unacknowledged": info.num_ack_pending,
        "polls_waiting": info.num_waiting,
        "server_consumers": jsz.get("consumers"),
    }


def footprint(procs: Procs, store: Path, monitor: str) -> dict[str, Any]:
    """Each process's resident memory, the store on disk, each stream's bytes."""
    return {
        "rss": procs.rss(),
        "store_disk": disk_bytes(store),
        "streams": bt.stream_field(bt.get_json(f"{monitor}/jsz?streams=true"), "bytes"),
    }


async def idle_cpu(procs: Procs, seconds: int) -> dict[str, float]:
    """Each process's CPU (cores) while nothing is asked of it for ``seconds``."""
    before = procs.cpu()
    await asyncio.sleep(seconds)  # the window being measured
    return per_second(before, procs.cpu(), seconds)


# ---- engines and throughput -------------------------------------------------------------


def serve_all(nats_url: str, log: Path, replicas: int = 1) -> Served:
    """The services as ``dagnats dev`` runs them, the engine, the journal and
    inputs on one port (``dagnats serve all``), in their own process, with
    ``replicas`` copies of each stream."""
    return serve("all", nats_url, log, env={"DAGNATS_REPLICAS": str(replicas)})


async def throughput(
    name: str, k: Knobs, clients: Sequence[Any], cpu: Callable[[], dict[str, float]]
) -> dict[str, Any]:
    """``thr`` of the agent-turn bench, runs started on each client in turn."""
    return await thr_of(name, k.turn, runner(clients), cpu)


async def floor_on(js: Any, replicas: int) -> bt.Floor:
    """The raw floor, on its own stream (``replicas`` copies)."""
    await js.add_stream(
        name=bt.FLOOR_STREAM, subjects=["floor.>"], storage="file", num_replicas=replicas
    )
    return bt.Floor(js)


async def register(client: Any) -> None:
    from tests.stack import loop_workflow

    await client.register_workflow(loop_workflow(bt.TASK, bt.TASK, max_iterations=100_000))
    await client.register_workflow(loop_workflow(WAIT_TASK, WAIT_TASK, max_iterations=10))


# ---- the measurement --------------------------------------------------------------------


@dataclass
class Deployment:
    """A nats-server or cluster with one engine process on it and the worker."""

    nats_url: str
    replicas: int
    target: str  # the first engine's
    worker: subprocess.Popen[bytes]
    procs: Procs
    logs: Path
    c: int

    def workers_on(self, targets: Sequence[str]) -> None:
        """A new worker process, polling each engine in ``targets``."""
        bt.stop_process(self.worker)
        self.worker = bt.spawn_worker(MODULE, targets, bt.TASK, self.c, self.logs / "worker.log")
        self.procs.pids["worker"] = self.worker.pid


Count = Callable[[Callable[[int], Awaitable[None]]], Awaitable[dict[str, Any]]]


async def one_and_two(
    d: Deployment, client: Any, k: Knobs, where: str, count: Count | None = None
) -> dict[str, Any]:
    """``thr`` with one engine, with a second engine process beside it (the
    worker polling both, runs started on each in turn), and with one again,
    so that the machine's drift shows; ``count`` counts the messages of an
    iteration with one engine and with two."""
    from dagnats.sdk import Client

    out: dict[str, Any] = {}
    out["one_engine"] = await throughput(f"{where}one engine", k, [client], d.procs.cpu)
    if count:
        out["messages_one"] = await count(runner([client]))
    second = serve_all(d.nats_url, d.logs / "engine2.log", d.replicas)
    target = second.target
    try:
        d.workers_on([d.target, target])
        d.procs.pids["services 2"] = second.proc.pid
        async with Client(target) as client2:
            for c in (client, client2):
                await c.run(bt.TASK, {"k": 1}, timeout=60)  # both polled
            both = [client, client2]
            out["two_engines"] = await throughput(f"{where}two engines", k, both, d.procs.cpu)
            if count:
                out["messages_two"] = await count(runner(both))
    finally:
        bt.stop_process(second.proc, signal.SIGINT)
        d.procs.pids.pop("services 2", None)
    d.workers_on([d.target])
    await client.run(bt.TASK, {"k": 1}, timeout=60)
    again = await throughput(f"{where}one engine again", k, [client], d.procs.cpu)
    out["one_engine_again"] = again
    out["one_engines"] = pooled(out["one_engine"], again)
    return out


async def one_server(k: Knobs, data: Path) -> dict[str, Any]:
    """Everything on ``dagnats dev``'s one nats-server."""
    import nats

    from dagnats.sdk import Client

    stack = bt.start_stack(data, k.turn, worker_module=MODULE)
    d: Deployment | None = None
    try:
        procs = Procs({"nats-server": stack.nats_pid, "services": stack.dev.pid})
        procs.pids["worker"] = stack.worker.pid
        d = Deployment(stack.nats_url, 1, stack.engine, stack.worker, procs, stack.logs, k.turn.c)
        nc = await nats.connect(stack.nats_url, name="bench-scale")
        js = nc.jetstream()
        async with Client(stack.engine) as client:
            await register(client)
            await client.run(bt.TASK, {"k": 1}, timeout=60)  # the worker polls
            bt.progress("thr: the floor, then one engine, two, one")
            floor = await floor_on(js, 1)
            out = {"floor": await thr_of("floor", k.turn, floor.run, procs.cpu)}

            async def count(run: Callable[[int], Awaitable[None]]) -> dict[str, Any]:
                return await bt.messages(stack, run, MESSAGES_K)

            out |= await one_and_two(d, client, k, "", count)
            bt.progress(f"long: a run of {k.long_k} iterations, then the floor's")
            out["long"] = await long_run(client, stack.engine, k)
            out["long_floor"] = await floor_long_run(floor, k)
            store = data / "dev" / "nats"
            out |= await waiting(k, client, stack.engine, js, procs, store, stack.monitor)
        await nc.close()
        for proc, name in ((d.worker, "worker"), (stack.dev, "dagnats dev")):
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited early (logs in {stack.logs})")
        return out
    finally:
        stack.worker = stack.worker if d is None else d.worker
        bt.stop_stack(stack)


async def list_runs_only(k: Knobs, data: Path) -> dict[str, Any]:
    """``python -m bench.bench_scale list``: the ``ListRuns`` measure alone,
    on ``dagnats dev``'s one server: the newest 100 with none parked, then
    with ``k.waiters`` parked once the reconciler has parked them (its passes
    rewrite every one, after the newest were created), five tries each; then
    with 100 runs more started one after the other."""
    import nats

    from dagnats.sdk import Client

    stack = bt.start_stack(data, k.turn, worker_module=MODULE)
    try:
        nc = await nats.connect(stack.nats_url, name="bench-scale")
        js = nc.jetstream()
        out: dict[str, Any] = {"waiters": k.waiters, "load_start": os.getloadavg()[0]}
        async with Client(stack.engine) as client:
            await register(client)
            await client.run(bt.TASK, {"k": 1}, timeout=60)
            for _ in range(100):
                await client.run(bt.TASK, {"k": 1}, timeout=60)
            out["none_parked_s"] = [await list_time(stack.engine) for _ in range(5)]
            bt.progress(f"park: {k.waiters} runs")
            _, seconds = await park(client, js, k.waiters)
            out["park_s"] = round(seconds, 1)
            out["unindexed_s"] = await index_drained(js, k.waiters)
            out["parked_s"] = [await list_time(stack.engine) for _ in range(5)]
            # 100 runs more, one after the other, after the parked ones: the
            # newest 100 are no longer the end of the burst that parked.
            for _ in range(100):
                await client.run(bt.TASK, {"k": 1}, timeout=60)
            out["after_parked_s"] = [await list_time(stack.engine) for _ in range(5)]
        out["load_end"] = os.getloadavg()[0]
        await nc.close()
        return out
    finally:
        bt.stop_stack(stack)


async def waiting(
    k: Knobs, client: Any, target: str, js: Any, procs: Procs, store: Path, monitor: str
) -> dict[str, Any]:
    """Wakes with nothing waiting, then ``k.waiters`` runs parked, what they
    hold, wakes among them, and a round of the workload while they wait."""
    out: dict[str, Any] = {}
    await polls_settled(js)
    bt.progress(f"wake: {k.wakes} runs, nothing else waiting")
    out["wake_idle"] = await wakes_idle(client, k.wakes)
    bt.progress(f"park: idle {k.idle_seconds}s, then {k.waiters} runs")
    out["idle_cpu_before"] = await idle_cpu(procs, k.idle_seconds)
    out["before"] = {**footprint(procs, store, monitor), **await held(js, monitor)}
    out["before"]["list_runs_s"] = await list_time(target)
    run_ids, seconds = await park(client, js, k.waiters)
    bt.progress(f"park: all {k.waiters} wait; the reconciler takes them out of the index")
    drained = await index_drained(js, k.waiters)
    out["park"] = {"runs": k.waiters, "seconds": round(seconds, 2), "unindexed_s": drained}
    out["parked"] = {**footprint(procs, store, monitor), **await held(js, monitor)}
    out["parked"]["list_runs_s"] = await list_time(target)
    bt.progress(f"park: {k.waiters} out of the index after {drained:.0f}s; idle {k.idle_seconds}s")
    out["idle_cpu_parked"] = await idle_cpu(procs, k.idle_seconds)
    await polls_settled(js)
    bt.progress(f"wake: {k.wakes} of the {k.waiters} waiting runs")
    out["wake_parked"] = await wakes_of(client, run_ids[::2], k.wakes)
    name = f"one engine, {k.waiters} waiting"
    out["while_waiting"] = await throughput(name, k, [client], procs.cpu)
    out["after_round"] = {"rss": procs.rss(), **await held(js, monitor)}
    bt.progress("wake: right after the round")
    out["wake_after_round"] = await wakes_of(client, run_ids[1::2], AFTER_ROUND)
    return out


async def cluster(k: Knobs, data: Path) -> dict[str, Any]:
    """The floor, then ``thr`` with one engine, two and one on a 3-node
    loopback cluster with R3 streams."""
    import nats

    from dagnats.core.natsserver import NatsCluster
    from dagnats.sdk import Client

    logs = data / "logs"
    logs.mkdir(parents=True)
    nodes = await NatsCluster.start(data / "cluster")
    first: subprocess.Popen[str] | None = None
    d: Deployment | None = None
    try:
        served = serve_all(nodes.url, logs / "engine1.log", replicas=3)
        first, target = served.proc, served.target
        worker = bt.spawn_worker(MODULE, [target], bt.TASK, k.turn.c, logs / "worker.log")
        procs = Procs({f"nats-server n{i + 1}": s.pid for i, s in enumerate(nodes.servers)})
        procs.pids.update({"services": first.pid, "worker": worker.pid})
        d = Deployment(nodes.url, 3, target, worker, procs, logs, k.turn.c)
        nc = await nats.connect(servers=nodes.urls, name="bench-scale")
        async with Client(target) as client:
            await register(client)
            await client.run(bt.TASK, {"k": 1}, timeout=60)
            bt.progress("cluster thr: the floor (R3), then one engine, two, one")
            floor = await floor_on(nc.jetstream(), 3)
            out = {"floor": await thr_of("floor", k.turn, floor.run, procs.cpu)}
            out |= await one_and_two(d, client, k, "cluster, ")
        await nc.close()
        return out
    finally:
        if d is not None:
            bt.stop_process(d.worker)
        if first is not None:
            bt.stop_process(first, signal.SIGINT)
        await nodes.stop()


# ---- the report -------------------------------------------------------------------------


def at(got: Mapping[str, Any], path: str) -> float | None:
    """The number at a dotted ``path`` of ``got``; None when it is not there."""
    value: Any = got
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return float(value)


def rows(got: Mapping[str, Any], k: Knobs) -> list[bt.Row]:
    """Every figure beside its baseline from the same run."""

    def pair(label: str, path: str, base: str, fmt: str = "{:.2f}") -> bt.Row:
        return bt.Row(label, at(got, path), at(got, base), fmt)

    n, whole, mib = k.waiters, "{:.0f}", 1 << 20
    spec = [
        ("thr steps/s: one engine / the floor", "one.one_engine", "one.floor"),
        (
            "thr steps/s: one engine, again / the first time",
            "one.one_engine_again",
            "one.one_engine",
        ),
        ("thr steps/s: two engines / one (both times)", "one.two_engines", "one.one_engines"),
        (f"thr steps/s: one engine, {n} waiting / none", "one.while_waiting", "one.one_engines"),
        ("cluster R3 thr: the floor / one server's floor", "cluster.floor", "one.floor"),
        ("cluster R3 thr: one engine / the floor (R3)", "cluster.one_engine", "cluster.floor"),
        ("cluster R3 thr: one engine / one server's", "cluster.one_engines", "one.one_engines"),
        (
            "cluster R3 thr: one engine, again / first",
            "cluster.one_engine_again",
            "cluster.one_engine",
        ),
        ("cluster R3 thr: two engines / one", "cluster.two_engines", "cluster.one_engines"),
    ]
    table = [
        pair(label, f"{a}.steps_per_s", f"{b}.steps_per_s", whole)
        for label, a, b in spec
        if at(got, f"{a}.steps_per_s") is not None
    ]
    for label, a, b in spec[2:4] + spec[6:7] + spec[8:]:
        if at(got, f"{a}.steps_per_s") is not None:
            cpu = "cpu_ms_per_step.total"
            table.append(
                pair(label.replace("steps/s", "CPU ms a step"), f"{a}.{cpu}", f"{b}.{cpu}")
            )
    for way in ("in_msgs", "out_msgs"):
        label = f"nats-server {way} an iteration: two engines / one"
        table.append(
            pair(label, f"one.messages_two.server.{way}", f"one.messages_one.server.{way}")
        )
    long = got["one"]["long"]
    later, early = (f"{long[w]['from']}-{long[w]['to']}" for w in ("last", "first"))
    for label, system, part, base in (
        (f"long: ms an iteration, {later} / {early}", "long", "period_ms", "first"),
        (f"long: {later} / a new run's {early} beside it", "long", "period_ms", "twin_last"),
        (f"long: {early} / a new run's {early} beside it", "long", "period_ms", "twin_first"),
        ("long: journal's part (claim to commit), the same", "long", "journal_ms", "twin_last"),
        ("long: the rest (commit to next claim), the same", "long", "after_commit_ms", "twin_last"),
        (f"long, floor: ms an iteration, {later} / {early}", "long_floor", "period_ms", "first"),
        (f"long, floor: {later} / a new run's beside it", "long_floor", "period_ms", "twin_last"),
    ):
        this = "first" if base == "twin_first" else "last"
        table.append(pair(label, f"one.{system}.{this}.{part}", f"one.{system}.{base}.{part}"))
    for part, what in (
        ("began", "handler began"),
        ("placed", "input placed"),
        ("seen", "end seen"),
    ):
        for p in ("p50", "p99"):
            label = f"wake {p}, ms to {what}: {n} waiting / none"
            table.append(pair(label, f"one.wake_parked.{part}.{p}", f"one.wake_idle.{part}.{p}"))
    one = got["one"]
    after, parked = one["wake_after_round"], one["wake_parked"]
    label = "wake after a round: the first's deliveries / most"
    table.append(bt.Row(label, after["deliveries"][0], max(parked["deliveries"]), whole))
    label = "wake after a round: the first, ms to handler began / p50"
    table.append(bt.Row(label, after["began"]["first"], parked["began"]["p50"]))
    for name in one["before"]["rss"]:
        table.append(
            bt.Row(
                f"RSS MiB, {name}: {n} waiting / none",
                one["parked"]["rss"][name] / mib,
                one["before"]["rss"][name] / mib,
                "{:.1f}",
            )
        )
    label = f"ListRuns of the newest 100, s: {n} waiting / none"
    table.append(pair(label, "one.parked.list_runs_s", "one.before.list_runs_s"))
    disk = (one["parked"]["store_disk"] / mib, one["before"]["store_disk"] / mib)
    table.append(bt.Row(f"store on disk MiB: {n} waiting / none", *disk, "{:.1f}"))
    for name in one["idle_cpu_before"]:
        label = f"idle CPU % of a core, {name}: {n} waiting / none"
        busy = (100 * one["idle_cpu_parked"][name], 100 * one["idle_cpu_before"][name])
        table.append(bt.Row(label, *busy, "{:.1f}"))
    return table


def per_waiter(got: Mapping[str, Any], k: Knobs) -> dict[str, float]:
    """Bytes each waiting run adds: each process's memory, the store, each stream."""
    before, parked = got["before"], got["parked"]
    out = {
        f"rss {name}": (parked["rss"][name] - before["rss"][name]) / k.waiters
        for name in before["rss"]
    }
    out["store on disk"] = (parked["store_disk"] - before["store_disk"]) / k.waiters
    for name, size in parked["streams"].items():
        if grew := size - before["streams"].get(name, 0):
            out[f"stream {name}"] = grew / k.waiters
    return {name: round(v) for name, v in out.items()}


def print_messages(one: Mapping[str, Any], two: Mapping[str, Any]) -> None:
    """Messages of an iteration with one engine and with two, where they differ."""
    print(f"\nmessages an iteration (untimed runs of K={one['iterations']}), one engine / two:")
    for part in ("server", "stored_by_stream", "sent_by_kind"):
        for kind in sorted({*one[part], *two[part]}):
            a, b = one[part].get(kind, 0.0), two[part].get(kind, 0.0)
            if a != b:
                print(f"  {part:16} {kind:44} {a:6.2f} {b:6.2f}")


def scale_record(
    got: Mapping[str, Any], k: Knobs, head: str, load: tuple[float, float, float]
) -> dict[str, Any]:
    """The run's record: every figure, the knobs, the load at its start and end."""
    return {
        "system": "dagnats",
        "variant": "scale",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": head,
        "cpus": os.cpu_count(),
        "load": {"start": load, "end": os.getloadavg()},
        "knobs": dataclasses.asdict(k),
        "results": got,
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["worker"]:
        targets, task, concurrency = args[1].split(","), args[2], int(args[3])
        handlers = {task: bt.turn_handler(), WAIT_TASK: wait_turn}
        asyncio.run(bt.serve_worker(targets, handlers, concurrency))
        return
    if args[:1] == ["list"]:
        k = Knobs.from_env(os.environ)
        with tempfile.TemporaryDirectory(prefix="dagnats-bench-scale-") as tmp:
            measured = asyncio.run(list_runs_only(k, Path(tmp) / "one"))
        print(json.dumps(measured, indent=2))
        return
    if args:
        raise SystemExit(f"usage: python -m {MODULE} [list] (knobs: BENCH_* variables); got {args}")
    k = Knobs.from_env(os.environ)
    started, load = time.perf_counter(), os.getloadavg()
    got: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dagnats-bench-scale-") as tmp:
        got["one"] = asyncio.run(one_server(k, Path(tmp) / "one"))
        if k.cluster:
            got["cluster"] = asyncio.run(cluster(k, Path(tmp) / "cluster"))
    head = bt._git_head()
    got["per_waiter_bytes"] = per_waiter(got["one"], k)
    rec = scale_record(got, k, head, load)
    path = bt.write_record(rec, Path(os.environ.get("BENCH_OUT", "/tmp/peers-results")))
    one = got["one"]
    p = k.turn
    print(
        f"scale: {k.waiters} waiting, {k.wakes} wakes each way, a run of {k.long_k}, "
        f"thr K={p.k} C={p.c} x{p.thr_rounds}; {os.cpu_count()} cores, load {load[0]:.2f} "
        f"at start, {os.getloadavg()[0]:.2f} at end; dagnats {head}; "
        f"{time.perf_counter() - started:.0f}s"
    )
    print(bt.format_table(rows(got, k), columns=("value", "baseline"), width=58))
    took = one["park"]["seconds"]
    print(f"\nparking {k.waiters} runs took {took:.1f}s ({k.waiters / took:.0f} runs/s)")
    print(
        f"the reconciler took them out of the active-run index in {one['park']['unindexed_s']:.0f}s"
    )
    print(f"bytes each waiting run adds: {got['per_waiter_bytes']}")
    for when in ("before", "parked", "after_round"):
        held_ = {
            x: one[when][x]
            for x in ("tasks_pending", "tasks_unacknowledged", "polls_waiting", "server_consumers")
        }
        print(f"{when:12} waiting task's consumer and the server's consumers: {held_}")
    print_messages(one["messages_one"], one["messages_two"])
    print("\nthr, CPU ms per step by process:")
    for place in ("one", "cluster"):
        for name, m in got.get(place, {}).items():
            if isinstance(m, dict) and "load" in m:
                cpu = ", ".join(f"{p} {v:.3f}" for p, v in m["cpu_ms_per_step"].items())
                print(f"  {place:7} {name:16} load {m['load']}: {cpu}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
