"""``dagnats.sdk.testing.LocalStack``: a real nats-server, the engine and the
gateway in a few lines, and a handler (a journaled turn, or a pydantic-ai agent
over ``TestModel``/``FunctionModel``) run on it to its output in one call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel

from dagnats.core.natsserver import check_sync_always
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.integrations.pydantic_ai import durable_agent, safe
from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun, run_output
from dagnats.sdk.testing import LocalStack
from tests.test_journal import journal_check


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack() -> AsyncIterator[LocalStack]:
    async with LocalStack(gateway=True) as s:
        yield s


async def turn(tc: TaskContext) -> None:
    """A journaled turn: one model call, one unsafe tool, then the answer."""
    j = await tc.journal()
    reply = await j.model(lambda: _model(tc.input))
    result = await j.tool(ToolCall(name="note", input=reply), Replay.UNSAFE, _note)
    await tc.complete({"answer": result.output})


async def _model(question: str) -> dict[str, str]:
    return {"text": question.upper()}


async def _note(run: ToolRun) -> str:
    return f"noted {run.call.input['text']}"


async def test_a_handler_runs_to_its_output_in_one_call(stack: LocalStack) -> None:
    assert await stack.run(turn, "hi") == {"answer": "noted HI"}
    assert await check_sync_always(stack.nats.monitor_url), "the store fsyncs every write"


async def test_a_test_model_agent_runs_durably(stack: LocalStack) -> None:
    agent = Agent(TestModel(custom_output_text="21 °C in Lisbon"), instructions="Weather.")
    looked_up: list[str] = []

    @agent.tool_plain(metadata=safe())
    async def lookup(city: str) -> dict[str, Any]:
        """The weather of a city."""
        looked_up.append(city)
        return {"city": city, "celsius": 21}

    answer = await stack.run(durable_agent(agent, follow_up_window=None), "Lisbon?")
    assert answer == "21 °C in Lisbon"
    assert len(looked_up) == 1, "TestModel calls each tool once, then answers"


async def test_a_function_model_agent_on_a_worker_and_the_gateway(stack: LocalStack) -> None:
    def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not returns:
            return ModelResponse(parts=[ToolCallPart("send_email", {"to": "ops@example.com"})])
        return ModelResponse(parts=[TextPart(f"done: {returns[0].content}")])

    agent = Agent(FunctionModel(scripted))
    sent: list[str] = []

    @agent.tool_plain
    async def send_email(to: str) -> str:
        """Send an email (unsafe: never twice)."""
        sent.append(to)
        return f"sent to {to}"

    await stack.register(
        {
            "name": "mailer",
            "steps": [{"id": "agent", "type": "agent_loop", "task": "mailer"}],
        }
    )
    async with stack.worker({"mailer": durable_agent(agent, follow_up_window=None)}):
        started = await stack.client.start_run("mailer", "tell ops")
        run = await stack.client.wait_for_run(started.run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == "done: sent to ops@example.com"
    assert sent == ["ops@example.com"]
    check = await journal_check(stack.engine, run.run_id)
    assert list(check.violations) == []
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        got = (await http.get(f"/runs/{run.run_id}")).json()
    assert got["status"] == "completed"


async def test_the_stack_stops_everything_and_removes_its_store() -> None:
    async with LocalStack() as stack:
        nats = stack.nats
        store = nats.config.store_dir
        assert store.is_dir()
        assert await stack.run(turn, "bye") == {"answer": "noted BYE"}
    assert not nats.running
    assert not store.exists()
