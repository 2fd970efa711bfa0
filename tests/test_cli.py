"""The ``dagnats`` command as a user runs it: a real process, real output."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagnats.core.natsserver import free_port
from dagnats.engine.server import EngineServer
from tests.stack import dev_args, start_dev, unique


def dagnats(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "dagnats.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


async def adagnats(*args: str, env: dict[str, str] | None = None) -> Any:
    """The CLI in a thread, so the engine on this event loop keeps serving."""
    return await asyncio.to_thread(dagnats, *args, env=env)


def test_dev_runs_the_demo_and_a_second_start_finds_it(tmp_path: Path) -> None:
    args = dev_args(tmp_path / "data", "--exit-after-demo")
    first = dagnats(*args)
    assert first.returncode == 0, first.stderr
    assert "status    completed" in first.stdout
    # The commands it prints name the data directory, so they find this engine.
    assert "Lisbon" in first.stdout
    assert f"dagnats --data-dir {tmp_path / 'data'} run get" in first.stdout
    second = dagnats(*args)
    assert second.returncode == 0, second.stderr
    assert "found 1 earlier run(s)" in second.stdout


async def test_cli_round_trip_and_json(engine: EngineServer, tmp_path: Path) -> None:
    name = unique("cli")
    spec = tmp_path / "wf.yaml"
    spec.write_text(f"name: {name}\nsteps:\n  - id: only\n    task: {unique('t')}\n")
    env = {"DAGNATS_ENGINE": engine.target}
    applied = await adagnats("workflow", "apply", str(spec), env=env)
    assert applied.returncode == 0, applied.stderr
    assert f"workflow {name} registered (1 steps)" in applied.stdout
    started = await adagnats("run", "start", name, "--input", '{"a": 1}', "--json", env=env)
    assert started.returncode == 0, started.stderr
    run = json.loads(started.stdout)
    assert run["status"] == "running" and run["input"] == {"a": 1}
    got = await adagnats("run", "cancel", run["run_id"], "--json", env=env)
    assert json.loads(got.stdout)["status"] == "cancelled"
    shown = await adagnats("run", "get", run["run_id"], env=env)
    assert "status    cancelled" in shown.stdout
    assert "usage     none reported by its model calls" in shown.stdout  # no model was called
    listed = await adagnats("run", "list", "--workflow", name, "--json", env=env)
    assert [r["run_id"] for r in json.loads(listed.stdout)] == [run["run_id"]]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "get", "0" * 32], "does not exist"),
        (["run", "get", "not.a.run"], "run_id must be"),
        (["run", "start", "ghost-workflow"], "not registered"),
        (["run", "start", "x", "--input", "{bad"], "--input is not valid JSON"),
        (["workflow", "apply", "/nonexistent.yaml"], "cannot read"),
    ],
)
async def test_errors_are_one_line_and_exit_non_zero(
    engine: EngineServer, args: list[str], needle: str
) -> None:
    result = await adagnats(*args, env={"DAGNATS_ENGINE": engine.target})
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


async def test_bad_definition_file_names_the_problem(engine: EngineServer, tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nsteps:\n  - id: a.b\n    task: t\n")
    result = await adagnats("workflow", "apply", str(spec), env={"DAGNATS_ENGINE": engine.target})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "a.b" in result.stderr


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_unreachable_engine_is_one_line() -> None:
    result = dagnats("run", "list", env={"DAGNATS_ENGINE": f"127.0.0.1:{free_port()}"}, timeout=60)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1


async def test_journal_check_passes_then_catches_a_corrupted_journal(engine: EngineServer) -> None:
    from dagnats.journal.v1 import journal_pb2 as jpb
    from dagnats.sdk import Client, Worker
    from dagnats.sdk.testing import ScriptedModel
    from tests.journal_agent import SCRIPT, Tools, agent
    from tests.stack import loop_workflow

    task, name = unique("jcli"), unique("jcliwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        handler = agent(ScriptedModel(SCRIPT), Tools())
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name)
            await client.wait_for_run(run.run_id, timeout=30)
    env = {"DAGNATS_ENGINE": engine.target}
    clean = await adagnats("journal", "check", run.run_id, env=env)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "0 violations" in clean.stdout

    # A second commit for iteration 0, written around the fence by hand.
    js = engine.nc.jetstream()
    subject = f"journal.{run.run_id}.agent"
    first = await js.get_msg("AGENT_JOURNAL", seq=1, subject=subject, next=True)
    forged = jpb.Record(run_id=run.run_id, step_id="agent", iteration=0, attempt=1, writer="f" * 16)
    forged.commit.action = jpb.ACTION_CONTINUE
    await js.publish(subject, forged.SerializeToString())
    assert first.seq
    corrupt = await adagnats("journal", "check", run.run_id, env=env)
    assert corrupt.returncode == 1
    assert "commit_count" in corrupt.stdout and "iteration 0" in corrupt.stdout


@pytest.mark.parametrize(
    "sigs", [("SIGINT",), ("SIGTERM",), ("SIGINT", "SIGINT")], ids=["int", "term", "int-twice"]
)
def test_dev_stops_cleanly_on_a_signal(tmp_path: Path, sigs: tuple[str, ...]) -> None:
    # A second Ctrl-C while it stops (an impatient user) changes nothing.
    import signal as signals

    dev = start_dev(tmp_path, "--no-demo")
    proc = dev.proc
    try:
        # The gateway dev started answers over HTTP, backed by the engine.
        assert httpx.get(f"{dev.gateway}/readyz", timeout=10).status_code == 200
        assert httpx.get(f"{dev.gateway}/runs", timeout=10).json() == {"runs": []}
        first, *again = sigs
        proc.send_signal(getattr(signals, first))
        if again:
            # Sent while it stops: once the gateway, stopped first, answers no more.
            deadline = time.monotonic() + 30
            while _answers(f"{dev.gateway}/readyz") and time.monotonic() < deadline:
                pass
            for sig in again:
                proc.send_signal(getattr(signals, sig))
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
        _out, err = proc.communicate()
    assert code in (0, 130), err
    assert "Traceback" not in err
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "nats-server stopped with dev"


async def test_run_watch_prints_until_the_run_ends(engine: EngineServer) -> None:
    name = unique("watch")
    from dagnats.sdk import Client

    async with Client(engine.target) as client:
        await client.register_workflow(
            {"name": name, "steps": [{"id": "only", "task": unique("idle")}]}
        )
        run = await client.start_run(name)
        watcher = asyncio.create_task(
            adagnats("run", "watch", run.run_id, "--json", env={"DAGNATS_ENGINE": engine.target})
        )
        await client.cancel_run(run.run_id, "enough")
        result = await watcher
    assert result.returncode == 0, result.stderr
    states = [json.loads(line)["status"] for line in result.stdout.splitlines()]
    assert states[-1] == "cancelled"


VALID = "name: {name}\nsteps:\n  - id: agent\n    type: agent_loop\n    task: t\n"
INVALID = [
    "name: bad\nsteps:\n  - id: a.b\n    task: t\n",  # not a token
    "name: bad\nsteps:\n  - id: a\n    task: t\n    depends_on: [b]\n",  # unknown step
    "name: bad\nsteps:\n  - {id: a, task: t, depends_on: [b]}\n"
    "  - {id: b, task: t, depends_on: [a]}\n",  # a cycle
    "name: bad\nsteps:\n  - id: a\n    task: t\n    timeout: soon\n",  # not a duration
    "name: bad\nsteps: [\n",  # not YAML
    "- just\n- a list\n",
    "",
]


async def test_workflow_validate_checks_a_file_offline_with_the_engines_messages(
    engine: EngineServer, tmp_path: Path
) -> None:
    offline = {"DAGNATS_ENGINE": f"127.0.0.1:{free_port()}"}  # no engine there
    good = tmp_path / "good.yaml"
    name = unique("valid")
    good.write_text(VALID.format(name=name))
    ok = await adagnats("workflow", "validate", str(good), env=offline)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == f"workflow {name} is valid (1 steps)\n"
    as_json = await adagnats("workflow", "validate", str(good), "--json", env=offline)
    assert json.loads(as_json.stdout)["steps"][0]["agent_loop"]["max_iterations"] > 0

    for i, text in enumerate(INVALID):
        bad = tmp_path / f"bad{i}.yaml"
        bad.write_text(text)
        checked = await adagnats("workflow", "validate", str(bad), env=offline)
        applied = await adagnats(
            "workflow", "apply", str(bad), env={"DAGNATS_ENGINE": engine.target}
        )
        assert checked.returncode == 1 and checked.stdout == "", (text, checked.stdout)
        assert checked.stderr.startswith("error: ") and checked.stderr.count("\n") == 1
        # The same words the engine answers when the file is applied.
        assert applied.returncode == 1
        assert checked.stderr == applied.stderr, (text, checked.stderr, applied.stderr)
    missing = await adagnats("workflow", "validate", str(tmp_path / "none.yaml"), env=offline)
    assert missing.returncode == 1 and "cannot read" in missing.stderr


def test_dev_keeps_a_port_that_only_closed_connections_hold() -> None:
    """A stopped server leaves its side of closed connections in TIME_WAIT on
    its port; the next ``dagnats dev`` takes that port again, and moves only
    off a port a server still listens on."""
    import socket

    from dagnats.cli.dev import _port_or_free

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    assert _port_or_free(port) != port, "a port a server listens on is in use"
    accepted.close()  # the server's side closes first: it is the one in TIME_WAIT
    client.close()
    listener.close()
    assert _port_or_free(port) == port
