"""The agent-turn workload through the product as a user deploys it, beside
the raw JetStream floor measured in the same run.

Run with ``make bench`` or ``python -m bench.bench_turn``.

The workload is the peers' (``BENCH_K`` = 50 iterations a run; each one
journaled model call and one journaled unsafe tool call, both returning at
once: two journaled steps an iteration). Four processes, as deployed:

- ``dagnats dev --no-demo`` (the engine, the journal and inputs services and
  the gateway in one process; free ports; a temporary data directory), which
  starts nats-server with ``sync_interval: always`` as its child;
- a worker process (``python -m bench.bench_turn worker``) running the
  journaled handler, told nothing but the engine's address: on the services'
  host, its journal calls and its polls go to the local socket its polls
  name (ADR 45, 46, 49); with ``BENCH_DEPLOY=grpc`` on gRPC, as a worker on another host sends
  them (``DAGNATS_LOCAL_SOCKET=off``); with
  ``BENCH_DEPLOY=services`` the handler runs in the ``dagnats dev`` process
  instead (``--handlers``, ADR 44) and the worker process serves only the
  queued baseline; with ``BENCH_DEPLOY=split`` the services run apart as
  docker-compose runs them (``dagnats serve engine``, ``serve journal`` and
  ``serve inputs``, three processes on one nats-server with ``sync_interval:
  always`` that this process starts; no gateway), and the worker dials all
  three on gRPC;
- this process, the client: ``Client.run`` starts a run and waits for its
  result on the run's ``WatchRun`` push; on the services' host, so after its
  first run on gRPC it watches on the local socket the first answer named
  (ADR 52).

Phases, each the floor's and then dagnats', so both see the machine alike:

- ``seq``: one run at a time; a step is run wall / K / 2; median and p90 of
  ``BENCH_RUNS`` (20) runs after ``BENCH_WARMUP`` (3);
- ``thr``: ``BENCH_C`` (20) runs at once; steps/s of a round, the median of
  ``BENCH_THR_ROUNDS`` (5) after one warm-up round; CPU ms per step of each
  process (utime + stime from /proc) over the timed rounds;
- ``start``: a K=1 run, start to result seen by the client, ``BENCH_START_RUNS``
  (50) times;
- messages per iteration, untimed: what nats-server counted (``/varz``), what
  each stream stored (``/jsz``) and what clients sent, by kind (a tap on ``>``);
- fsync calls per step on nats-server, with ``strace`` when it is installed
  (``BENCH_STRACE=0`` skips it): sequential runs, then one concurrent round.
- with ``BENCH_PROFILE=DIR``, last: py-spy samples of the services and the
  worker over rounds of C runs (raw stacks into DIR, top functions printed;
  ``BENCH_PROFILE_NATIVE=1`` adds native frames and pauses the processes).

The floor is what ``../shared/peers`` calls the naive JetStream journal: per
iteration one tail read and five publishes fenced on the subject's last
sequence, with nats-py on the same server. The record goes to ``$BENCH_OUT``
(``/tmp/peers-results``) in the peers' format, so their ``summarize.py`` shows
it beside them. Nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEPS_PER_ITER = 2
FLOOR_APPENDS = 5  # the peers' naive journal: model req/res, tool req/res, iteration done
FLOOR_STREAM = "BENCHFLOOR"
TASK = "bench-turn"  # the workload's task type and workflow
# BENCH_DEPLOY: where the handler runs.
WHERE = {
    "worker": "its own process",
    "grpc": "its own process, journal calls on gRPC",
    "services": "the services' process",
    "split": "its own process, on gRPC to the services apart (serve engine, journal, inputs)",
}
VARIANTS = {
    "worker": "dev",
    "grpc": "dev-worker-on-grpc",
    "services": "dev-handlers-in-services",
    "split": "split-services",
}
# The services of the split deployment, each ``dagnats serve NAME`` of its own.
SPLIT = ("engine", "journal", "inputs")
DEPLOYMENTS = tuple(WHERE)
# Seconds without a stored message before the traced runs (see ``fsyncs``).
RECONCILE_STILL = 11.0
QUEUED = "-queued"  # ... and, with this suffix, run with every iteration through the queue
SYNC_CALLS = ("fsync", "fdatasync", "sync_file_range", "msync", "syncfs", "sync")
HERE = Path(__file__).resolve().parent


# ---- knobs ------------------------------------------------------------------------------


def knob(env: Mapping[str, str], name: str, default: int, least: int, most: int = 0) -> int:
    """The whole number in ``env[name]``, ``default`` when unset; one out of
    ``least..most`` (no upper bound when ``most`` is 0) stops with its name."""
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a whole number, got {raw!r}") from None
    if value < least:
        raise SystemExit(f"{name} must be at least {least}, got {value}")
    if most and value > most:
        raise SystemExit(f"{name} must be at most {most}, got {value}")
    return value


@dataclass(frozen=True)
class Params:
    k: int = 50
    c: int = 20
    runs: int = 20
    warmup: int = 3
    thr_rounds: int = 5
    start_runs: int = 50
    strace: bool = True
    queued: bool = True  # also the baseline with every iteration through the task queue
    profile: str = ""  # a directory: py-spy samples of the services and the worker under load
    deploy: str = "worker"  # where the handler runs: its own process, or "services" (ADR 44)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Params:
        """The knobs from ``BENCH_*`` variables; a bad one stops with its name."""
        return cls(
            k=knob(env, "BENCH_K", cls.k, 1),
            c=knob(env, "BENCH_C", cls.c, 1),
            runs=knob(env, "BENCH_RUNS", cls.runs, 2),
            warmup=knob(env, "BENCH_WARMUP", cls.warmup, 0),
            thr_rounds=knob(env, "BENCH_THR_ROUNDS", cls.thr_rounds, 1),
            start_runs=knob(env, "BENCH_START_RUNS", cls.start_runs, 2),
            strace=env.get("BENCH_STRACE", "1") not in ("0", "", "no", "false"),
            queued=env.get("BENCH_QUEUED", "1") not in ("0", "", "no", "false"),
            profile=env.get("BENCH_PROFILE", ""),
            deploy=deployment(env.get("BENCH_DEPLOY", cls.deploy)),
        )

    @property
    def variant(self) -> str:
        """The record's variant: ``dev``, ``dev-worker-on-grpc``,
        ``dev-handlers-in-services`` or ``split-services``."""
        return VARIANTS[self.deploy]

    def peers(self) -> dict[str, int]:
        """The ``params`` of a peers' record."""
        return {
            "K": self.k,
            "C": self.c,
            "seq_runs": self.runs,
            "warmup": self.warmup,
            "start_runs": self.start_runs,
            "thr_rounds": self.thr_rounds,
        }


# ---- summaries, as the peers make them ----------------------------------------------------


def pct(xs: Iterable[float], p: float) -> float:
    """The nearest-rank percentile ``p`` (0..100)."""
    ordered = sorted(xs)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(p / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summarize(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "p90": pct(xs, 90),
        "min": min(xs),
        "max": max(xs),
    }


def seq_result(walls: list[float], k: int) -> dict[str, Any]:
    per_iter = [w * 1000.0 / k for w in walls]
    return {
        "per_iter_ms": summarize(per_iter),
        "per_step_ms": summarize([x / STEPS_PER_ITER for x in per_iter]),
        "run_ms": summarize([w * 1000.0 for w in walls]),
    }


def thr_result(walls: list[float], c: int, k: int) -> dict[str, Any]:
    steps = c * k * STEPS_PER_ITER
    return {
        "steps_per_s": summarize([steps / w for w in walls]),
        "round_wall_s": summarize(walls),
        "steps_per_round": steps,
    }


def start_result(walls: list[float]) -> dict[str, Any]:
    return {"k1_run_ms": summarize([w * 1000.0 for w in walls])}


# ---- processes: CPU, strace -------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (not of its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    return found


def cpu_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    per = {name: (after[name] - before[name]) * 1000.0 / steps for name in before}
    per["total"] = sum(per.values())
    return {name: round(ms, 4) for name, ms in per.items()}


_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls by syscall from the table ``strace -c`` writes."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if (row := _STRACE_ROW.match(line)) and row.group(2) != "total":
            counts[row.group(2)] = int(row.group(1))
    return counts


def sync_calls(counts: Mapping[str, int]) -> int:
    return sum(n for name, n in counts.items() if name in SYNC_CALLS)


_STRACE_CALL = re.compile(r"^(?:\d+\s+)?(\w+)\(\d+<([^>]*)>")


def parse_strace_calls(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """Calls by syscall, and by the file they were made on, from ``strace
    -f -y`` lines; a JetStream store's file is named from its stream
    (``HISTORY/obs/engine``: a consumer's state, ``KV_RUNS/msgs``: stored
    messages)."""
    calls: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for line in text.splitlines():
        if (call := _STRACE_CALL.match(line)) is None:
            continue
        calls[call.group(1)] += 1
        path = call.group(2)
        _, streams, rest = path.partition("/streams/")
        if streams:
            parts = rest.split("/")
            path = "/".join(parts[:3] if len(parts) > 2 and parts[1] == "obs" else parts[:2])
        files[path] += 1
    return dict(calls), dict(files)


class Strace:
    """``strace -f -c`` on one process for the length of a block; with
    ``files``, ``strace -f -y`` instead, which also says the file of each
    call (``self.files``)."""

    def __init__(self, pid: int, out: Path, files: bool = False) -> None:
        self.pid, self.out, self.by_file = pid, out, files
        self.counts: dict[str, int] = {}
        self.files: dict[str, int] = {}

    async def __aenter__(self) -> Strace:
        how = ["-y"] if self.by_file else ["-c"]
        args = ["strace", "-f", *how, "-o", str(self.out), "-e", f"trace={','.join(SYNC_CALLS)}"]
        self.proc = await asyncio.create_subprocess_exec(
            *args, "-p", str(self.pid), stderr=subprocess.DEVNULL
        )
        await wait_until(lambda: _traced(self.pid), 10.0, "strace to attach")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(self.proc.wait(), 30)
        if self.by_file:
            self.counts, self.files = parse_strace_calls(self.out.read_text())
        else:
            self.counts = parse_strace_summary(self.out.read_text())


def _traced(pid: int) -> bool:
    tasks = os.listdir(f"/proc/{pid}/task")
    for task in tasks:
        status = Path(f"/proc/{pid}/task/{task}/status").read_text()
        if re.search(r"^TracerPid:\s+0$", status, re.M):
            return False
    return bool(tasks)


async def wait_until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# ---- nats-server's own counts -----------------------------------------------------------


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def stream_field(jsz: Mapping[str, Any], field: str) -> dict[str, int]:
    """``field`` of every stream's state in ``/jsz?streams=true``."""
    found: dict[str, int] = {}
    for account in jsz.get("account_details", []):
        for stream in account.get("stream_detail", []):
            found[stream["name"]] = int(stream["state"][field])
    return found


def stream_seqs(jsz: Mapping[str, Any]) -> dict[str, int]:
    """The last sequence of every stream in ``/jsz?streams=true``."""
    return stream_field(jsz, "last_seq")


def stream_states(jsz: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """The last sequence and the messages held of every stream: a message
    stored moves the one, one removed (a work queue's ack, a purge) the other."""
    held = stream_field(jsz, "messages")
    return {name: (seq, held[name]) for name, seq in stream_seqs(jsz).items()}


def per_iteration(
    before: Mapping[str, float], after: Mapping[str, float], n: int, digits: int = 2
) -> dict[str, float]:
    """What grew between two counts, per iteration (to ``digits``
    decimals); unchanged keys left out."""
    grew = {key: (after.get(key, 0) - before.get(key, 0)) / n for key in after}
    return {key: round(v, digits) for key, v in sorted(grew.items()) if v}


# ---- the services' counters: which routes the iterations took ----------------------------

_SAMPLE = re.compile(r'^(\w+?)(_total)?(?:\{event="([^"]*)"\})?\s+([-+\d.eE]+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """The counters of a ``/metrics`` page (Prometheus' text format): the
    engine's events by their name (``kept_unwritten``, ``guess_missed``...),
    every other counter by its family (``dagnats_local_socket_polls``);
    gauges and the ``_created`` stamps left out."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or (sample := _SAMPLE.match(line.strip())) is None:
            continue
        name, total, event, value = sample.groups()
        if total:
            key = event if event is not None else name
            found[key] = found.get(key, 0.0) + float(value)
    return found


def scrape(urls: Mapping[str, str]) -> dict[str, float]:
    """The counters of every services' process at once, summed by name."""
    found: Counter[str] = Counter()
    for url in urls.values():
        with urllib.request.urlopen(url, timeout=5) as response:
            found.update(parse_metrics(response.read().decode()))
    return dict(found)


def phase_iterations(p: Params, phase: str) -> int:
    """The iterations a phase of ``phases`` runs, its warm-ups included."""
    if phase == "seq":
        return (p.warmup + p.runs) * p.k
    if phase == "thr":
        return (p.thr_rounds + 1) * p.c * p.k
    return 3 + p.start_runs


# ---- the workload -----------------------------------------------------------------------


def model_output(i: int) -> dict[str, Any]:
    return {"tool": "charge", "input": {"n": i}}


def tool_output(call_input: Mapping[str, Any]) -> dict[str, Any]:
    return {"ok": True, "charged": call_input["n"]}


def deployment(value: str) -> str:
    if value not in DEPLOYMENTS:
        raise SystemExit(f"BENCH_DEPLOY must be one of {', '.join(DEPLOYMENTS)}, got {value!r}")
    return value


def turn_handler(model_s: float = 0.0) -> Callable[[Any], Awaitable[None]]:
    """The journaled handler: one model and one unsafe tool call an
    iteration, ``k`` iterations (the run's input); the model answers after
    ``model_s`` seconds (a provider's answer time), at once by default."""
    from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun

    async def charge(run: ToolRun) -> dict[str, Any]:
        return tool_output(run.call.input)

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()
        i = tc.iteration

        async def model() -> dict[str, Any]:
            if model_s:
                await asyncio.sleep(model_s)  # the provider thinking, not a wait on a condition
            return model_output(i)

        reply = await j.model(model)
        result = await j.tool(
            ToolCall(name=reply["tool"], input=reply["input"]), Replay.UNSAFE, charge
        )
        if i + 1 < tc.input["k"]:
            await tc.continue_()
        else:
            await tc.complete(result.output)

    return turn


# The handlers of ``dagnats dev --handlers bench.bench_turn:HANDLERS``.
HANDLERS = {TASK: turn_handler()}


async def serve_worker(
    targets: Sequence[str],
    handlers: Mapping[str, Callable[[Any], Awaitable[None]]],
    c: int,
    apart: Mapping[str, str] | None = None,
) -> None:
    """The worker process: a ``Worker`` of concurrency ``c`` on each engine
    in ``targets``, until SIGTERM. A task type ending in ``QUEUED`` gets a
    worker of its own that sends every iteration through the task queue
    (``kept_iterations=0``), the way before ADR 31, for a baseline measured
    in the same run. ``apart`` names the journal's and the inputs service's
    addresses when they run apart from the engine (``journal``, ``inputs``)."""
    from dagnats.sdk import Worker

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with contextlib.AsyncExitStack() as workers:
        for target in targets:
            for task_type, handler in handlers.items():
                queued: dict[str, Any] = {"kept_iterations": 0}
                worker = Worker(
                    target,
                    handlers={task_type: handler},
                    concurrency=c,
                    poll_wait=5.0,
                    journal_target=(apart or {}).get("journal"),
                    inputs_target=(apart or {}).get("inputs"),
                    **(queued if task_type.endswith(QUEUED) else {}),
                )
                await workers.enter_async_context(worker)
        print("worker ready", flush=True)
        await stop.wait()


def spawn_worker(
    module: str,
    targets: Sequence[str],
    task: str,
    c: int,
    log: Path,
    local_socket: str | None = None,
    apart: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``python -m module worker TARGET[,TARGET] TASK C [journal=ADDR inputs=ADDR]``,
    its output into ``log``, with ``env`` over this process's environment;
    with ``local_socket``, its journal calls go there; with ``apart``, to the
    services' addresses it names; with ``wrap``, run under it."""
    args = [*wrap, sys.executable, "-m", module, "worker", ",".join(targets), task, str(c)]
    args += [f"{name}={target}" for name, target in (apart or {}).items()]
    child = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "DAGNATS_LOCAL_SOCKET"}
    if local_socket is not None:
        child["DAGNATS_LOCAL_SOCKET"] = local_socket
    with log.open("ab") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parent, env=child
        )


# ---- the floor --------------------------------------------------------------------------


@dataclass
class Floor:
    """The naive journal on raw JetStream: per iteration one tail read, then
    ``FLOOR_APPENDS`` publishes fenced on the subject's last sequence."""

    js: Any  # nats.js.JetStreamContext
    runs: int = 0

    async def run(self, k: int, stamps: list[float] | None = None) -> None:
        """One run of ``k`` iterations; with ``stamps``, the time each began."""
        from nats.js.errors import NotFoundError

        self.runs += 1
        subject = f"floor.{os.getpid()}.{self.runs}"
        fence = "Nats-Expected-Last-Subject-Sequence"
        for i in range(k):
            if stamps is not None:
                stamps.append(time.perf_counter())
            try:
                last = int((await self.js.get_last_msg(FLOOR_STREAM, subject)).seq or 0)
            except NotFoundError:
                last = 0
            m = model_output(i)
            for payload in ({"i": i}, m, m["input"], tool_output(m["input"]), {"i": i, "end": 1}):
                ack = await self.js.publish(
                    subject, json.dumps(payload).encode(), headers={fence: str(last)}
                )
                last = int(ack.seq)


# ---- profiles ----------------------------------------------------------------------------


# Native leaf frames of a thread that waits: with ``--native`` py-spy counts
# them as running, so they are left out.
WAITING = ("epoll_wait", "wait4", "poll", "select", "futex", "nanosleep", "pthread_cond_wait")


def parse_raw_profile(text: str) -> list[tuple[list[str], int]]:
    """Stacks (outermost frame first) and their sample counts from py-spy's
    ``--format raw`` output (one ``frame;frame;... count`` a line), without
    the stacks of threads that wait in a system call."""
    stacks: list[tuple[list[str], int]] = []
    for line in text.splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stack = frames.split(";")
            if stack[-1].partition(" ")[0] not in WAITING:
                stacks.append((stack, int(count)))
    return stacks


def top_functions(
    stacks: list[tuple[list[str], int]], n: int
) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """All samples, then the ``n`` functions with most samples of their own
    (the leaf) and most samples anywhere on the stack."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for frames, count in stacks:
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
    total = sum(count for _, count in stacks)
    return total, own.most_common(n), anywhere.most_common(n)


# py-spy names the product's files from their component (``journal/writer.py``).
COMPONENTS = frozenset(
    {"cli", "core", "engine", "gateway", "inputs", "integrations", "journal", "sdk"}
)


def package_of(frame: str) -> str:
    """Where a frame's code lives: ``dagnats.<component>``, or the top-level
    package or library (``nats``, ``grpc``, ``asyncio``, ``libc.so.6``...)."""
    where = frame.rpartition(" (")[2].rstrip(")").split(":")[0]
    parts = [x for x in where.split("/") if x]
    if not parts:
        return "?"
    if parts[0] == "dagnats" and len(parts) > 2:
        parts = parts[1:]
    if parts[0] in COMPONENTS and len(parts) > 1:
        return f"dagnats.{parts[0]}"
    return parts[0].removesuffix(".py")


def by_package(stacks: list[tuple[list[str], int]]) -> list[tuple[str, int]]:
    """Samples by the package of the leaf frame, most first."""
    seen: Counter[str] = Counter()
    for frames, count in stacks:
        seen[package_of(frames[-1])] += count
    return seen.most_common()


def py_spy() -> str | None:
    """py-spy beside this Python (the dev extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


class PySpy:
    """``py-spy record --format raw`` on one process for the length of a block."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out

    async def __aenter__(self) -> PySpy:
        args = ["py-spy", "record", "--nolineno", "--format", "raw"]
        # Native frames name the C work (grpc's Cython core, protobuf, json)
        # that a Python-only sample charges to its caller; sampling them
        # pauses the process, so the numbers while sampled are not the bench's.
        args += ["--native"] if os.environ.get("BENCH_PROFILE_NATIVE") else ["--nonblocking"]
        args += ["--rate", "250", "-o", str(self.out), "-p", str(self.pid)]
        self.proc = await asyncio.create_subprocess_exec(
            py_spy() or args[0], *args[1:], stdout=subprocess.DEVNULL
        )
        await asyncio.sleep(1.0)  # py-spy prints nothing once it samples; give it its start
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(self.proc.wait(), 60)


async def profiles(
    stack: Stack, p: Params, run: Callable[[int], Awaitable[Any]], out: Path
) -> dict[str, Any]:
    """py-spy samples of the services and the worker over rounds of C runs."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"services": out / "services.raw", "worker": out / "worker.raw"}
    rounds = max(2, p.thr_rounds)
    before = stack.cpu()
    async with PySpy(stack.dev.pid, files["services"]), PySpy(stack.worker.pid, files["worker"]):
        for n in range(rounds):
            await asyncio.gather(*(run(p.k) for _ in range(p.c)))
            progress(f"profile round {n + 1}/{rounds}")
    cpu = cpu_per_step(before, stack.cpu(), rounds * p.c * p.k * STEPS_PER_ITER)
    found: dict[str, Any] = {"cpu_ms_per_step_while_sampled": cpu, "files": {}}
    for name, path in files.items():
        stacks = parse_raw_profile(path.read_text()) if path.exists() else []
        total, own, anywhere = top_functions(stacks, 25)
        found["files"][name] = {
            "path": str(path),
            "samples": total,
            "by_package": by_package(stacks),
            "own": own,
            "anywhere": anywhere,
        }
    return found


# ---- the measurement --------------------------------------------------------------------


@dataclass
class Stack:
    """The processes of one deployment and how to reach them."""

    dev: subprocess.Popen[str]
    worker: subprocess.Popen[bytes]
    nats_pid: int
    engine: str
    nats_url: str
    monitor: str
    logs: Path
    local_socket: str | None  # the local socket of ``dagnats dev``
    metrics: dict[str, str] = field(default_factory=dict)  # a services' process: its /metrics
    # The split's journal and inputs processes (``dev`` is then its engine's),
    # and the nats-server this process started for them.
    apart: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    nats: Any = None  # dagnats.core.natsserver.NatsServer

    def processes(self) -> dict[str, subprocess.Popen[Any]]:
        """The product's processes by name, the worker last."""
        first = "engine" if self.apart else "dagnats dev"
        return {first: self.dev, **self.apart, "worker": self.worker}

    def routes(self) -> dict[str, float]:
        """The services' counters now (see ``parse_metrics``)."""
        return scrape(self.metrics)

    def socket_connections(self) -> int:
        """Connections open on the local socket now (``/proc/net/unix``
        names the path on each one the socket accepted too)."""
        if self.local_socket is None:
            return 0
        lines = Path("/proc/net/unix").read_text().splitlines()
        return max(sum(line.endswith(" " + self.local_socket) for line in lines) - 1, 0)

    def cpu(self) -> dict[str, float]:
        services = {name: cpu_seconds(proc.pid) for name, proc in self.apart.items()}
        if services:
            services = {"engine": cpu_seconds(self.dev.pid), **services}
        else:
            services = {"services(engine+journal+gateway)": cpu_seconds(self.dev.pid)}
        return {
            **services,
            "nats-server": cpu_seconds(self.nats_pid),
            "worker": cpu_seconds(self.worker.pid),
            "client": cpu_seconds(os.getpid()),
        }


@dataclass
class Measured:
    seq: list[float] = field(default_factory=list)
    thr: list[float] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    strace: dict[str, Any] | None = None
    routes: dict[str, dict[str, float]] = field(default_factory=dict)  # by phase, per iteration


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await work()
    return time.perf_counter() - started


async def phases(
    name: str,
    p: Params,
    run: Callable[[int], Awaitable[Any]],
    cpu: Callable[[], dict[str, float]],
    out: Measured,
    phase: str,
) -> None:
    """One phase of the workload for one system, into ``out``."""
    if phase == "seq":
        for _ in range(p.warmup):
            await run(p.k)
        for n in range(p.runs):
            out.seq.append(await timed(lambda: run(p.k)))
            if n % 5 == 4:
                progress(f"{name} seq {n + 1}/{p.runs}")
    elif phase == "thr":

        async def round_() -> None:
            await asyncio.gather(*(run(p.k) for _ in range(p.c)))

        await round_()
        before = cpu()
        for n in range(p.thr_rounds):
            out.thr.append(await timed(round_))
            progress(f"{name} thr {n + 1}/{p.thr_rounds}")
        steps = p.c * p.k * STEPS_PER_ITER * p.thr_rounds
        out.cpu = cpu_per_step(before, cpu(), steps)
    elif phase == "start":
        for _ in range(3):
            await run(1)
        for _ in range(p.start_runs):
            out.start.append(await timed(lambda: run(1)))
        progress(f"{name} start {p.start_runs} runs")


async def stored_nothing_for(monitor: str, still: float, most: float) -> float:
    """Wait until no stream of the server has stored a message for ``still``
    seconds (an engine's writes left over from the runs before: kept
    iterations, outboxes, clean-up), at most ``most`` seconds; the seconds
    waited."""
    loop = asyncio.get_running_loop()
    end = loop.time() + most
    url = f"{monitor}/jsz?streams=true"
    last, since = stream_states(get_json(url)), loop.time()
    while loop.time() < end and loop.time() - since < still:
        await asyncio.sleep(0.1)
        seqs = stream_states(get_json(url))
        if seqs != last:
            last, since = seqs, loop.time()
    return round(loop.time() - end + most, 1)


async def fsyncs(
    pid: int,
    monitor: str,
    p: Params,
    run: Callable[[int], Awaitable[Any]],
    logs: Path,
    label: str,
    routes: Callable[[], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """fsync-family calls of ``pid`` per step: idle (once the store is
    still), sequential runs, one round of C; with ``routes``, the services'
    counters per iteration of the traced runs (which routes they took)."""
    counted = routes or dict
    idle_s, seq_runs = 3.0, 4
    # Still for longer than the reconciler's period (10 s by default), so the
    # outbox clears it defers for the runs before are not counted as these
    # runs' (nor as idle).
    waited = await stored_nothing_for(monitor, still=RECONCILE_STILL, most=45.0)
    jsz = f"{monitor}/jsz?streams=true"
    idle_before = get_json(jsz)
    async with Strace(pid, logs / f"strace-{label}-idle.txt", files=True) as idle:
        await asyncio.sleep(idle_s)  # the idle baseline's length
    idle_after = get_json(jsz)
    idle_stored = per_iteration(stream_seqs(idle_before), stream_seqs(idle_after), 1)
    held = stream_field(idle_before, "messages"), stream_field(idle_after, "messages")
    before = counted()
    async with Strace(pid, logs / f"strace-{label}.txt") as seq:
        wall = 0.0
        for _ in range(seq_runs):
            wall += await timed(lambda: run(p.k))
    between = counted()
    async with Strace(pid, logs / f"strace-{label}-conc.txt") as conc:
        conc_wall = await timed(lambda: asyncio.gather(*(run(p.k) for _ in range(p.c))))
    after = counted()
    steps, conc_steps = seq_runs * p.k * STEPS_PER_ITER, p.c * p.k * STEPS_PER_ITER
    return {
        "label": label,
        "runs": seq_runs,
        "steps": steps,
        "traced_wall_s": wall,
        "counts": seq.counts,
        "idle_counts_3s": idle.counts,
        "sync_calls_per_step": sync_calls(seq.counts) / steps,
        "idle_sync_calls_per_s": sync_calls(idle.counts) / idle_s,
        # Writes while idle, by stream; and how long the store took to go
        # still before (45 s: it did not).
        "idle_stored": idle_stored,
        "idle_held_change": per_iteration(*held, 1),
        "idle_sync_calls_by_file": idle.files,
        "waited_for_still_s": waited,
        "routes_per_iteration": per_iteration(before, between, seq_runs * p.k, 3),
        "concurrent": {
            "runs": p.c,
            "steps": conc_steps,
            "traced_wall_s": conc_wall,
            "counts": conc.counts,
            "sync_calls_per_step": sync_calls(conc.counts) / conc_steps,
            "routes_per_iteration": per_iteration(between, after, p.c * p.k, 3),
        },
    }


async def messages(stack: Stack, run: Callable[[int], Awaitable[Any]], k: int) -> dict[str, Any]:
    """Messages of one iteration, from two untimed runs of ``k``: nats-server's
    counters and each stream's appends, then clients' messages by kind."""
    from bench.journal_overhead import traffic
    from dagnats.core import jetstream as jsx

    varz = f"{stack.monitor}/varz"
    jsz = f"{stack.monitor}/jsz?streams=true"
    v0, j0 = get_json(varz), stream_seqs(get_json(jsz))
    await run(k)
    v1, j1 = get_json(varz), stream_seqs(get_json(jsz))
    keys = ("in_msgs", "out_msgs")
    nc = await jsx.connect(stack.nats_url, name="bench-tap")
    try:
        _, seen = await traffic(nc, run(k))
    finally:
        await nc.close()
    return {
        "iterations": k,
        "server": per_iteration({x: v0[x] for x in keys}, {x: v1[x] for x in keys}, k),
        "stored_by_stream": per_iteration(j0, j1, k),
        "sent_by_kind": {kind: round(n / k, 2) for kind, n in sorted(seen.items())},
    }


def start_stack(data: Path, p: Params, worker_module: str = "bench.bench_turn") -> Stack:
    """``dagnats dev --no-demo`` with its data in ``data``, and the worker
    process ``python -m worker_module worker`` on its engine."""
    from tests.stack import start_dev

    logs = data / "logs"
    logs.mkdir(parents=True)
    flags = ["--no-demo"]
    if p.deploy == "services":  # the handler in the services' process (ADR 44)
        flags += ["--handlers", "bench.bench_turn:HANDLERS", "--handler-concurrency", str(p.c)]
    dev = start_dev(data / "dev", *flags, stderr=logs / "dev.err")
    info = json.loads((data / "dev" / "dev.json").read_text())
    conf = (data / "dev" / "nats" / "nats-server.conf").read_text()
    http = re.search(r'^http: "([^"]+)"', conf, re.M)
    nats_pids = [pid for pid in children(dev.proc.pid) if "nats-server" in _cmdline(pid)]
    if http is None or len(nats_pids) != 1:
        dev.proc.kill()
        raise SystemExit(f"dagnats dev: no monitor port or nats-server child: {conf}")
    tasks = TASK + QUEUED if p.deploy == "services" else TASK
    socket = "off" if p.deploy == "grpc" else None
    worker = spawn_worker(
        worker_module, [info["engine"]], tasks, p.c, logs / "worker.log", local_socket=socket
    )
    return Stack(
        dev.proc,
        worker,
        nats_pids[0],
        info["engine"],
        info["nats"],
        f"http://{http[1]}",
        logs,
        info.get("local_socket"),
        metrics={"services": info["metrics"]} if "metrics" in info else {},
    )


def serve_one(
    name: str, nats: Any, logs: Path, metrics: bool, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], str, str | None]:
    """``dagnats serve NAME`` on a free port against ``nats`` (a started
    ``NatsServer``), its stderr into ``logs``, with ``env`` over this
    process's environment; the process, its address and, with ``metrics``,
    its ``/metrics`` URL, once it printed them."""
    from bench.harness import serve

    log = logs / f"{name}.err"
    served = serve(name, nats.url, log, env=env, metrics=metrics, monitor=nats.monitor_url)
    return served.proc, served.target, served.metrics


async def start_split(data: Path, p: Params, worker_module: str = "bench.bench_turn") -> Stack:
    """The split deployment, the services apart on one host: a
    nats-server (``sync_interval: always``), ``dagnats serve engine``,
    ``serve journal`` and ``serve inputs`` each a process of its own, and the
    worker process dialling all three on gRPC."""
    from dagnats.core.natsserver import NatsServer

    logs = data / "logs"
    logs.mkdir(parents=True)
    nats = await NatsServer.start(data / "nats", sync_always=True)
    served: dict[str, tuple[subprocess.Popen[str], str, str | None]] = {}
    try:
        for name in SPLIT:
            served[name] = serve_one(name, nats, logs, metrics=name != "inputs")
    except BaseException:
        for proc, _, _ in served.values():
            stop_process(proc)
        await nats.stop()
        raise
    targets = {name: target for name, (_, target, _) in served.items()}
    apart = {name: targets[name] for name in ("journal", "inputs")}
    worker = spawn_worker(
        worker_module, [targets["engine"]], TASK, p.c, logs / "worker.log", "off", apart
    )
    return Stack(
        served["engine"][0],
        worker,
        nats.pid,
        targets["engine"],
        nats.url,
        nats.monitor_url,
        logs,
        None,
        metrics={name: url for name, (_, _, url) in served.items() if url is not None},
        apart={name: served[name][0] for name in ("journal", "inputs")},
        nats=nats,
    )


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    """Stop ``proc`` with ``sig``, killing it after 20 s; its output pipe,
    if any, is closed."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def stop_stack(stack: Stack) -> None:
    """Stop the worker, then the services (the nats-server of a split one
    is stopped by ``measure``, which started it)."""
    processes: list[subprocess.Popen[Any]] = [stack.worker, *stack.apart.values(), stack.dev]
    for proc in processes:
        stop_process(proc)


async def measure(p: Params, data: Path) -> dict[str, Any]:
    import nats

    from dagnats.sdk import Client
    from tests.stack import loop_workflow

    stack = await start_split(data, p) if p.deploy == "split" else start_stack(data, p)
    try:
        nc = await nats.connect(stack.nats_url, name="bench-floor")
        js = nc.jetstream()
        await js.add_stream(name=FLOOR_STREAM, subjects=["floor.>"], storage="file")
        floor = Floor(js)
        async with Client(stack.engine) as client:
            workflow = TASK
            await client.register_workflow(loop_workflow(workflow, TASK, max_iterations=10_000))

            async def dagnats_run(k: int) -> None:
                out = await client.run(workflow, {"k": k}, timeout=120 + k)
                if out != tool_output({"n": k - 1}):
                    raise SystemExit(f"a run of {k} answered {out!r}")

            def floor_cpu() -> dict[str, float]:
                return {
                    "nats-server": cpu_seconds(stack.nats_pid),
                    "client(nats-py)": cpu_seconds(os.getpid()),
                }

            queued_workflow = TASK + QUEUED
            await client.register_workflow(
                loop_workflow(queued_workflow, queued_workflow, max_iterations=10_000)
            )

            async def queued_run(k: int) -> None:
                out = await client.run(queued_workflow, {"k": k}, timeout=120 + k)
                if out != tool_output({"n": k - 1}):
                    raise SystemExit(f"a run of {k} answered {out!r}")

            await dagnats_run(1)  # the worker is polling
            ours, base, queued = Measured(), Measured(), Measured()
            for phase in ("seq", "thr", "start"):
                progress(f"phase {phase}")
                await phases("floor", p, floor.run, floor_cpu, base, phase)
                before = stack.routes()
                await phases("dagnats", p, dagnats_run, stack.cpu, ours, phase)
                ours.routes[phase] = per_iteration(
                    before, stack.routes(), phase_iterations(p, phase), 3
                )
                if p.queued:
                    await phases("queued", p, queued_run, stack.cpu, queued, phase)
            # The worker's idle sessions and polls, and the client's idle watches.
            on_socket = stack.socket_connections()
            progress("messages per iteration")
            counted = await messages(stack, dagnats_run, min(p.k, 20))
            if p.strace and shutil.which("strace"):
                progress("strace")
                base.strace = await fsyncs(
                    stack.nats_pid, stack.monitor, p, floor.run, stack.logs, "floor"
                )
                ours.strace = await fsyncs(
                    stack.nats_pid,
                    stack.monitor,
                    p,
                    dagnats_run,
                    stack.logs,
                    "dagnats",
                    stack.routes,
                )
                if p.queued:
                    queued.strace = await fsyncs(
                        stack.nats_pid, stack.monitor, p, queued_run, stack.logs, "queued"
                    )
            elif p.strace:
                progress("strace is not installed: no fsync counts")
            profiled = None
            if p.profile and py_spy():
                progress("py-spy under rounds of C runs")
                profiled = await profiles(stack, p, dagnats_run, Path(p.profile))
            elif p.profile:
                progress("py-spy is not installed (pip install py-spy): no profiles")
        await nc.close()
        for name, proc in stack.processes().items():
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited early (logs in {stack.logs})")
        return {
            "dagnats": ours,
            "floor": base,
            "queued": queued if p.queued else None,
            "messages": counted,
            "profiles": profiled,
            "on_socket": on_socket,
        }
    finally:
        stop_stack(stack)
        if stack.nats is not None:
            await stack.nats.stop()


# ---- the report -------------------------------------------------------------------------


def results_of(m: Measured, p: Params) -> dict[str, Any]:
    thr = thr_result(m.thr, p.c, p.k)
    thr["cpu_ms_per_step"] = m.cpu
    return {"seq": seq_result(m.seq, p.k), "thr": thr, "start": start_result(m.start)}


def record(
    system: str, variant: str, results: dict[str, Any], p: Params, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """A record in the peers' format (``../shared/peers/README.md``)."""
    return {
        "system": system,
        "variant": variant,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "loadavg_at_end": os.getloadavg(),
        },
        "pass": os.environ.get("BENCH_PASS", "adhoc"),
        "params": p.peers(),
        "results": results,
        **extra,
    }


@dataclass(frozen=True)
class Row:
    label: str
    ours: float | None
    floor: float | None
    fmt: str = "{:.2f}"


def rows(ours: Mapping[str, Any], floor: Mapping[str, Any]) -> list[Row]:
    """The side-by-side measures of two records."""

    def get(rec: Mapping[str, Any], *path: str) -> float | None:
        value: Any = rec
        for key in path:
            if not isinstance(value, Mapping) or key not in value:
                return None
            value = value[key]
        return float(value)

    def both(label: str, *path: str, fmt: str = "{:.2f}") -> Row:
        return Row(label, get(ours, *path), get(floor, *path), fmt)

    return [
        both("seq: ms per journaled step, median", "results", "seq", "per_step_ms", "median"),
        both("seq: ms per journaled step, p90", "results", "seq", "per_step_ms", "p90"),
        both(
            "thr: journaled steps/s, median",
            "results",
            "thr",
            "steps_per_s",
            "median",
            fmt="{:.0f}",
        ),
        both(
            "start: K=1 run to result seen, ms, median", "results", "start", "k1_run_ms", "median"
        ),
        both("start: K=1 run to result seen, ms, p90", "results", "start", "k1_run_ms", "p90"),
        both("fsync calls per step, sequential", "strace", "sync_calls_per_step"),
        both("fsync calls per step, C at once", "strace", "concurrent", "sync_calls_per_step"),
        both("CPU ms per step, all processes (thr)", "results", "thr", "cpu_ms_per_step", "total"),
    ]


def format_table(
    table: list[Row], columns: tuple[str, str] = ("dagnats", "floor"), width: int = 44
) -> str:
    """The rows with the ratio of their two values; ``columns`` names them."""
    lines = [f"{'measure':{width}} {columns[0]:>9} {columns[1]:>9} {'ratio':>7}"]
    for row in table:
        ours = row.fmt.format(row.ours) if row.ours is not None else "n/a"
        floor = row.fmt.format(row.floor) if row.floor is not None else "n/a"
        ratio = f"{row.ours / row.floor:.2f}x" if row.ours is not None and row.floor else "n/a"
        lines.append(f"{row.label:{width}} {ours:>9} {floor:>9} {ratio:>7}")
    return "\n".join(lines)


def format_routes(rec: Mapping[str, Any]) -> str:
    """The services' counters per iteration of each phase: which routes the
    iterations took (a kept iteration left unwritten, a guess that missed, a
    commit's event applied in the engine's process...), the traced phases too."""
    phases: dict[str, Mapping[str, float]] = dict(rec.get("routes_per_iteration", {}))
    if "strace" in rec:
        phases["fsyncs, sequential"] = rec["strace"].get("routes_per_iteration", {})
        phases["fsyncs, C at once"] = rec["strace"]["concurrent"].get("routes_per_iteration", {})
    lines = ["routes the iterations took (the services' counters, per iteration):"]
    for phase, counters in phases.items():
        shown = ", ".join(f"{name} {n:g}" for name, n in counters.items()) or "none counted"
        lines.append(f"  {phase:19} {shown}")
    return "\n".join(lines)


def print_profiles(found: Mapping[str, Any]) -> None:
    print(f"\npy-spy (CPU ms per step while sampled: {found['cpu_ms_per_step_while_sampled']})")
    for name, prof in found["files"].items():
        total = prof["samples"] or 1
        print(f"\n{name}: {prof['samples']} samples in {prof['path']}")
        print(
            "  by package of the running frame: "
            + ", ".join(f"{pkg} {100 * n / total:.0f}%" for pkg, n in prof["by_package"][:12])
        )
        print("  most samples of their own:")
        for frame, n in prof["own"][:15]:
            print(f"    {100 * n / total:5.1f}%  {frame}")
        print("  most samples anywhere on the stack:")
        for frame, n in prof["anywhere"][:25]:
            print(f"    {100 * n / total:5.1f}%  {frame}")


def write_record(rec: Mapping[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{rec['system']}-{rec['variant']}-{int(time.time())}.json"
    path.write_text(json.dumps(rec, indent=1))
    return path


def _git_head() -> str:
    try:
        args = ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"]
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["worker"]:
        targets, task, concurrency = args[1].split(","), args[2], int(args[3])
        apart = dict(arg.partition("=")[::2] for arg in args[4:])
        handlers = {task: turn_handler()}
        if not task.endswith(QUEUED):
            handlers[task + QUEUED] = turn_handler()
        asyncio.run(serve_worker(targets, handlers, concurrency, apart))
        return
    if args:
        raise SystemExit(
            f"usage: python -m bench.bench_turn (knobs: BENCH_* variables); got {args}"
        )
    p = Params.from_env(os.environ)
    out_dir = Path(os.environ.get("BENCH_OUT", "/tmp/peers-results"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dagnats-bench-turn-") as tmp:
        got = asyncio.run(measure(p, Path(tmp)))
    head = _git_head()
    server = "nats-server of the bench" if p.deploy == "split" else "nats-server from dagnats dev"
    settings = {"server": f"{server}, sync_interval: always", "commit": head}
    ours = record(
        "dagnats",
        p.variant,
        results_of(got["dagnats"], p),
        p,
        {
            "versions": {"dagnats": head},
            "settings": settings,
            "messages_per_iteration": got["messages"],
            "routes_per_iteration": got["dagnats"].routes,
            **({"profiles": got["profiles"]} if got["profiles"] else {}),
            **({"strace": got["dagnats"].strace} if got["dagnats"].strace else {}),
        },
    )
    floor = record(
        "nats-raw",
        "always-floor",
        results_of(got["floor"], p),
        p,
        {
            "settings": {**settings, "pattern": "1 get_last_msg + 5 fenced publishes / iteration"},
            **({"strace": got["floor"].strace} if got["floor"].strace else {}),
        },
    )
    paths = [write_record(ours, out_dir), write_record(floor, out_dir)]
    print(
        f"agent turn, K={p.k}, C={p.c}, {p.runs} sequential runs, {p.thr_rounds} rounds, "
        f"{p.start_runs} K=1 runs; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
        f"dagnats {head}, handler in {WHERE[p.deploy]}; {time.perf_counter() - started:.0f}s"
    )
    if p.deploy in ("worker", "grpc"):
        print(
            "connections open on the local socket (the worker's, the client's watches): "
            f"{got['on_socket']}"
        )
    print(format_table(rows(ours, floor)))
    measured = [("dagnats", got["dagnats"].cpu), ("floor", got["floor"].cpu)]
    if got["queued"] is not None:
        # The same dagnats with every iteration through the task queue, as
        # before ADR 31: the baseline of the kept dispatch, in the same run.
        extra = {"strace": got["queued"].strace} if got["queued"].strace else {}
        queued = record("dagnats", "dev-queued", results_of(got["queued"], p), p, extra)
        print("\ndagnats keeping its task (ADR 31) against every iteration through the queue:")
        print(format_table(rows(ours, queued), columns=("kept", "queued")))
        measured.append(("queued", got["queued"].cpu))
    print("\nCPU ms per step by process (thr):")
    for name, cpu in measured:
        print(f"  {name:8} " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()))
    msgs = got["messages"]
    print(f"\nmessages per iteration (untimed runs of K={msgs['iterations']}):")
    print(f"  nats-server counted: {msgs['server']}")
    print(f"  stored, by stream:   {msgs['stored_by_stream']}")
    print("  sent by clients, by kind:")
    for kind, n in msgs["sent_by_kind"].items():
        print(f"    {kind:44} {n:6.2f}")
    print(f"    {'all':44} {sum(msgs['sent_by_kind'].values()):6.2f}")
    for rec in (ours, floor):
        if "strace" in rec:
            st = rec["strace"]
            print(
                f"\nfsync-family calls, {rec['system']}: {st['counts']} over {st['steps']} "
                f"steps; C at once: {st['concurrent']['counts']}; "
                f"idle {st['idle_sync_calls_per_s']:.1f}/s (stored while idle: "
                f"{st.get('idle_stored') or 'nothing'}, messages held changed: "
                f"{st.get('idle_held_change') or 'none'}; fsynced while idle: "
                f"{st.get('idle_sync_calls_by_file') or 'nothing'}; "
                f"still after {st.get('waited_for_still_s')}s)"
            )
    print("\n" + format_routes(ours))
    if got["profiles"]:
        print_profiles(got["profiles"])
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
