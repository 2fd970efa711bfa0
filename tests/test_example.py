"""The agent-turn example (examples/agent_turn): its pure helpers, and the
handler end to end on a real nats-server and engine."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import grpc.aio
import pytest

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, InputMode, ToolResult, Worker
from dagnats.sdk.testing import ScriptedModel
from examples.agent_turn.handler import (
    BadReply,
    Turn,
    answered,
    append_turn,
    decode_turn,
    make_agent_turn,
    opening,
)
from tests.helpers import wait_for
from tests.stack import steps_by_id, unique

WORKFLOW = Path(__file__).parent.parent / "examples" / "agent_turn" / "workflow.yaml"

SCRIPT: list[dict[str, Any]] = [
    {"done": False, "tool": "search", "input": {"q": "weather"}},
    {"done": False, "tool": "send_email", "input": {"to": "ops"}},
    {"done": True, "answer": "sunny, ops told"},
]


# The pure helpers.


def test_decode_turn_reads_a_tool_call_and_an_answer() -> None:
    assert decode_turn(SCRIPT[0]) == Turn(done=False, tool="search", input={"q": "weather"})
    assert decode_turn({"done": True, "answer": 42}) == Turn(done=True, answer=42)


@pytest.mark.parametrize(
    "reply",
    [
        "sure, let me search",
        None,
        {"tool": "search"},  # no "done"
        {"done": False, "tool": ""},
        {"done": False, "tool": 7},
        {"done": True},  # no answer
        {"done": "yes", "answer": 1},
    ],
)
def test_decode_turn_rejects_what_is_not_a_turn(reply: Any) -> None:
    with pytest.raises(BadReply, match="model reply is not a turn") as raised:
        decode_turn(reply)
    assert raised.value.reply == reply


def test_append_turn_tells_the_model_about_an_interrupted_call() -> None:
    history = opening("hi")
    assert history == [{"role": "user", "content": "hi"}]
    done = append_turn(history, SCRIPT[0], ToolResult(output={"n": 1}))
    assert done[-1] == {"role": "tool", "output": {"n": 1}}
    cut = append_turn(history, SCRIPT[1], ToolResult(interrupted=True, partial="sending;"))
    assert cut[-1] == {"role": "tool", "output": None, "interrupted": True, "partial": "sending;"}
    failed = append_turn(history, SCRIPT[1], ToolResult(error="LookupError: no"))
    assert failed[-1]["error"] == "LookupError: no"
    assert history == [{"role": "user", "content": "hi"}], "the history is not changed in place"


def test_answered() -> None:
    history = opening("hi")
    assert not answered(history)
    assert not answered(append_turn(history, SCRIPT[0], ToolResult(output=1)))
    assert answered(append_turn(history, SCRIPT[2]))


# End to end.


async def register(client: Client) -> tuple[str, str]:
    """Register workflow.yaml under a fresh workflow name and task type."""
    name, task = unique("agent-turn"), unique("agent-turn")
    text = WORKFLOW.read_text()
    unique_text = text.replace("name: agent-turn\n", f"name: {name}\n").replace(
        "task: agent-turn\n", f"task: {task}\n"
    )
    assert unique_text.count(name) == 1 and unique_text.count(task) == 1, unique_text
    workflow = await client.register_workflow(unique_text)
    assert [s.task for s in workflow.steps] == [task]
    return name, task


async def journal_check(engine: EngineServer, run_id: str) -> jpb.CheckResponse:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        return await stub.Check(jpb.CheckRequest(run_id=run_id))


class Tools:
    """Tools that count their starts and remember the key of each call."""

    def __init__(self) -> None:
        self.starts: Counter[str] = Counter()
        self.keys: dict[str, list[str]] = {}

    async def run(self, name: str, input: Any, key: str) -> Any:
        self.starts[name] += 1
        self.keys.setdefault(name, []).append(key)
        return {"tool": name, "input": input}


async def waiting_for_input(client: Client, run_id: str) -> bool:
    step = steps_by_id(await client.get_run(run_id))["agent"]
    return step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input


async def test_the_agent_searches_sends_answers_and_takes_a_follow_up(
    client: Client, engine: EngineServer
) -> None:
    name, task = await register(client)
    script = [*SCRIPT, {"done": True, "answer": "tomorrow too"}]
    model, tools = ScriptedModel(script), Tools()
    handler = make_agent_turn(model, tools.run)
    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0) as worker:
        run = await client.start_run(name, "weather, then tell ops")
        await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=40)
        await wait_for(lambda: worker.in_flight == 0, timeout=10)
        answered_step = steps_by_id(await client.get_run(run.run_id))["agent"]
        await client.submit_input(
            run.run_id, "agent", "f-1", "and tomorrow?", mode=InputMode.FOLLOW_UP
        )
        await wait_for(lambda: model.calls == 4, timeout=20)
        await wait_for(lambda: waiting_for_input(client, run.run_id), timeout=20)
        run = await client.get_run(run.run_id)

    # The answer is the step's output; the step waits for follow-ups, holding no worker.
    assert answered_step.output == b'"sunny, ops told"' and answered_step.iteration == 3
    assert steps_by_id(run)["agent"].output == b'"tomorrow too"'
    assert tools.starts == {"search": 1, "send_email": 1}
    # Positions: place steer inputs (0), model (1), tool (2).
    assert tools.keys == {
        "search": [f"{run.run_id}.agent.0.2"],
        "send_email": [f"{run.run_id}.agent.1.2"],
    }
    last = model.requests[2]
    assert last[0] == {"role": "user", "content": "weather, then tell ops"}
    assert last[-1] == {"role": "tool", "output": {"tool": "send_email", "input": {"to": "ops"}}}
    assert model.requests[3][-1] == {"role": "user", "content": "and tomorrow?"}
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations
    await client.cancel_run(run.run_id)


async def test_a_reply_that_is_not_a_turn_fails_the_run(
    client: Client, engine: EngineServer
) -> None:
    name, task = await register(client)
    model, tools = ScriptedModel([{"done": False, "tool": ""}]), Tools()
    async with Worker(engine.target, handlers={task: make_agent_turn(model, tools.run)}):
        run = await client.start_run(name, "hi")
        run = await client.wait_for_run(run.run_id, timeout=40)

    assert run.status == pb.RUN_STATUS_FAILED
    assert "model reply is not a turn" in run.error, run.error
    assert steps_by_id(run)["agent"].attempt == 1, "a permanent failure is not retried"
    assert model.calls == 1
    assert not tools.starts
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


async def test_run_py_as_a_user_runs_it(engine: EngineServer) -> None:
    import asyncio
    import os
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    env = {**os.environ, "DAGNATS_ENGINE": engine.target}
    command = [sys.executable, "-m", "examples.agent_turn.run"]
    result = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=100, cwd=root, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    run_id = lines[0].split()[1]
    assert f"key={run_id}.agent.0.2" in lines[1] and f"key={run_id}.agent.1.2" in lines[2]
    assert "answer: It is 21 °C in Lisbon; ops has been told." in lines
    assert "answer: Tomorrow: 23 °C and clear." in lines
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
