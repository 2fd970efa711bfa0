"""What the replicas' processes execute an iteration, counted in
instructions, with 1, 2 and 3 replicas: the ``instructions`` part of
``make bench-replicas``.

CPU seconds an iteration rise on a machine of two cores with every process
that wakes on them, for work that is the same in every row (the workers'
do, by construction): they cannot tell what a replica's work an iteration
becomes as replicas are added. Instructions can: ``valgrind --tool=callgrind``
counts what a process executes, the same for the same work however busy the
machine is.

On one deployment of each topology, every replica's ``serve all`` process
and its worker run under callgrind (about fifty times slower), all alike:
a replica slower than the others would see its tasks taken by the others'
workers (a poll pulls the partitions its replica does not own after
``STANDBY_DELAY``), which is not what N replicas of one speed do. Each row
gives every replica ``BENCH_C_COUNTED`` (2) runs of its own partitions (runs
started on the replicas in turn; a run whose partition's owner has its share
already is cancelled at once), whose model answers in
``BENCH_MODEL_MS_COUNTED`` (500) ms, so that each replica goes at its own
pace, as on N machines. After a warm-up, callgrind's counters of every
process are dumped at the start and at the end of ``BENCH_INSTRUCTIONS``
(40) seconds; the iterations the workers began in between divide them: the
services' instructions and the workers', each summed over the replicas.
``BENCH_REPEATS`` passes over the counts, up and down in turn (1, 2, 3, then
3, 2, 1), so that fewer replicas start under callgrind (a minute each); the
runs are cancelled after each row.

Under callgrind the replicas go slower than natively, so what waits on time
(polls, leases, a run's write held up to 0.2 s) falls on fewer iterations
than natively: the counts are for comparing rows, not for adding up to a
native iteration's cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import bench_replicas as br
from bench import bench_turn as bt

ROLES = ("services", "worker")  # a replica's processes, each counted
LONG = 50_000  # iterations of a counted row's run: more than a row runs; it is cancelled


def callgrind(logs: Path) -> Callable[[str, str], Sequence[str]]:
    """The command a replica's process of ``role`` runs under: callgrind,
    dumping to ``logs/<replica>-<role>.<pid>.<part>``, no line numbers kept."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("the instructions part needs valgrind (apt install valgrind)")

    def under(name: str, role: str) -> Sequence[str]:
        out = f"--callgrind-out-file={logs / name}-{role}.%p"
        return ("valgrind", "--tool=callgrind", "--dump-line=no", out)

    return under


def dumped(pid: int, prefix: Path) -> int:
    """Instructions ``pid`` executed since its last dump (or start): a dump
    asked of its callgrind (``callgrind_control -d``), its ``summary``."""
    parts = set(prefix.parent.glob(f"{prefix.name}.{pid}.*"))
    done = subprocess.run(
        ["callgrind_control", "-d", str(pid)], capture_output=True, text=True, timeout=120
    )
    new = set(prefix.parent.glob(f"{prefix.name}.{pid}.*")) - parts
    if done.returncode or len(new) != 1:
        raise SystemExit(f"no callgrind dump of process {pid}: {done.stdout}{done.stderr}")
    for line in new.pop().read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit(f"callgrind's dump of process {pid} has no summary")


async def dump_all(replicas: Sequence[br.Replica], logs: Path) -> dict[str, int]:
    """Every replica's processes dumped at once: the instructions each role
    executed since the last dump, summed over the replicas."""
    procs = [
        (role, pid, logs / f"{r.name}-{role}")
        for r in replicas
        for role, pid in zip(ROLES, (r.served.proc.pid, r.worker.pid), strict=True)
    ]
    got = await asyncio.gather(
        *(asyncio.to_thread(dumped, pid, prefix) for _, pid, prefix in procs)
    )
    return {
        role: sum(n for (r, _, _), n in zip(procs, got, strict=True) if r == role) for role in ROLES
    }


async def place(clients: Sequence[Any], owner: Sequence[str | None], c: int) -> dict[str, str]:
    """``c`` long runs for each live replica, of its own partitions: runs
    started on ``clients`` in turn, one whose owner has its share cancelled
    at once. Returns the kept runs, each with its owner."""
    from dagnats.core.partitions import partition_of

    want = {name: c for name in set(owner) if name is not None}
    kept: dict[str, str] = {}
    tries = 0
    while any(want.values()):
        if tries > 50 * c * len(want):
            raise SystemExit(f"the runs did not spread over the replicas: {want} still wanted")
        client = clients[tries % len(clients)]
        tries += 1
        run = await client.start_run(bt.TASK, {"k": LONG})
        name = owner[partition_of(run.run_id, len(owner))]
        if name is not None and want.get(name):
            want[name] -= 1
            kept[run.run_id] = name
        else:
            await client.cancel_run(run.run_id, "spare")
    return kept


def began_within(told: Mapping[str, Any], t0: float, t1: float) -> int:
    """Iterations the worker that ``told`` began between ``t0`` and ``t1``."""
    return sum(t0 <= t < t1 for times in told["began"].values() for t in times)


async def count_row(nc: Any, d: br.Deployment, k: br.Knobs) -> dict[str, Any]:
    """One row: every replica's share of runs, the warm-up, the counted
    window, the runs cancelled."""
    from dagnats.sdk import Client

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Client(r.served.target)) for r in d.replicas]
        owner = await br.owners(nc.jetstream(), k.partitions)
        if owner is None:
            raise SystemExit("the engine records no owners of partitions")
        runs = await place(clients, owner, k.c_counted)
        await asyncio.sleep(max(10, k.instructions // 3))  # the warm-up, a wall time
        metrics = {r.name: r.served.metrics or "" for r in d.replicas}
        await dump_all(d.replicas, d.logs)
        t0, msgs0, counters0 = time.monotonic(), d.servers.in_msgs(), bt.scrape(metrics)
        await asyncio.sleep(k.instructions)  # the counted window, a wall time
        t1, msgs1, counters1 = time.monotonic(), d.servers.in_msgs(), bt.scrape(metrics)
        executed = await dump_all(d.replicas, d.logs)
        began = {r.name: began_within(await br.told(r), t0, t1) for r in d.replicas}
        for run_id in runs:
            await clients[0].cancel_run(run_id, "row ended")
        for run_id in runs:
            await clients[0].wait_for_run(run_id, timeout=120)
    every = sum(began.values())
    if not all(began.values()):
        raise SystemExit(f"a replica's worker began no iteration in the window: {began}")
    return {
        "replicas": len(d.replicas),
        "runs_a_replica": k.c_counted,
        "iterations": every,
        "iterations_per_s": round(every / (t1 - t0), 2),
        "iterations_by_worker": began,
        "instructions_per_iteration": {role: executed[role] / every for role in ROLES},
        "in_msgs_per_iteration": round((msgs1 - msgs0) / every, 3),
        "counters_per_iteration": bt.per_iteration(counters0, counters1, every, 3),
    }


async def rows_of(topology: str, k: br.Knobs, data: Path) -> list[dict[str, Any]]:
    """The counted rows of a topology on one deployment, every replica under
    callgrind, replicas added and stopped between rows, ``BENCH_REPEATS``
    passes over the counts, up and down in turn."""
    import nats

    logs = data / "logs"
    logs.mkdir(parents=True)
    servers = await br.start_servers(topology, data)
    d = br.Deployment(
        servers, br.replica_env(servers, k), k, logs, k.model_ms_counted, under=callgrind(logs)
    )
    where = br.TOPOLOGIES[topology]
    try:
        bt.progress(f"instructions on {where}: starting r1 under callgrind (a minute)")
        await br.register(d.add().served.target)
        nc = await nats.connect(servers.url.split(","), name="bench-replicas")
        out = []
        for repeat in range(k.repeats):
            for n in k.replicas if repeat % 2 == 0 else k.replicas[::-1]:
                await d.scale(n, nc.jetstream())
                row = await count_row(nc, d, k)
                out.append({**row, "repeat": repeat + 1})
                per = row["instructions_per_iteration"]
                bt.progress(
                    f"instructions on {where}, {n} replicas: {per['services'] / 1e6:.2f} M "
                    f"(services), {per['worker'] / 1e6:.2f} M (worker) an iteration, "
                    f"{row['iterations']} iterations"
                )
        await nc.close()
        return out
    finally:
        d.stop()
        await servers.stop()


def summary(got: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per count of replicas, the medians over the repeats."""
    out = []
    for n in sorted({r["replicas"] for r in got}):
        rows = [r for r in got if r["replicas"] == n]
        per = {
            role: statistics.median(r["instructions_per_iteration"][role] for r in rows)
            for role in ROLES
        }
        out.append(
            {
                "replicas": n,
                "repeats": len(rows),
                "instructions_per_iteration": per,
                "services_range": (
                    min(r["instructions_per_iteration"]["services"] for r in rows),
                    max(r["instructions_per_iteration"]["services"] for r in rows),
                ),
                "iterations_per_s": statistics.median(r["iterations_per_s"] for r in rows),
                "in_msgs_per_iteration": statistics.median(
                    r["in_msgs_per_iteration"] for r in rows
                ),
            }
        )
    return out


def table(got: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Per topology and count of replicas, the replicas' instructions an
    iteration beside one replica's."""
    lines = [
        "| topology | replicas | iterations/s | services, M instructions /it | x 1 "
        "| services: range | worker, M instructions /it | x 1 | msgs into nats-server /it | x 1 |",
        "|" + "---|" * 10,
    ]
    for topology, rows in got.items():
        summed = summary(rows)
        one = summed[0]
        for r in summed:
            per, base = r["instructions_per_iteration"], one["instructions_per_iteration"]
            low, high = r["services_range"]
            cells = [br.TOPOLOGIES[topology], str(r["replicas"])]
            cells.append(f"{r['iterations_per_s']:.1f}")
            cells += [f"{per['services'] / 1e6:.2f}", br.ratio(per["services"], base["services"])]
            cells.append(f"{low / 1e6:.2f}-{high / 1e6:.2f}")
            cells += [f"{per['worker'] / 1e6:.2f}", br.ratio(per["worker"], base["worker"])]
            cells.append(f"{r['in_msgs_per_iteration']:.2f}")
            cells.append(br.ratio(r["in_msgs_per_iteration"], one["in_msgs_per_iteration"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bars(got: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[tuple[str, bool]]:
    """The issue's CPU bar on instructions: the replicas' processes an
    iteration within 10% of one replica's, with every count."""
    found = []
    for topology, rows in got.items():
        summed = summary(rows)
        one = summed[0]["instructions_per_iteration"]
        for r in summed[1:]:
            per = r["instructions_per_iteration"]
            x = sum(per.values()) / sum(one.values())
            found.append(
                (
                    f"{br.TOPOLOGIES[topology]}, {r['replicas']} replicas: instructions /it of "
                    f"the replicas' processes {x:.2f}x of 1's (<= {br.BAR})",
                    x <= br.BAR,
                )
            )
    return found
