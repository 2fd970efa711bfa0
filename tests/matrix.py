"""Processes and bookkeeping shared by the crash-point matrix modules and the
chaos soak: matrix workers, engine processes that can be killed, frozen and
started again on their port, and the count of cases by seam and mode that
``conftest.py`` prints at the end of a run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc.aio

from dagnats.core.natsserver import free_port
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, run_output
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, steps_by_id, unique
from tests.workers import agent

WORKERS = Path(__file__).parent / "workers"
MATRIX_WORKER = WORKERS / "matrix_worker.py"
ENGINE_PROCESS = WORKERS / "engine_process.py"

# One-second leases: a holder that stopped loses its task a second after its
# last heartbeat (it sends one every third of a lease), which is most of what a
# case waits for.
MATRIX = dataclasses.replace(FAST, task_ack_wait=1.0)

# The worker's seams the matrix stops a holder at; ``inside_tool`` is the
# tools' own, inside a tool once its start is counted. A model response rides
# the intent of the tool it asks for and a result rides the commit (leading entries):
# ``model_pending`` and ``result_pending`` are the windows before those
# records, ``after_model`` and ``after_result`` the records stored on their
# own, which the matrix's agent does when it awaits something between its
# calls (``APART``).
WORKER_SEAMS = (
    "before_claim",
    "after_claim",
    "model_pending",
    "after_model",
    "after_intent",
    "inside_tool",
    "result_pending",
    "after_result",
    "after_event",
)
APART = frozenset({"after_model", "after_result"})

# The approval seams the matrix stops a holder at (``tests/test_approvals.py``),
# for a single call needing approval and for such a call inside a parallel
# group of three: the ask stored, not yet answered ``awaiting_approval``; the
# approval placed by the iteration it woke, the call not yet made; the
# approved call's intent stored (a group's, its intents), the tool not yet
# started; the approved tool returned, its result stored nowhere. ``:2`` is
# the seam's second pass, the iteration the approval woke.
APPROVAL_SEAMS = {
    "call": (
        "after_approval_intent",
        "after_approval_placed:2",
        "after_intent:2",
        "approved_tool_returned",
    ),
    "group": (
        "after_approval_intent",
        "after_approval_placed:2",
        "after_group_intents:2",
        "approved_tool_returned",
    ),
}

# (where, "seam/mode") -> cases run; printed by conftest.pytest_terminal_summary.
CASES: Counter[tuple[str, str]] = Counter()


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def spawn_worker(
    target: str,
    task: str,
    state: Path,
    crash: str = "",
    *,
    gate: int | None = None,
    inputs: bool = False,
    name: str = "",
    standby: bool = False,
    stream: bool = False,
    apart: bool = False,
    group: str = "",
    journal: str = "",
) -> subprocess.Popen[bytes]:
    """A matrix worker process (see ``tests/workers/matrix_worker.py``); it
    writes ``state/ready-<name or crash or 'clean'>`` once it polls (with
    ``standby``, only once :func:`activate` let it)."""
    args = [sys.executable, str(MATRIX_WORKER), target, task, str(state), crash]
    if apart:
        args.append("--apart")
    if gate is not None:
        args += ["--gate", str(gate)]
    if inputs:
        args.append("--inputs")
    if name:
        args += ["--name", name]
    if standby:
        args.append("--standby")
    if stream:
        args.append("--stream")
    if group:
        args += ["--group", group]
    if journal:
        args += ["--journal", journal]
    with open(state / f"worker-{name or crash or 'clean'}.log", "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env())


async def activate(worker: subprocess.Popen[bytes], state: Path, label: str) -> None:
    """Let a standby worker start polling."""
    await wait_for(lambda: (state / f"standby-{label}").exists(), timeout=30)
    worker.send_signal(signal.SIGUSR2)


def lines(state: Path, name: str) -> list[str]:
    path = state / name
    return path.read_text().splitlines() if path.exists() else []


def zombie_turn(state: Path, pid: int, iteration: int) -> str | None:
    """How the frozen holder's turn ended once it woke, if it has."""
    for line in lines(state, "turns"):
        who, at, outcome = line.split()
        if (int(who), int(at)) == (pid, iteration):
            return outcome
    return None


def reap(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL (a frozen process too) and wait."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class EngineProcess:
    """The engine, journal and inputs services in a process of their own
    (``tests/workers/engine_process.py``) on a port that survives restarts,
    so workers dialling it reconnect to the next process as they would to a
    restarted service. ``arm`` and ``hit`` are the seam files the launcher
    watches; without them it installs no hook. ``env`` adds variables, such
    as ``DAGNATS_*`` settings (a replica's partitions, lease and name, say);
    ``stream_replicas`` is the streams' replication."""

    def __init__(
        self,
        nats_url: str,
        state: Path,
        name: str,
        *,
        stream_replicas: int = 1,
        arm: Path | None = None,
        hit: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.state = state
        self.name = name
        self.stream_replicas = stream_replicas
        self.arm = arm
        self.hit = hit
        self.env = env or {}
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, *, within: float = 30.0) -> None:
        """Start a fresh process on the same port and wait until it serves."""
        assert not self.running, f"{self.name} is still running"
        ready = self._spawn()
        await wait_for(
            lambda: ready.exists() or not self.running,
            timeout=within,
            message=f"{self.name} serving",
        )
        assert self.running, f"{self.name} exited; see {self.state / f'{self.name}.log'}"

    def _spawn(self) -> Path:
        ready = self.state / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        env = child_env(**self.env)
        if self.arm is not None and self.hit is not None:
            env |= {"DAGNATS_TEST_SEAM_ARM": str(self.arm), "DAGNATS_TEST_SEAM_HIT": str(self.hit)}
        args = [sys.executable, str(ENGINE_PROCESS), self.nats_url, str(self.port), str(ready)]
        args.append(str(self.stream_replicas))
        with open(self.state / f"{self.name}.log", "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.starts += 1
        return ready

    async def exited(self, *, within: float = 10.0) -> None:
        await wait_for(lambda: not self.running, timeout=within, message=f"{self.name} exits")

    def kill(self) -> None:
        reap(self.proc)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.running:
            os.kill(self.pid, signal.SIGCONT)

    async def stop(self) -> None:
        """SIGTERM and a short grace, then SIGKILL; a frozen process is thawed first."""
        if not self.running:
            return
        self.thaw()
        assert self.proc is not None
        self.proc.terminate()
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: not self.running, timeout=5.0)
        self.kill()

    def log_tail(self, lines: int = 80) -> str:
        """The last lines of this engine's log, every process it ran appended."""
        path = self.state / f"{self.name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def ensure_serving(self) -> None:
        """Thaw a frozen process, start a dead one: the state a case expects."""
        if self.running:
            self.thaw()
        else:
            await self.start()


@contextlib.contextmanager
def logs_on_failure(*engines: EngineProcess) -> Iterator[None]:
    """Print the engines' log tails when the block fails: a failure on a
    loaded machine is read from them."""
    try:
        yield
    except BaseException:
        for engine in engines:
            print(f"---- {engine.name} (pid {engine.proc and engine.proc.pid}) ----")
            print(engine.log_tail())
        raise


# ---- parallel groups ------------------------------------------------------------


def group_starts(state: Path) -> Counter[str]:
    """Starts of each call of the group, by ``tool n`` (its place)."""
    return Counter(" ".join(line.split()[::2][:2]) for line in lines(state, "starts") if line)


async def crash_in_group(
    target: str,
    successor_target: str,
    client: Client,
    state: Path,
    seam: str,
    kind: str,
    mode: str,
    *,
    journal: str = "",
) -> tuple[pb.Run, int]:
    """Run a group agent whose holder stops at ``seam`` of iteration 0 and is
    killed or frozen; a standby successor finishes the run (a frozen holder
    is thawed then, and its turn waited for). Returns the run and the pid of
    the holder."""
    task, name = unique("gmatrix"), unique("gmatrixwf")
    await client.register_workflow(loop_workflow(name, task))
    crash = f"{seam}:0"
    crasher = spawn_worker(target, task, state, crash, group=kind, journal=journal)
    successor = spawn_worker(
        successor_target, task, state, standby=True, group=kind, journal=journal
    )
    try:
        await wait_for(lambda: (state / f"ready-{crash}").exists(), timeout=30)
        run = await client.start_run(name, {"ask": "weather"})
        await wait_for(lambda: (state / "hit").exists(), timeout=30, message="seam not reached")
        if mode == "kill":
            crasher.kill()
            crasher.wait()
        else:
            os.kill(crasher.pid, signal.SIGSTOP)
        await activate(successor, state, "clean")
        done = await client.wait_for_run(run.run_id, timeout=60)
        if mode == "stall":
            os.kill(crasher.pid, signal.SIGCONT)
            await wait_for(
                lambda: zombie_turn(state, crasher.pid, 0),
                timeout=30,
                message="the zombie never finished its turn",
            )
    finally:
        reap(crasher, successor)
    return done, crasher.pid


async def group_outcome(
    target: str, done: pb.Run, crasher: int, state: Path, seam: str, kind: str, mode: str
) -> None:
    """What every group case must end with: the crash-free answer, a clean
    journal, each unsafe call started at most once, the stored results
    reused, the safe calls without one run again, the unsafe ones without
    one interrupted, and a zombie fenced."""
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == "done"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        check = await stub.Check(jpb.CheckRequest(run_id=done.run_id))
        records = [
            r.record async for r in stub.Read(jpb.ReadRequest(run_id=done.run_id, step_id="agent"))
        ]
    assert list(check.violations) == [], check.violations
    assert steps_by_id(done)["agent"].iterations == 1
    assert lines(state, "model").count("0") == 1, "the response rode the group's intents"
    stored = 0 if seam == "after_group_intents" else int(seam.rpartition("@")[2])
    starts = group_starts(state)
    calls = agent.GROUPS[kind]
    (group,) = [r for r in records if r.HasField("tool_intents")]
    results = {
        r.tool_result.intent_index: r.tool_result
        for r in records
        if r.HasField("tool_result") and r.tool_result.intent_seq == group.seq
    }
    for n, call in enumerate(calls):
        key = f"{call['tool']} {n}"
        unsafe = call["tool"] == "send"
        # The holder started every call unless it stopped before any started;
        # frozen there, it starts them once thawed, and is fenced at its first write.
        ran_by_holder = seam != "after_group_intents" or mode == "stall"
        if unsafe:
            assert starts[key] <= 1, f"the unsafe call {key} started {starts[key]} times"
        if n < stored:
            assert starts[key] == 1 and not results[n].interrupted, f"{key}: its result reused"
        elif unsafe:
            assert results[n].interrupted, f"{key}: no result, so interrupted"
        else:
            assert starts[key] == (2 if ran_by_holder else 1), f"{key} ran {starts[key]} times"
    if mode == "stall":
        outcome = zombie_turn(state, crasher, 0)
        log = (state / f"worker-{seam}:0.log").read_text()
        fenced = outcome == "Fenced" or (
            outcome == "CancelledError" and "a successor holds the step" in log
        )
        assert fenced, f"a zombie inside a group must be fenced, got {outcome}"
        late = [
            r
            for r in records
            if r.HasField("tool_result")
            and r.seq
            > max(c.seq for c in records if c.HasField("claim") or c.HasField("leading_claim"))
            and r.writer == group.writer
        ]
        assert late == [], "the zombie stored no result after its successor's claim"
