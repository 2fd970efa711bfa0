"""A worker process streaming a journaled model call to an SSE reader through
a real gateway, SIGKILLed or frozen past its lease (SIGSTOP, then SIGCONT: a
zombie) halfway through its tokens. The crash-point matrix's worker does the
streaming (``tests/workers/matrix_worker.py --stream``), with two engines
sharing the history consumer: the holder on the gateway's engine, its
successor on the other. A reader must see the killed stream ``abandoned`` and
the successor's marked as its retry, the request sent again, the record's text
equal to the successor's tokens, and nothing of the zombie's as current once
the successor claimed; ``journal check`` passes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client
from tests.helpers import body, holds, wait_for
from tests.matrix import activate, lines, reap, spawn_worker, zombie_turn
from tests.stack import loop_workflow, unique
from tests.test_crash_matrix import engine, second_engine
from tests.test_journal import journal_check, read_journal
from tests.test_live_stream import Sse, sse
from tests.workers import agent

__all__ = ["engine", "second_engine"]  # the matrix's engines: one-second leases

INPUT = {"ask": "weather"}
REPLY = agent.reply_for([INPUT])  # iteration 0's reply
TOKENS = agent.reply_tokens(REPLY)
HALF = "".join(TOKENS[: len(TOKENS) // 2])  # what a holder puts before its seam
HOLD = "inside_stream:0"  # the seam halfway through iteration 0's tokens (as a crash)


async def read(
    stream: AsyncIterator[Sse], events: list[Sse], done: Callable[[list[Sse]], bool]
) -> None:
    """Append the stream's events to ``events`` until ``done(events)``."""

    async def more() -> None:
        async for event in stream:
            events.append(event)
            if done(events):
                return
        raise AssertionError(f"the stream ended after {len(events)} events")

    await asyncio.wait_for(more(), 30)


def text(events: list[Sse], writer: str) -> str:
    """The text of ``writer``'s tokens among ``events``."""
    tokens = [e for e in events if e.type == "token" and e.data["writer"] == writer]
    return "".join(e.data["text"] for e in tokens)


def committed(iteration: int) -> Callable[[list[Sse]], bool]:
    return lambda got: got[-1].type == "committed" and got[-1].data["iteration"] == iteration


@dataclass
class Stopped:
    run_id: str
    holder: subprocess.Popen[bytes]  # stopped at its seam of iteration 0
    successor: subprocess.Popen[bytes]  # on standby until activated
    stream: AsyncIterator[Sse]
    events: list[Sse]  # what the reader saw of the holder's tokens


@asynccontextmanager
async def stopped(
    engines: tuple[EngineServer, EngineServer],
    client: Client,
    http: httpx.AsyncClient,
    state: Path,
    *,
    seam: str = "inside_stream",
    successor_crash: str = "",
) -> AsyncIterator[Stopped]:
    """A run whose holder (a worker process on the gateway's engine) stopped at
    ``seam`` of iteration 0 (``inside_stream``: once a reader saw the first
    half of its tokens); its successor (on the other engine, stopping at
    ``successor_crash``) waits on standby. Both are killed at the end."""
    task, name = unique("livecrash"), unique("livecrashwf")
    await client.register_workflow(loop_workflow(name, task))
    crash = f"{seam}:0"
    holder = spawn_worker(engines[0].target, task, state, crash, standby=True, stream=True)
    successor = spawn_worker(
        engines[1].target, task, state, successor_crash, name="successor", standby=True, stream=True
    )
    try:
        run = await client.start_run(name, INPUT)
        async with sse(http, run.run_id) as stream:
            await activate(holder, state, crash)
            await wait_for((state / "hit").exists, timeout=30, message="the seam not reached")
            events: list[Sse] = []
            if seam == "inside_stream":
                await read(stream, events, lambda got: "".join(e.data["text"] for e in got) == HALF)
            yield Stopped(run.run_id, holder, successor, stream, events)
    finally:
        reap(holder, successor)


async def test_a_killed_streamer_is_abandoned_and_its_successor_retries(
    engine: EngineServer,
    second_engine: EngineServer,
    client: Client,
    http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    async with stopped((engine, second_engine), client, http, tmp_path) as at:
        at.holder.kill()  # SIGKILL mid-stream
        at.holder.wait()
        await activate(at.successor, tmp_path, "successor")
        await read(at.stream, at.events, committed(0))
        done = await client.wait_for_run(at.run_id, timeout=60)
    events = at.events
    killed, retried = list(dict.fromkeys(e.data["writer"] for e in events if e.type == "token"))
    assert text(events, killed) == HALF
    first = next(e for e in events if e.type == "token")
    abandoned = [e for e in events if e.type == "abandoned"]
    assert [(e.data["stream"], e.data["reason"]) for e in abandoned] == [
        (first.data["stream"], "superseded")
    ]
    retry = [e for e in events if e.type == "token" and e.data["writer"] == retried]
    assert events.index(abandoned[0]) < events.index(retry[0])
    assert all(e.data["retry_of"] == first.data["stream"] for e in retry)
    assert (retry[0].data["iteration"], retry[0].data["position"]) == (0, 0)
    assert lines(tmp_path, "model").count("0") == 2, "the model request was sent again"
    records = await read_journal(engine, at.run_id)
    (model,) = [r for r in records if holds(r, "model") and r.iteration == 0]
    end = events[-1]
    assert end.data["record_seq"] == model.seq and end.data["writer"] == retried
    assert body(model, "model").response.decode() == text(events, retried) == "".join(TOKENS)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    check = await journal_check(engine, at.run_id)
    assert list(check.violations) == [], check.violations


@pytest.mark.parametrize("seam", ["before_tokens", "inside_stream"])
async def test_a_frozen_streamer_woken_after_its_successor_claimed_shows_nothing(
    engine: EngineServer,
    second_engine: EngineServer,
    client: Client,
    http: httpx.AsyncClient,
    tmp_path: Path,
    seam: str,
) -> None:
    """Frozen past its lease in its model call, before its first token (its
    stream begins after the claim) or halfway (its stream is open at the
    claim), the holder wakes while its successor streams and puts the rest."""
    hit = tmp_path / "hit"
    # The successor stops halfway too, so the zombie streams while the
    # successor's stream is open; SIGCONT lets it go on.
    engines = (engine, second_engine)
    async with stopped(engines, client, http, tmp_path, seam=seam, successor_crash=HOLD) as at:
        os.kill(at.holder.pid, signal.SIGSTOP)  # past its lease: the successor claims
        hit.unlink()
        await activate(at.successor, tmp_path, "successor")
        await wait_for(hit.exists, timeout=30, message="the successor never streamed")
        os.kill(at.holder.pid, signal.SIGCONT)  # the zombie wakes and puts the rest
        outcome = await wait_for(
            lambda: zombie_turn(tmp_path, at.holder.pid, 0),
            timeout=30,
            message="the zombie never finished its turn",
        )
        at.successor.send_signal(signal.SIGCONT)
        await read(at.stream, at.events, committed(agent.ITERATIONS))  # the run's last answer
        done = await client.wait_for_run(at.run_id, timeout=60)
    # Fenced by its next write, or by the fence check of its next heartbeat.
    log = (tmp_path / f"worker-{seam}:0.log").read_text()
    assert outcome == "Fenced" or "a successor holds the step" in log, outcome
    put = [line for line in lines(tmp_path, "tokens") if line.startswith(f"{at.holder.pid} 0 ")]
    assert len(put) == len(TOKENS), "the zombie did not stream after it woke"
    records = await read_journal(engine, at.run_id)
    # The zombie stored nothing, not even its claim: a first delivery's
    # claim rides the first record, which its successor fenced.
    (successor,) = (r.writer for r in records if holds(r, "claim") and r.iteration == 0)
    events = at.events
    stored = {r.writer for r in records}
    shown = [e for e in events if e.data["writer"] not in stored]
    if seam == "before_tokens":
        assert shown == [], "a fenced holder's stream was shown"
    else:
        (zombie,) = {e.data["writer"] for e in shown}
        assert text(events, zombie) == HALF, "the zombie's later chunks were shown"
        abandoned = shown[-1]  # sent at the successor's claim; nothing of the zombie after it
        assert (abandoned.type, abandoned.data["reason"]) == ("abandoned", "superseded")
        retry = [e for e in events if e.type == "token" and e.data["writer"] == successor]
        assert events.index(abandoned) < events.index(retry[0])
        assert all(e.data["retry_of"] == abandoned.data["stream"] for e in retry)
    (model,) = [r for r in records if holds(r, "model") and r.iteration == 0]
    assert model.writer == successor
    assert body(model, "model").response.decode() == text(events, successor) == "".join(TOKENS)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    check = await journal_check(engine, at.run_id)
    assert list(check.violations) == [], check.violations
