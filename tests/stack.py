"""Helpers to run the engine and workers in tests against a real nats-server."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dagnats.engine.config import EngineConfig

# Short leases and fast reconciling keep crash tests quick; nothing else differs.
FAST = EngineConfig(
    task_ack_wait=2.0,
    history_ack_wait=5.0,
    reconcile_interval=0.5,
    outbox_grace=1.0,
)

_names = itertools.count()


def dev_args(data_dir: Path, *flags: str) -> list[str]:
    """``dagnats dev`` arguments: every port free, the data in ``data_dir``."""
    from dagnats.core.natsserver import free_port

    ports = ("--nats-port", "--engine-port", "--gateway-port", "--metrics-port")
    return [
        "dev",
        "--data-dir",
        str(data_dir),
        *(arg for flag in ports for arg in (flag, str(free_port()))),
        *flags,
    ]


def start_dev(
    data_dir: Path,
    *flags: str,
    env: Mapping[str, str] | None = None,
    stderr: Path | None = None,
) -> DevProcess:
    """``dagnats dev`` in its own process, returned once it serves. Its
    stderr goes to the file ``stderr`` when given (readable while it runs)."""
    args = [sys.executable, "-m", "dagnats.cli.main", *dev_args(data_dir, *flags)]
    if stderr is None:
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    else:
        with stderr.open("w") as err:  # the child keeps its own copy open
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    printed: dict[str, str] = {}
    for line in proc.stdout:
        name, _, rest = line.partition(" ")
        if name in ("nats-server", "engine", "gateway") and rest.strip():
            printed[name] = rest.split()[0]
        if line.startswith("serving"):
            return DevProcess(proc, printed)
    proc.kill()
    _out, problem = proc.communicate()
    if stderr is not None:
        problem = stderr.read_text()
    raise AssertionError(f"dagnats dev did not start: {problem}")


class DevProcess:
    """A running ``dagnats dev`` and the addresses it printed."""

    def __init__(self, proc: subprocess.Popen[str], printed: dict[str, str]) -> None:
        self.proc = proc
        self.gateway = printed["gateway"]
        self.engine = printed["engine"]


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    """A temporary directory whose paths fit a Unix socket's address (107
    bytes), which a test's own temporary directory may not."""
    with tempfile.TemporaryDirectory(prefix="dagnats-") as path:
        yield Path(path)


def unique(prefix: str) -> str:
    """A name no other test in the session uses (workflows, task types)."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def loop_workflow(name: str, task: str, *, max_iterations: int = 20, **step: Any) -> dict[str, Any]:
    return {
        "name": name,
        "steps": [
            {
                "id": "agent",
                "type": "agent_loop",
                "task": task,
                "agent_loop": {"max_iterations": max_iterations, **step.pop("agent_loop", {})},
                **step,
            }
        ],
    }


def spawn_worker(target: str, task: str, *, crash_at: int, marker: Path) -> subprocess.Popen[bytes]:
    """A worker in its own process that hangs at iteration ``crash_at`` after
    writing ``marker``, so the test can kill it mid-iteration. Its output goes
    to ``marker`` + ``.log``."""
    script = Path(__file__).parent / "workers" / "crashy_worker.py"
    args = [sys.executable, str(script), target, task, str(crash_at), str(marker)]
    with open(f"{marker}.log", "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def decode(raw: bytes) -> Any:
    return json.loads(raw) if raw else None


def steps_by_id(run: Any) -> Mapping[str, Any]:
    return {s.step_id: s for s in run.steps}
