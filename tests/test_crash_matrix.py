"""The crash-point matrix: at every seam of a turn, on iteration 0, on the
unsafe iteration and on the one after it, the worker holding the step is
killed (SIGKILL) or frozen past its lease (SIGSTOP, then SIGCONT: a zombie),
with two engines sharing the history consumer. Every case must end with the
crash-free answer, a clean journal, the engine's iteration count equal to the
commits, and the unsafe tool started at most once: stopped with the model's
response pending (``model_pending``) the model is asked again, and with the
unsafe tool's result pending (``result_pending``) it comes back interrupted,
never started again."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, run_output
from tests.helpers import body, holds, wait_for
from tests.matrix import (
    APART,
    CASES,
    MATRIX,
    WORKER_SEAMS,
    activate,
    crash_in_group,
    group_outcome,
    lines,
    reap,
    spawn_worker,
    zombie_turn,
)
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_journal import journal_check, read_journal


@pytest.fixture(scope="module")
def where() -> str:
    """Where the streams live; the cluster module overrides it."""
    return "one server"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: Any) -> AsyncIterator[EngineServer]:
    server = await start_engine(nats_server.url, config=MATRIX)
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def second_engine(nats_server: Any, engine: EngineServer) -> AsyncIterator[EngineServer]:
    server = await start_engine(nats_server.url, config=MATRIX)
    yield server
    await server.stop()


# Every seam on iterations 0, 1 (the unsafe one) and 2; the seams of records
# stored on their own (``APART``: the agent awaits between its calls) on the
# unsafe iteration only, where a result stored or not decides whether the
# tool comes back interrupted.
POINTS = [(seam, at) for seam in WORKER_SEAMS for at in ((1,) if seam in APART else (0, 1, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "stall"])
@pytest.mark.parametrize(("seam", "iteration"), POINTS)
async def test_crash_point(
    engine: EngineServer,
    second_engine: EngineServer,
    client: Client,
    where: str,
    tmp_path: Path,
    seam: str,
    mode: str,
    iteration: int,
) -> None:
    task, name = unique("matrix"), unique("matrixwf")
    await client.register_workflow(loop_workflow(name, task))
    crasher = spawn_worker(
        engine.target, task, tmp_path, f"{seam}:{iteration}", apart=seam in APART
    )
    successor = spawn_worker(second_engine.target, task, tmp_path, standby=True)
    try:
        await wait_for(lambda: (tmp_path / f"ready-{seam}:{iteration}").exists(), timeout=30)
        run = await client.start_run(name, {"ask": "weather"})
        await wait_for(lambda: (tmp_path / "hit").exists(), timeout=30, message="seam not reached")
        if mode == "kill":
            crasher.kill()
            crasher.wait()
        else:
            os.kill(crasher.pid, signal.SIGSTOP)
        await activate(successor, tmp_path, "clean")
        done = await client.wait_for_run(run.run_id, timeout=60)
        if mode == "stall":
            os.kill(crasher.pid, signal.SIGCONT)  # the zombie wakes and tries its next write
            await wait_for(
                lambda: zombie_turn(tmp_path, crasher.pid, iteration),
                timeout=30,
                message="the zombie never finished its turn",
            )
    finally:
        reap(crasher, successor)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == "done"
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations
    assert steps_by_id(done)["agent"].iterations == 3
    sends = [line for line in lines(tmp_path, "starts") if line.startswith("send")]
    assert len(sends) <= 1, f"the unsafe tool started {len(sends)} times"
    # What each window costs: a response lost before its record is asked for
    # again, and a tool whose result was lost comes back as its declaration says.
    asked = lines(tmp_path, "model").count(str(iteration))
    assert asked == (2 if seam == "model_pending" else 1), f"the model was asked {asked} times"
    if seam == "result_pending":
        tool = "send" if iteration == 1 else "search"
        starts = lines(tmp_path, "starts").count(f"{tool} {iteration}")
        assert starts == (1 if tool == "send" else 2), f"{tool} started {starts} times"
        records = await read_journal(engine, run.run_id)
        (result,) = [
            body(r, "tool_result")
            for r in records
            if r.iteration == iteration and holds(r, "tool_result")
        ]
        assert result.interrupted == (tool == "send")
    if mode == "stall":
        # Woken after its successor took over, the zombie is fenced -- by its next
        # write, or by the fence check before its next heartbeat, which stops the
        # handler -- or finds its dispatch settled, or is stopped because its run
        # ended (a holder that never claimed); one past its last write returns.
        outcome = zombie_turn(tmp_path, crasher.pid, iteration)
        log = (tmp_path / f"worker-{seam}:{iteration}.log").read_text()
        fenced = outcome == "Fenced" or (
            outcome == "CancelledError" and "a successor holds the step" in log
        )
        assert fenced or outcome in ("Stale", "Committed", "returned", "CancelledError"), outcome
        if seam not in ("before_claim", "after_event"):
            assert fenced, f"a zombie with writes left must be fenced, got {outcome}"
    CASES[where, f"{seam}/{mode}"] += 1


# Seams inside a parallel group of three calls (``tests/workers/agent.py``,
# ``GROUPS``), on iteration 0: its intents stored and no call started; one
# result stored (between results); two stored (after some results).
GROUP_SEAMS = ("after_group_intents", "after_group_result@1", "after_group_result@2")
GROUP_POINTS = [
    (seam, kind, mode)
    for seam in GROUP_SEAMS
    for kind in ("safe", "unsafe", "mixed")
    for mode in ("kill", "stall")
]


@pytest.mark.slow
@pytest.mark.parametrize(("seam", "kind", "mode"), GROUP_POINTS)
async def test_crash_point_in_a_parallel_group(
    engine: EngineServer,
    second_engine: EngineServer,
    client: Client,
    where: str,
    tmp_path: Path,
    seam: str,
    kind: str,
    mode: str,
) -> None:
    done, crasher = await crash_in_group(
        engine.target, second_engine.target, client, tmp_path, seam, kind, mode
    )
    await group_outcome(engine.target, done, crasher, tmp_path, seam, kind, mode)
    CASES[where, f"{seam}/{kind}/{mode}"] += 1
