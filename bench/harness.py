"""What the benches that deploy the product share: its processes (``dagnats
serve`` started and read for its addresses), their CPU and memory from
``/proc``, and the ``thr`` measure of the agent-turn workload over runs
started on several engines (``bench/bench_scale.py``,
``bench/bench_replicas.py``)."""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import bench_turn as bt

# ---- the processes ----------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no VmRSS for process {pid}")


@dataclass
class Procs:
    """The processes of a deployment by name, this one (the client) aside."""

    pids: dict[str, int]

    def cpu(self) -> dict[str, float]:
        seconds = {name: bt.cpu_seconds(pid) for name, pid in self.pids.items()}
        return {**seconds, "client": bt.cpu_seconds(os.getpid())}

    def rss(self) -> dict[str, int]:
        return {name: rss_bytes(pid) for name, pid in self.pids.items()}


def per_second(
    before: Mapping[str, float], after: Mapping[str, float], seconds: float
) -> dict[str, float]:
    """CPU seconds per second (1.0 is one core busy) of each process."""
    return {name: round((after[name] - before[name]) / seconds, 4) for name in before}


@dataclass
class Served:
    """A ``dagnats serve`` process and what it printed once it served."""

    proc: subprocess.Popen[str]
    target: str  # its gRPC address
    metrics: str | None = None  # its ``/metrics`` URL (``--metrics-port``)
    local_socket: str | None = None  # its local socket's path (``--local-socket``)


def serve(
    service: str,
    nats_url: str,
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    metrics: bool = False,
    local_socket: Path | None = None,
    monitor: str | None = None,
    wrap: Sequence[str] = (),
) -> Served:
    """``dagnats serve SERVICE`` on a free port against ``nats_url``, its
    stderr appended to ``log``, this process's environment with ``env`` over
    it; with ``metrics``, its counters on a free port; with ``local_socket``,
    the local socket at that path; with ``monitor``, nats-server's monitoring
    URL (the start-up check of ``sync_interval``); with ``wrap``, the
    command run under it (``valgrind ...``). Returns once it printed every
    address asked for."""
    verbose = ["-v"] if os.environ.get("BENCH_VERBOSE") else []  # every lease logged
    args = [*wrap, sys.executable, "-m", "dagnats.cli.main", *verbose, "serve", service]
    args += ["--port", "0"]
    args += ["--nats", nats_url]
    args += ["--nats-monitor", monitor] if monitor else []
    args += ["--metrics-port", "0"] if metrics else []
    args += ["--local-socket", str(local_socket)] if local_socket else []
    with log.open("a") as err:
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})}
        )
    assert proc.stdout is not None
    served = Served(proc, "")
    for line in proc.stdout:
        if " serving on " in line:
            served.target = line.rpartition(" serving on ")[2].split()[0]
        elif line.startswith("metrics on "):
            served.metrics = line.split()[-1]
        elif line.startswith("local socket on "):
            served.local_socket = line.split()[-1]
        if (
            served.target
            and (served.metrics is not None or not metrics)
            and (served.local_socket is not None or local_socket is None)
        ):
            return served
    proc.kill()
    proc.wait()
    raise SystemExit(f"dagnats serve {service} exited {proc.returncode}: see {log}")


# ---- the agent-turn workload's throughput -----------------------------------------------


def runner(clients: Sequence[Any]) -> Callable[[int], Awaitable[None]]:
    """A run of the workload, started on each of ``clients`` in turn; one
    that does not end with the workload's answer stops the bench."""
    turns = itertools.cycle(clients)

    async def run(n: int) -> None:
        out = await next(turns).run(bt.TASK, {"k": n}, timeout=120 + n)
        if out != bt.tool_output({"n": n - 1}):
            raise SystemExit(f"a run of {n} answered {out!r}")

    return run


async def thr_of(
    name: str,
    p: bt.Params,
    run: Callable[[int], Awaitable[Any]],
    cpu: Callable[[], dict[str, float]],
) -> dict[str, Any]:
    """``thr`` of the agent-turn bench (``p.c`` runs at once, a round untimed,
    then ``p.thr_rounds``): the median round's steps/s, every round's, the
    CPU ms a step of each process, the load before and after."""
    measured = bt.Measured()
    load = os.getloadavg()[0]
    await bt.phases(name, p, run, cpu, measured, "thr")
    thr = bt.thr_result(measured.thr, p.c, p.k)
    return {
        "steps_per_s": thr["steps_per_s"]["median"],
        "rounds_steps_per_s": [
            round(x, 1) for x in sorted(thr["steps_per_round"] / w for w in measured.thr)
        ],
        "cpu_ms_per_step": measured.cpu,
        "load": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def pooled(*measured: Mapping[str, Any]) -> dict[str, Any]:
    """Rounds of several ``thr`` measures as one: the median round, the mean CPU."""
    rounds = [x for m in measured for x in m["rounds_steps_per_s"]]
    names = measured[0]["cpu_ms_per_step"]
    cpu = {n: round(statistics.fmean(m["cpu_ms_per_step"][n] for m in measured), 4) for n in names}
    return {"steps_per_s": statistics.median(rounds), "rounds": len(rounds), "cpu_ms_per_step": cpu}
