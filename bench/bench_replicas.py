"""Replicas of the services: the throughput they give, what an iteration
costs with each, and how long a stopped replica's runs wait to move again.

Run with ``make bench-replicas`` or ``python -m bench.bench_replicas
[--json PATH]``.

Two topologies (``BENCH_TOPOLOGIES``): ``server``, one nats-server
(``sync_interval: always``), and ``cluster``, a 3-node loopback cluster
(``NatsCluster``) with R3 streams. On each, a replica is a ``dagnats serve
all`` process (the engine, the journal and inputs on one port, its local
socket and its counters on ``--metrics-port``) with a worker process of its
own polling it, the way ``dagnats dev`` runs one: the worker runs the
agent-turn workload of ``bench/bench_turn.py`` (one journaled model call and
one journaled unsafe tool call an iteration, its task kept between
iterations) and finds the replica's local socket from its polls. Every
replica is started with ``DAGNATS_PARTITIONS`` = ``BENCH_PARTITIONS`` (6).

Every replica connects to the same node (the first): which node a replica
sends through moves an iteration's messages on the cluster by up to a
quarter, by whether its writes enter at their streams' leaders, and that
would fall on the rows by chance.

``thr`` runs twice on each topology, on a deployment each: with the
workload's model answering at once, and answering in 100 ms
(``BENCH_MODEL_MS``, ``0,100``, milliseconds). Each row has 1, 2 or 3
replicas (``BENCH_REPLICAS``) and runs of ``BENCH_K`` (50) iterations,
started on the replicas' gRPC ports in turn; how many at once is what keeps
each run at the pace it has on N machines (``runs_at_once``):

- With the model taking 100 ms, each replica carries ``BENCH_C`` (20) runs
  (a row of n replicas runs n * C). The model sets each run's pace, the
  cores are not all taken, the load grows with the replicas as it would on
  N machines, and so does the throughput.
- With the model answering at once, the two cores set the pace, and the
  row carries C runs in all, spread over the replicas. With C for each
  replica, three replicas' runs would go each a third as fast as one
  replica's, which N machines do not do, and what goes with time on the
  iteration's path would cost them more an iteration: a kept iteration's
  run is written at the latest 0.2 s after it was decided
  (``DAGNATS_KEPT_WRITE_DELAY``), and a model call reads the journal's tail
  unless the holder wrote within 50 ms (``FRESH_TAIL``). So spread, each
  run goes at the pace it goes with one replica, and the row tells what a
  replica adds to an iteration, not what a slower run costs.

With ``BENCH_KINDS=1`` every row also counts its messages by kind
(``bench/message_kinds.py``, a core subscription to every subject): what an
iteration sends into nats-server, by what each message does, and what
nats-server sends out.

On one deployment, a row of one replica to warm it
up, then ``BENCH_REPEATS`` (3) passes over the counts in turn, replicas
added or stopped (SIGTERM) between rows, so that the machine's drift falls
on every count alike; each row one untimed round, then ``BENCH_ROUNDS``
(5) timed. Per row: iterations/s (the median round); messages into
nats-server an iteration (``/varz`` ``in_msgs``, summed over every server,
around the timed rounds), and of those what the members received from each
other (``/routez``); CPU ms an iteration (utime + stime from
``/proc``) of every process (the nats-servers, the replicas, their
workers) and of the replicas alone; the engine's guesses that missed an
iteration (``guess_missed`` on the replicas' ``/metrics``); the slowest
round. The table gives, per count, the medians over the passes beside one
replica's, the range of CPU an iteration, and the slowest round of any
pass (a task delivered to nobody shows as a round as long as the task's
lease); the issue's bars are checked on the medians: messages an
iteration within 10% of one replica's, 2 replicas' throughput at least
one's.

``instructions`` (``BENCH_INSTRUCTIONS`` = 40 s counted a row; 0 skips
it): the instructions the replicas' processes execute an iteration, counted
by callgrind, with 1, 2 and 3 replicas (``bench/replica_instructions.py``).
CPU seconds rise on two cores with every process that wakes on them, for
the same work; instructions do not, so these rows say what N replicas on N
machines cost an iteration, and the CPU bar is checked on them.

``failover`` (``BENCH_KILLS`` = 5 stops of each kind; 0 skips it): on a new
deployment of each topology, 3 replicas with the task's lease
(``DAGNATS_TASK_ACK_WAIT``) shortened to ``BENCH_ACK_WAIT`` (5 s): an
in-flight step of a killed worker is taken up again only after its lease.
Each stop starts ``BENCH_C`` runs of ``BENCH_FAILOVER_K`` (100) iterations,
waits until the victim replica's worker is running some of them, and stops
that replica and its worker: ``kill -9``, then SIGTERM (the hand-over at
once); the victims turn through the replicas, each restarted after its stop.
Per run the victim's worker was running, the seconds from the signal to
the run moving again elsewhere: to its next iteration begun on another
replica's worker (each worker keeps when each iteration began on the
machine's monotonic clock, and tells it on SIGUSR1), so that what the
stopped processes do before they exit (a SIGTERM'd one finishes what it
was doing) is not taken for it. Beside it, the seconds to the stopped
processes' exit, and to the run's first journal record or run write seen
after that exit (a core NATS subscription to its journal's and its run's
subjects). Every run of every stop must complete
with the workload's answer.

Results: markdown tables on stdout, the record as JSON with ``--json PATH``.
Nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import bench_turn as bt
from bench import harness
from bench import message_kinds as mk

MODULE = "bench.bench_replicas"
TOPOLOGIES = {"server": "one nats-server", "cluster": "3-node cluster, R3"}
STOPS = {"kill": ("kill -9", signal.SIGKILL), "term": ("SIGTERM", signal.SIGTERM)}
HELD_FILE = "BENCH_HELD_FILE"  # the worker's: where SIGUSR1 writes the runs it runs
MODEL_MS = "BENCH_MODEL_MS"  # the worker's: how long the workload's model takes to answer
HELD_WITHIN = 1.0  # a run whose iteration began on a worker this recently is that worker's
PARTITIONS_BUCKET = "PARTITIONS"  # the owners of the partitions, when the engine has them
BAR = 1.10  # the bar: cost an iteration within 10% of one replica's


# ---- knobs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    partitions: int = 6  # BENCH_PARTITIONS: DAGNATS_PARTITIONS of every replica
    topologies: tuple[str, ...] = tuple(TOPOLOGIES)  # BENCH_TOPOLOGIES: server,cluster
    replicas: tuple[int, ...] = (1, 2, 3)  # BENCH_REPLICAS: the rows, from 1 up
    k: int = 50  # BENCH_K: iterations a run
    c: int = 20  # BENCH_C: runs at once, of each replica when paced, in all at 0 ms
    rounds: int = 5  # BENCH_ROUNDS: timed rounds of a row, after one untimed
    repeats: int = 3  # BENCH_REPEATS: passes over the rows, in turn
    kills: int = 5  # BENCH_KILLS: stops of each kind in each topology (0: no failover)
    failover_k: int = 100  # BENCH_FAILOVER_K: iterations of a run during a stop
    ack_wait: int = 5  # BENCH_ACK_WAIT: DAGNATS_TASK_ACK_WAIT while stopping replicas
    paces: tuple[int, ...] = (0, 100)  # BENCH_MODEL_MS: the model's answer times, ms
    instructions: int = 40  # BENCH_INSTRUCTIONS: seconds counted a row (0: no such part)
    kinds: int = 0  # BENCH_KINDS: 1 counts the thr rows' messages by kind
    c_counted: int = 2  # BENCH_C_COUNTED: runs of each replica while counting
    model_ms_counted: int = 500  # BENCH_MODEL_MS_COUNTED: the model's answer time then

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Knobs:
        """The knobs from ``BENCH_*`` variables; a bad one stops with its name."""
        tops = tuple(x for x in env.get("BENCH_TOPOLOGIES", ",".join(cls.topologies)).split(","))
        if not tops or any(t not in TOPOLOGIES for t in tops):
            raise SystemExit(f"BENCH_TOPOLOGIES must name some of {', '.join(TOPOLOGIES)}")
        raw = env.get("BENCH_REPLICAS", "") or ",".join(map(str, cls.replicas))
        try:
            replicas = tuple(int(x) for x in raw.split(","))
        except ValueError:
            raise SystemExit(f"BENCH_REPLICAS must be counts like 1,2,3, got {raw!r}") from None
        if replicas[0] != 1 or list(replicas) != sorted(set(replicas)) or replicas[-1] > 9:
            raise SystemExit(f"BENCH_REPLICAS must rise from 1 (at most 9), got {raw!r}")
        raw = env.get(MODEL_MS, "") or ",".join(map(str, cls.paces))
        try:
            paces = tuple(int(x) for x in raw.split(","))
        except ValueError:
            raise SystemExit(f"{MODEL_MS} must be milliseconds like 0,100, got {raw!r}") from None
        if any(not 0 <= x <= 60_000 for x in paces) or len(set(paces)) < len(paces):
            raise SystemExit(f"{MODEL_MS} must be distinct milliseconds up to 60000, got {raw!r}")
        return cls(
            partitions=bt.knob(env, "BENCH_PARTITIONS", cls.partitions, 1, 64),
            topologies=tops,
            replicas=replicas,
            k=bt.knob(env, "BENCH_K", cls.k, 1),
            c=bt.knob(env, "BENCH_C", cls.c, 1),
            rounds=bt.knob(env, "BENCH_ROUNDS", cls.rounds, 1),
            repeats=bt.knob(env, "BENCH_REPEATS", cls.repeats, 1),
            kills=bt.knob(env, "BENCH_KILLS", cls.kills, 0),
            failover_k=bt.knob(env, "BENCH_FAILOVER_K", cls.failover_k, 2),
            ack_wait=bt.knob(env, "BENCH_ACK_WAIT", cls.ack_wait, 1),
            paces=paces,
            instructions=bt.knob(env, "BENCH_INSTRUCTIONS", cls.instructions, 0),
            kinds=bt.knob(env, "BENCH_KINDS", cls.kinds, 0, 1),
            c_counted=bt.knob(env, "BENCH_C_COUNTED", cls.c_counted, 1),
            model_ms_counted=bt.knob(
                env, "BENCH_MODEL_MS_COUNTED", cls.model_ms_counted, 0, 60_000
            ),
        )


def partition_lease() -> str:
    """The partition lease the replicas run with, as they read it."""
    set_ = os.environ.get("DAGNATS_PARTITION_LEASE")
    return f"{set_} s" if set_ else "5 s (the default)"


# ---- the worker: which runs it is running -----------------------------------------------


@dataclass
class Held:
    """When each iteration of each run began on this worker (the machine's
    monotonic clock, which every process reads alike), written as ``{"now":
    ..., "began": {run_id: [...]}}`` to ``path`` on SIGUSR1."""

    path: Path
    began: dict[str, list[float]] = field(default_factory=dict)

    def track(self, handler: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        async def tracked(tc: Any) -> None:
            self.began.setdefault(tc.run_id, []).append(time.monotonic())
            await handler(tc)

        return tracked

    def write(self) -> None:
        part = self.path.with_suffix(".part")
        part.write_text(json.dumps({"now": time.monotonic(), "began": self.began}))
        part.replace(self.path)


async def serve_worker(targets: Sequence[str], c: int) -> None:
    held = Held(Path(os.environ[HELD_FILE]))
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, held.write)
    model_s = int(os.environ.get(MODEL_MS, "0")) / 1000
    await bt.serve_worker(targets, {bt.TASK: held.track(bt.turn_handler(model_s))}, c)


def running(told: Mapping[str, Any], runs: set[str]) -> list[str]:
    """Of ``runs``, those whose latest iteration on the worker that ``told``
    began within ``HELD_WITHIN`` of its telling."""
    now, began = told["now"], told["began"]
    return sorted(r for r in runs & began.keys() if now - began[r][-1] < HELD_WITHIN)


def resumed(told: Mapping[str, Any], runs: set[str], t0: float) -> dict[str, float]:
    """Of ``runs``, those with an iteration begun on the worker that
    ``told`` after ``t0``: seconds from ``t0`` to the first such."""
    out = {}
    for run_id in runs & told["began"].keys():
        if after := [t for t in told["began"][run_id] if t > t0]:
            out[run_id] = min(after) - t0
    return out


# ---- the deployment ---------------------------------------------------------------------


@dataclass
class Servers:
    """One nats-server or a cluster's members."""

    topology: str
    nodes: list[Any]  # dagnats.core.natsserver.NatsServer
    cluster: Any = None  # dagnats.core.natsserver.NatsCluster

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    @property
    def replica_url(self) -> str:
        """Where every replica connects: the first node. Which node a replica
        sends through moves an iteration's messages by up to a quarter (a
        write that enters at its stream leader's node crosses no route), so
        every row sends through the same one."""
        return self.nodes[0].url

    @property
    def copies(self) -> int:
        return len(self.nodes)

    def pids(self) -> dict[str, int]:
        return {f"nats-server {i + 1}": n.pid for i, n in enumerate(self.nodes)}

    def in_msgs(self) -> int:
        return sum(int(bt.get_json(f"{n.monitor_url}/varz")["in_msgs"]) for n in self.nodes)

    def route_msgs(self) -> int:
        """Of ``in_msgs``, those the members sent each other (``/routez``)."""
        return sum(
            int(route.get("in_msgs", 0))
            for n in self.nodes
            for route in bt.get_json(f"{n.monitor_url}/routez").get("routes") or []
        )

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()
        else:
            await self.nodes[0].stop()


async def start_servers(topology: str, data: Path) -> Servers:
    from dagnats.core.natsserver import NatsCluster, NatsServer

    if topology == "cluster":
        cluster = await NatsCluster.start(data / "cluster")
        return Servers(topology, list(cluster.servers), cluster)
    return Servers(topology, [await NatsServer.start(data / "nats", sync_always=True)])


@dataclass
class Replica:
    """A ``dagnats serve all`` process and the worker process polling it."""

    name: str
    served: harness.Served
    worker: subprocess.Popen[bytes]
    held: Path

    def pids(self) -> dict[str, int]:
        return {
            f"services {self.name}": self.served.proc.pid,
            f"worker {self.name}": self.worker.pid,
        }

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for proc in (self.worker, self.served.proc):
            bt.stop_process(proc, sig)


def start_replica(
    name: str,
    servers: Servers,
    env: Mapping[str, str],
    k: Knobs,
    logs: Path,
    model_ms: int,
    under: Callable[[str, str], Sequence[str]] | None = None,
) -> Replica:
    """A replica on ``servers`` and its worker, whose model answers in
    ``model_ms``, once the worker is ready; with ``under``, each process
    runs under the command it gives for the replica and the process's role
    (``services``, ``worker``)."""

    def wrap(role: str) -> Sequence[str]:
        return under(name, role) if under else ()

    served = harness.serve(
        "all",
        servers.replica_url,
        logs / f"{name}.err",
        env=env,
        metrics=True,
        local_socket=logs / f"{name}.sock",
        monitor=servers.nodes[0].monitor_url,
        wrap=wrap("services"),
    )
    held, log = logs / f"{name}.held", logs / f"{name}-worker.log"
    # Room for every run of the largest row: a run's partition, not the
    # worker's room, decides which replica's worker runs it.
    room = k.c * max(k.replicas)
    worker = bt.spawn_worker(
        MODULE,
        [served.target],
        bt.TASK,
        room,
        log,
        env={HELD_FILE: str(held), MODEL_MS: str(model_ms)},
        wrap=wrap("worker"),
    )
    deadline = time.monotonic() + (600 if under else 60)
    while b"worker ready" not in (log.read_bytes() if log.exists() else b""):
        if worker.poll() is not None or time.monotonic() > deadline:
            for proc in (worker, served.proc):
                bt.stop_process(proc)
            raise SystemExit(f"the worker of replica {name} did not start: see {log}")
        time.sleep(0.05)  # the worker's start-up, polled for its line
    return Replica(name, served, worker, held)


def replica_env(servers: Servers, k: Knobs, **extra: str) -> dict[str, str]:
    return {
        "DAGNATS_REPLICAS": str(servers.copies),
        "DAGNATS_PARTITIONS": str(k.partitions),
        **extra,
    }


@dataclass
class Deployment:
    """Servers, their replicas, and how a replica is started again."""

    servers: Servers
    env: dict[str, str]
    k: Knobs
    logs: Path
    model_ms: int  # the workers' model's answer time, one of ``k.paces``
    replicas: list[Replica] = field(default_factory=list)
    started: int = 0
    under: Callable[[str, str], Sequence[str]] | None = None  # see ``start_replica``

    def add(self) -> Replica:
        self.started += 1
        name = f"r{self.started}"
        env = {**self.env, "DAGNATS_REPLICA_ID": name}
        replica = start_replica(
            name, self.servers, env, self.k, self.logs, self.model_ms, self.under
        )
        self.replicas.append(replica)
        return replica

    async def scale(self, n: int, js: Any) -> None:
        """To ``n`` replicas, the newest stopped (SIGTERM) or new ones
        started, until the partitions' owners settle on them."""
        while len(self.replicas) < n:
            self.add()
        while len(self.replicas) > n:
            self.replicas.pop().stop()
        await settled(js, self.names(), self.k.partitions)

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def names(self) -> list[str]:
        return [r.name for r in self.replicas]


async def owners(js: Any, partitions: int) -> list[str | None] | None:
    """Each partition's owner as the ``PARTITIONS`` bucket has it (None:
    none), or None when the engine records no owners."""
    from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError

    try:
        kv = await js.key_value(PARTITIONS_BUCKET)
    except BucketNotFoundError:
        return None
    out: list[str | None] = []
    for p in range(partitions):
        try:
            out.append(((await kv.get(f"owner.{p}")).value or b"").decode() or None)
        except (KeyNotFoundError, KeyDeletedError):
            out.append(None)
    return out


async def settled(js: Any, live: Sequence[str], partitions: int) -> None:
    """Once the engine records owners of partitions (the ``PARTITIONS``
    bucket), until every partition's owner is one of the ``live`` replicas
    (not one stopped before) and the owners are as many as they can be (at
    most 60 s); without it, at once: then every replica consumes every
    partition."""
    deadline = time.monotonic() + 60
    while (found := await owners(js, partitions)) is not None:
        if set(found) <= set(live) and len(set(found)) == min(len(live), partitions):
            return
        if time.monotonic() > deadline:
            bt.progress(f"the partitions' owners did not settle on {sorted(live)}: {found}")
            return
        await asyncio.sleep(0.1)  # the owners move as the replicas hear each other


async def register(target: str) -> None:
    from dagnats.sdk import Client
    from tests.stack import loop_workflow

    async with Client(target) as client:
        await client.register_workflow(loop_workflow(bt.TASK, bt.TASK, max_iterations=100_000))


# ---- thr --------------------------------------------------------------------------------


def snapshot(
    servers: Servers, procs: harness.Procs, metrics: Sequence[str], kinds: mk.Kinds | None
) -> dict[str, Any]:
    return {
        "cpu": procs.cpu(),
        "in_msgs": servers.in_msgs(),
        "route_msgs": servers.route_msgs(),
        "counters": bt.scrape({url: url for url in metrics}),
        "kinds": kinds.snapshot() if kinds is not None else {},
    }


def row_result(
    replicas: int,
    walls: Sequence[float],
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    k: Knobs,
) -> dict[str, Any]:
    """One row from the timed rounds' walls and the snapshots around them."""
    its = len(walls) * k.c * k.k
    cpu = {
        name: round((after["cpu"][name] - before["cpu"][name]) * 1000 / its, 4)
        for name in before["cpu"]
    }
    counters = bt.per_iteration(before["counters"], after["counters"], its, 4)
    return {
        "replicas": replicas,
        "iterations_per_s": round(statistics.median(k.c * k.k / w for w in walls), 1),
        "rounds_iterations_per_s": sorted(round(k.c * k.k / w, 1) for w in walls),
        "in_msgs_per_iteration": round((after["in_msgs"] - before["in_msgs"]) / its, 3),
        "route_msgs_per_iteration": round((after["route_msgs"] - before["route_msgs"]) / its, 3),
        "cpu_ms_per_iteration": cpu,
        "cpu_ms_all": round(sum(v for n, v in cpu.items() if n != "client"), 4),
        "cpu_ms_services": round(sum(v for n, v in cpu.items() if n.startswith("services")), 4),
        "guess_missed_per_iteration": counters.get("guess_missed", 0.0),
        "counters_per_iteration": counters,
        "kinds_per_iteration": mk.per_iteration(
            before.get("kinds", {}), after.get("kinds", {}), its
        ),
        "iterations": its,
    }


def runs_at_once(c: int, replicas: int, model_ms: int) -> int:
    """The runs a ``thr`` row carries at once: C for each replica while the
    model sets each run's pace, C in all when the model answers at once
    and the two cores set it (see the module's docstring)."""
    return c * replicas if model_ms > 0 else c


async def measure_row(
    servers: Servers,
    replicas: Sequence[Replica],
    k: Knobs,
    model_ms: int,
    kinds: mk.Kinds | None = None,
) -> dict[str, Any]:
    """``thr`` with ``replicas``, :func:`runs_at_once` runs at once, started
    on each replica in turn."""
    from dagnats.sdk import Client

    k = dataclasses.replace(k, c=runs_at_once(k.c, len(replicas), model_ms))
    pids = servers.pids()
    for r in replicas:
        pids |= r.pids()
    procs = harness.Procs(pids)
    metrics = [r.served.metrics for r in replicas if r.served.metrics]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Client(r.served.target)) for r in replicas]
        for client in clients:
            await client.run(bt.TASK, {"k": 1}, timeout=60)
        run = harness.runner(clients)
        load = os.getloadavg()[0]
        finished = 0

        async def one() -> None:
            nonlocal finished
            await run(k.k)  # it stops the bench unless it answered as the workload does
            finished += 1

        async def round_() -> None:
            await asyncio.gather(*(one() for _ in range(k.c)))

        await round_()
        before = snapshot(servers, procs, metrics, kinds)
        walls = []
        for n in range(k.rounds):
            walls.append(await bt.timed(round_))
            bt.progress(f"{servers.topology}, {len(replicas)} replicas: round {n + 1}/{k.rounds}")
        after = snapshot(servers, procs, metrics, kinds)
    out = row_result(len(replicas), walls, before, after, k)
    out["runs_at_once"] = k.c
    out["slowest_round_s"] = round(max(walls), 2)
    out["runs_finished"] = finished
    out["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return out


async def rows_of(topology: str, k: Knobs, model_ms: int, data: Path) -> list[dict[str, Any]]:
    """The ``thr`` rows of a topology, its workers' model answering in
    ``model_ms``, on one deployment: a row of one
    replica to warm it up (kept, marked, in no summary), then
    ``BENCH_REPEATS`` passes over the counts of replicas in turn, replicas
    added or stopped (SIGTERM) between rows, so that the machine's drift
    falls on every count alike."""
    import nats

    logs = data / "logs"
    logs.mkdir(parents=True)
    servers = await start_servers(topology, data)
    d = Deployment(servers, replica_env(servers, k), k, logs, model_ms)
    kinds = mk.Kinds() if k.kinds else None
    try:
        nc = await nats.connect(servers.url.split(","), name="bench-replicas")
        if kinds is not None:
            await kinds.start(servers.url.split(","))
        d.add()
        await register(d.replicas[0].served.target)
        await settled(nc.jetstream(), d.names(), k.partitions)
        out = [{**await measure_row(servers, d.replicas, k, model_ms, kinds), "warm_up": True}]
        for repeat in range(k.repeats):
            for n in k.replicas:
                await d.scale(n, nc.jetstream())
                row = await measure_row(servers, d.replicas, k, model_ms, kinds)
                out.append({**row, "repeat": repeat + 1})
        await nc.close()
        for r in d.replicas:
            for proc in (r.served.proc, r.worker):
                if proc.poll() is not None:
                    raise SystemExit(f"replica {r.name} exited early (logs in {logs})")
        return out
    finally:
        if kinds is not None:
            await kinds.stop()
        d.stop()
        await servers.stop()


# ---- failover ---------------------------------------------------------------------------


async def told(replica: Replica) -> dict[str, Any]:
    """What the replica's worker tells of the runs it ran (``Held``)."""
    replica.held.unlink(missing_ok=True)
    os.kill(replica.worker.pid, signal.SIGUSR1)
    await bt.wait_until(replica.held.exists, 10, f"replica {replica.name}'s runs")
    got: dict[str, Any] = json.loads(replica.held.read_text())
    return got


async def held_runs(replica: Replica, runs: set[str], least: int) -> list[str]:
    """Of ``runs``, those the replica's worker is running, once at least
    ``least`` (or one after 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        found = running(await told(replica), runs)
        if len(found) >= least or (found and time.monotonic() > deadline):
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica.name}'s worker ran none of the runs in 30 s")
        await asyncio.sleep(0.05)  # the runs are being started


async def resumed_elsewhere(
    others: Sequence[Replica], runs: set[str], t0: float, most: float
) -> dict[str, float]:
    """Seconds from ``t0`` until an iteration of each of ``runs`` began on
    the worker of one of ``others``, once all have (or ``most`` seconds
    passed: those that had not are left out)."""
    deadline = time.monotonic() + most
    while True:
        found: dict[str, float] = {}
        for replica in others:
            for run_id, s in resumed(await told(replica), runs, t0).items():
                found[run_id] = min(s, found.get(run_id, s))
        if found.keys() == runs or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)  # the runs wait out their leases


def gone(proc: subprocess.Popen[Any]) -> None:
    """Once ``proc``, signalled, has exited (killed after 30 s)."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class Moving:
    """When each watched run next had a journal record or a run write, in
    seconds from ``t0``; what comes before ``armed`` is not counted."""

    t0: float = 0.0
    armed: bool = False
    moved: dict[str, float] = field(default_factory=dict)

    def on(self, run_id: str) -> Callable[[Any], Awaitable[None]]:
        async def seen(msg: Any) -> None:
            if self.armed and run_id not in self.moved:
                self.moved[run_id] = time.monotonic() - self.t0

        return seen


async def one_stop(nc: Any, d: Deployment, victim: int, how: str) -> dict[str, Any]:
    """Stop replica ``victim`` (``how``: kill or term) and its worker while
    the worker runs some of ``k.c`` new runs; seconds from the signal to each
    of those runs moving again elsewhere; the replica started again, and
    every run completed with the workload's answer."""
    from dagnats.core.jetstream import KV_RUNS
    from dagnats.core.subjects import kv_key, run_journal
    from dagnats.engine.v1 import engine_pb2 as pb
    from dagnats.sdk import Client

    k = d.k
    dead = d.replicas[victim]
    others = [r for r in d.replicas if r is not dead]
    async with contextlib.AsyncExitStack() as stack:
        survivors = [await stack.enter_async_context(Client(r.served.target)) for r in others]
        run_ids: list[str] = []
        async with Client(dead.served.target) as own:
            clients = [own, *survivors]
            for i in range(k.c):
                started = await clients[i % len(clients)].start_run(bt.TASK, {"k": k.failover_k})
                run_ids.append(started.run_id)
            held = await held_runs(dead, set(run_ids), max(1, k.c // (2 * len(clients))))
        moving = Moving()
        subs = []
        for run_id in held:
            for subject in (run_journal(run_id), kv_key(KV_RUNS, run_id)):
                subs.append(await nc.subscribe(subject, cb=moving.on(run_id)))
        await nc.flush()
        label, sig = STOPS[how]
        moving.t0 = time.monotonic()
        for proc in (dead.worker, dead.served.proc):
            proc.send_signal(sig)
        for proc in (dead.worker, dead.served.proc):
            await asyncio.to_thread(gone, proc)
        exited = time.monotonic() - moving.t0
        await nc.flush()  # what the stopped processes sent has been seen before this
        moving.armed = True
        most = 4 * k.ack_wait + 60
        with contextlib.suppress(SystemExit):  # a run that does not move is counted
            await bt.wait_until(lambda: len(moving.moved) == len(held), most, "the runs to move")
        for sub in subs:
            await sub.unsubscribe()
        elsewhere = await resumed_elsewhere(others, set(held), moving.t0, most)
        bt.progress(
            f"{label} of {dead.name}: {len(elsewhere)} of {len(held)} runs began an iteration "
            f"elsewhere, the last after {max(elsewhere.values(), default=0):.2f}s"
        )
        d.replicas.remove(dead)
        await asyncio.to_thread(d.add)
        for run_id in run_ids:
            run = await survivors[0].wait_for_run(run_id, timeout=120 + k.failover_k)
            answer = json.loads(run.output) if run.output else None
            expected = bt.tool_output({"n": k.failover_k - 1})
            if run.status != pb.RUN_STATUS_COMPLETED or answer != expected:
                raise SystemExit(f"run {run_id} did not complete after {label}: {run}")
    return {
        "victim": dead.name,
        "held": len(held),
        "moved_s": sorted(round(s, 3) for s in elsewhere.values()),
        "not_moved": len(held) - len(elsewhere),
        "record_s": sorted(round(s, 3) for s in moving.moved.values()),
        "exited_s": round(exited, 3),
        "runs_completed": len(run_ids),
    }


def stops_result(stops: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The stops of one kind as one: p50, p99 and the most of every run's
    seconds to move again, and the runs that did not."""
    moved = [s for stop in stops for s in stop["moved_s"]]
    records = [s for stop in stops for s in stop["record_s"]]
    return {
        "stops": len(stops),
        "runs": sum(stop["held"] for stop in stops),
        "not_moved": sum(stop["not_moved"] for stop in stops),
        "p50_s": bt.pct(moved, 50),
        "p99_s": bt.pct(moved, 99),
        "max_s": max(moved, default=float("nan")),
        "record_p50_s": bt.pct(records, 50),
        "exited_p50_s": bt.pct([stop["exited_s"] for stop in stops], 50),
        "each": list(stops),
    }


async def failover(topology: str, k: Knobs, data: Path) -> dict[str, Any]:
    """``k.kills`` stops of each kind of one of 3 replicas, on a deployment
    of their own with the task's lease at ``k.ack_wait``."""
    import nats

    logs = data / "logs"
    logs.mkdir(parents=True)
    servers = await start_servers(topology, data)
    env = replica_env(servers, k, DAGNATS_TASK_ACK_WAIT=str(k.ack_wait))
    d = Deployment(servers, env, k, logs, k.paces[0])
    try:
        for _ in range(3):
            d.add()
        await register(d.replicas[0].served.target)
        nc = await nats.connect(servers.url.split(","), name="bench-replicas")
        out: dict[str, Any] = {}
        for how in STOPS:
            stops = []
            for n in range(k.kills):
                await settled(nc.jetstream(), d.names(), k.partitions)
                stops.append(await one_stop(nc, d, n % len(d.replicas), how))
            out[how] = stops_result(stops)
        await nc.close()
        return out
    finally:
        d.stop()
        await servers.stop()


# ---- the report -------------------------------------------------------------------------


def thr_key(topology: str, model_ms: int) -> str:
    """The key of a deployment's rows: its topology, and the model's answer
    time when the model does not answer at once."""
    return f"{topology}/{model_ms}" if model_ms else topology


def where(key: str) -> str:
    """The words for a deployment's key (``thr_key``)."""
    topology, _, model_ms = key.partition("/")
    return TOPOLOGIES[topology] + (f", model {model_ms} ms" if model_ms else "")


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "n/a"


COSTS = (
    "iterations_per_s",
    "in_msgs_per_iteration",
    "route_msgs_per_iteration",
    "cpu_ms_all",
    "cpu_ms_services",
)


def summary(got: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A topology's measured rows (the warm-up left out), one per count of
    replicas: the median of each cost over the repeats, the range of CPU
    an iteration, the slowest round of any repeat and the runs finished."""
    counts = sorted({r["replicas"] for r in got if not r.get("warm_up")})
    out = []
    for n in counts:
        rows = [r for r in got if r["replicas"] == n and not r.get("warm_up")]
        cpu = [r["cpu_ms_all"] for r in rows]
        kinds = [r.get("kinds_per_iteration", {}) for r in rows]
        out.append(
            {
                "replicas": n,
                "runs_at_once": rows[0].get("runs_at_once", 0),
                "repeats": len(rows),
                **{key: statistics.median(r.get(key, 0.0) for r in rows) for key in COSTS},
                "cpu_ms_all_range": (min(cpu), max(cpu)),
                "guess_missed_per_iteration": max(r["guess_missed_per_iteration"] for r in rows),
                "slowest_round_s": max(r.get("slowest_round_s", 0.0) for r in rows),
                "runs_finished": sum(r["runs_finished"] for r in rows),
                "kinds_per_iteration": {
                    name: statistics.median(k.get(name, 0.0) for k in kinds)
                    for name in sorted({name for k in kinds for name in k})
                },
            }
        )
    return out


def thr_table(rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Per topology and count of replicas, the medians over the repeats,
    each beside one replica's."""
    head = (
        "| topology | replicas | runs at once | iterations/s | x 1 | msgs into nats-server /it "
        "| x 1 | of which between members /it | x 1 | CPU ms/it, all | x 1 "
        "| CPU ms/it, services | x 1 | CPU ms/it, all: range "
        "| guesses missed /it | slowest round s | runs finished |"
    )
    lines = [head, "|" + "---|" * 17]
    for deployment, got in rows.items():
        summed = summary(got)
        one = next(r for r in summed if r["replicas"] == 1)
        for r in summed:
            cells = [where(deployment), str(r["replicas"]), str(r["runs_at_once"])]
            formats = ("{:.0f}", "{:.2f}", "{:.2f}", "{:.3f}", "{:.3f}")
            for key, fmt in zip(COSTS, formats, strict=True):
                cells += [fmt.format(r[key]), ratio(r[key], one[key])]
            low, high = r["cpu_ms_all_range"]
            cells += [f"{low:.3f}-{high:.3f}", f"{r['guess_missed_per_iteration']:.3f}"]
            cells += [f"{r['slowest_round_s']:.1f}", str(r["runs_finished"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kinds_table(rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Per deployment, each kind's messages an iteration (``BENCH_KINDS``),
    the median over the passes of each count of replicas (:func:`summary`)."""
    lines = []
    for deployment, got in rows.items():
        summed = summary(got)
        names = sorted({name for r in summed for name in r["kinds_per_iteration"]})
        lines += [f"{where(deployment)}, messages an iteration by kind:", ""]
        lines.append("| kind | " + " | ".join(f"{r['replicas']} replicas" for r in summed) + " |")
        lines.append("|" + "---|" * (len(summed) + 1))
        for name in names:
            cells = [r["kinds_per_iteration"].get(name, 0.0) for r in summed]
            if any(round(c, 3) for c in cells):  # not one run's own subject, seen once
                lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def bars(rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[tuple[str, bool]]:
    """The issue's bars on the medians of ``thr``, each with whether this
    run met it: messages into nats-server an iteration within 10% of one
    replica's, with every count of replicas; 2 replicas' throughput at least
    one's. CPU an iteration is checked on instructions (the ``instructions``
    part): CPU seconds rise on two cores with the processes sharing them,
    for the same work."""
    found = []
    for deployment, got in rows.items():
        summed, words = summary(got), where(deployment)
        one = next(r for r in summed if r["replicas"] == 1)
        for r in summed:
            n = r["replicas"]
            if n == 1:
                continue
            key = "in_msgs_per_iteration"
            x = r[key] / one[key] if one[key] else float("inf")
            found.append(
                (
                    f"{words}, {n} replicas: messages into nats-server /it {x:.2f}x of 1's "
                    f"(<= {BAR})",
                    x <= BAR,
                )
            )
            if n == 2:
                x = r["iterations_per_s"] / one["iterations_per_s"]
                found.append((f"{words}, 2 replicas: iterations/s {x:.2f}x of 1's (>= 1)", x >= 1))
    return found


def failover_table(got: Mapping[str, Mapping[str, Any]], k: Knobs) -> str:
    lines = [
        "| topology | stop | stops | runs | p50 s | p99 s | max s | not moving "
        "| exited p50 s | record p50 s |",
        "|" + "---|" * 10,
    ]
    for topology, kinds in got.items():
        for how, r in kinds.items():
            cells = [TOPOLOGIES[topology], STOPS[how][0], str(r["stops"]), str(r["runs"])]
            cells += [f"{r[x]:.2f}" for x in ("p50_s", "p99_s", "max_s")]
            cells.append(str(r["not_moved"]))
            cells += [f"{r[x]:.2f}" for x in ("exited_p50_s", "record_p50_s")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def met(found: Sequence[tuple[str, bool]]) -> list[str]:
    """Each bar's line: what was measured against it, and whether it was met."""
    return [f"- {text}: {'met' if ok else 'MISSED'}" for text, ok in found]


def report(got: Mapping[str, Any], k: Knobs) -> str:
    """The markdown the bench prints."""
    out = [
        f"replicas: P={k.partitions}, K={k.k}, C={k.c} runs at once "
        "(a replica's with the model paced, in all when it answers at once), "
        f"the model answering in {' and '.join(map(str, k.paces))} ms, "
        f"{k.rounds} timed rounds a row, {k.repeats} passes over the rows (medians); "
        f"{got['cpus']} cores, load {got['load']['start'][0]:.2f} at start, "
        f"{got['load']['end'][0]:.2f} at end; dagnats {got['commit']}; {got['seconds']:.0f}s",
        "",
        thr_table(got["thr"]),
        "",
        *([kinds_table(got["thr"]), ""] if k.kinds else []),
        "bars (issue 40):",
    ]
    out += met(bars(got["thr"]))
    if got.get("instructions"):
        from bench import replica_instructions as ri

        out += [
            "",
            f"instructions (callgrind) of the replicas' processes an iteration: "
            f"{k.c_counted} runs a replica, the model answering in {k.model_ms_counted} ms, "
            f"{k.instructions} s counted a row, {k.repeats} passes (medians)",
            "",
            ri.table(got["instructions"]),
            "",
            "bars (issue 40), CPU as instructions:",
        ]
        out += met(ri.bars(got["instructions"]))
    else:
        out.append("- CPU an iteration: not counted (BENCH_INSTRUCTIONS=0)")
    if got.get("failover"):
        out += [
            "",
            f"failover: runs of {k.failover_k} iterations, C={k.c}; the task's lease "
            f"(DAGNATS_TASK_ACK_WAIT) {k.ack_wait} s for this phase (30 s by default), "
            f"the partition lease (DAGNATS_PARTITION_LEASE) {partition_lease()}; "
            "seconds from the signal to an iteration of a run the stopped replica's worker was "
            "running beginning on another replica's worker; exited: to the stopped processes' "
            "exit; record: to the run's first journal record or run write after that exit",
            "",
            failover_table(got["failover"], k),
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["worker"]:
        asyncio.run(serve_worker(args[1].split(","), int(args[3])))
        return
    json_out = None
    if args[:1] == ["--json"] and len(args) == 2:
        json_out = Path(args[1])
    elif args:
        raise SystemExit(f"usage: python -m {MODULE} [--json PATH] (knobs: BENCH_*); got {args}")
    k = Knobs.from_env(os.environ)
    got = asyncio.run(measure(k))
    print(report(got, k))
    if json_out is not None:
        json_out.write_text(json.dumps(got, indent=1))
        print(f"\nwrote {json_out}")


@contextlib.contextmanager
def kept_on_failure(prefix: str) -> Iterator[str]:
    """A temporary directory, removed when the block ends well and kept
    (its path printed) when it raises, or always with ``BENCH_KEEP`` set:
    the replicas' logs say what failed, and callgrind's dumps where the
    instructions went (``callgrind_annotate``)."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield tmp
    except BaseException:
        print(f"the replicas' data and logs are kept in {tmp}", file=sys.stderr)
        raise
    if os.environ.get("BENCH_KEEP"):
        print(f"the replicas' data and logs are kept in {tmp}", file=sys.stderr)
        return
    shutil.rmtree(tmp, ignore_errors=True)


async def measure(k: Knobs) -> dict[str, Any]:
    """Every row and every stop, with the knobs and the machine's load."""
    started, load = time.perf_counter(), os.getloadavg()
    got: dict[str, Any] = {"thr": {}, "instructions": {}, "failover": {}}
    with kept_on_failure(prefix="dagnats-bench-replicas-") as tmp:
        for topology in k.topologies:
            for pace in k.paces:
                key = thr_key(topology, pace)
                bt.progress(f"thr on {where(key)}: {', '.join(map(str, k.replicas))} replicas")
                got["thr"][key] = await rows_of(
                    topology, k, pace, Path(tmp) / f"thr-{topology}-{pace}"
                )
        for topology in k.topologies if k.instructions else ():
            from bench import replica_instructions as ri

            got["instructions"][topology] = await ri.rows_of(
                topology, k, Path(tmp) / f"instructions-{topology}"
            )
        for topology in k.topologies if k.kills else ():
            bt.progress(f"failover on {TOPOLOGIES[topology]}: {k.kills} stops of each kind")
            got["failover"][topology] = await failover(topology, k, Path(tmp) / f"stop-{topology}")
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": bt._git_head(),
        "cpus": os.cpu_count(),
        "load": {"start": load, "end": os.getloadavg()},
        "seconds": time.perf_counter() - started,
        "knobs": asdict(k),
        "partition_lease": partition_lease(),
        **got,
    }


if __name__ == "__main__":
    main()
