"""The HTTP worker example (examples/http-worker) against a real gateway,
engine and nats-server: it completes a durable run, and a worker killed
inside the unsafe tool does not make its successor start the tool again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from subprocess import Popen

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import GatewayServer
from dagnats.sdk import Client, JournalClient, run_output
from tests.helpers import wait_for
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_journal import read_journal

MAIN = Path(__file__).parent.parent / "examples" / "http-worker" / "main.py"
ORDER = {"order": "B-7", "amount_cents": 1200}
ANSWER = "Order B-7: payment submitted."


def spawn(gateway: GatewayServer, task: str, log: Path, env: dict[str, str]) -> Popen[bytes]:
    """The example worker in its own process, its output in ``log``."""
    settings = {**os.environ, "DAGNATS_GATEWAY": gateway.url, "WORKER_POLL_WAIT": "1", **env}
    with open(log, "wb") as out:
        return Popen(
            [sys.executable, str(MAIN), task],
            env=settings,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
        )


@asynccontextmanager
async def http_worker(
    gateway: GatewayServer, task: str, log: Path, **env: str
) -> AsyncIterator[Popen[bytes]]:
    """The example worker, stopped with SIGTERM at the end (if still running)."""
    proc = spawn(gateway, task, log, env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            # Not proc.wait(): the gateway answering its poll runs on this loop.
            await wait_for(lambda: proc.poll() is not None, timeout=15, message="exit")


async def start(client: Client) -> tuple[str, str]:
    task, name = unique("httpworker"), unique("httpworkerwf")
    await client.register_workflow(loop_workflow(name, task, max_iterations=5))
    return task, name


def starts(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def assert_sound(engine: EngineServer, run: pb.Run) -> None:
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == ANSWER
    assert steps_by_id(run)["agent"].iterations == 1
    async with JournalClient(engine.target) as journal:
        assert list((await journal.check(run.run_id)).violations) == []


async def test_the_http_worker_completes_a_durable_run(
    engine: EngineServer, client: Client, gateway: GatewayServer, tmp_path: Path
) -> None:
    task, name = await start(client)
    started = tmp_path / "starts"
    async with http_worker(gateway, task, tmp_path / "worker.log", TOOL_STARTS_FILE=str(started)):
        run = await client.start_run(name, ORDER)
        run = await client.wait_for_run(run.run_id, timeout=30)
    await assert_sound(engine, run)
    assert starts(started) == [f"charge_card {run.run_id}.agent.0.1"]


async def test_a_worker_killed_inside_the_unsafe_tool_does_not_start_it_twice(
    engine: EngineServer, client: Client, gateway: GatewayServer, tmp_path: Path
) -> None:
    task, name = await start(client)
    started, marker = tmp_path / "starts", tmp_path / "hang"
    env = {"TOOL_STARTS_FILE": str(started), "HANG_IN_TOOL_MARKER": str(marker)}
    async with http_worker(gateway, task, tmp_path / "first.log", **env) as first:
        run = await client.start_run(name, ORDER)
        await wait_for(marker.exists, timeout=30, message="the first worker hangs in the tool")
        first.send_signal(signal.SIGKILL)
        await wait_for(lambda: first.poll() is not None, timeout=10, message="killed")
    assert len(starts(started)) == 1

    async with http_worker(gateway, task, tmp_path / "second.log", **env):
        run = await client.wait_for_run(run.run_id, timeout=30)
    await assert_sound(engine, run)
    assert len(starts(started)) == 1
    results = [
        r.tool_result for r in await read_journal(engine, run.run_id) if r.HasField("tool_result")
    ]
    assert len(results) == 1 and results[0].interrupted
    assert results[0].partial == "charging 1200 cents for order B-7;"
