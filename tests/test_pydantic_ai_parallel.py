"""pydantic-ai's parallel tool calls through ``Journal.tools``: a model
response asking for several tools runs them at once as one parallel group,
on the local OpenAI provider, on ``FunctionModel`` and on ``TestModel``; the
``sequential`` option runs them one at a time; a crash inside the group
starts no unsafe call twice and the model is told."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.tools import ToolDefinition

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.integrations.pydantic_ai import durable_agent, safe
from dagnats.sdk import Client, Worker, run_output
from tests.helpers import wait_for
from tests.journal_agent import Crasher
from tests.providers import FakeProvider, Reply
from tests.test_journal import journal_check, read_journal
from tests.test_pydantic_ai import (
    ANSWER,
    QUESTION,
    Tools,
    chat_model,
    crashing,
    openai_client,
    register,
)

CITIES = ["Lisbon", "Porto", "Faro"]


def parallel_script() -> list[Reply]:
    """One round asks for three lookups (safe) and a mail (unsafe) at once."""
    return [
        Reply(
            tools=[
                *(("lookup", {"city": c}) for c in CITIES),
                ("send_email", {"to": "ops@example.com", "body": "warm"}),
            ]
        ),
        Reply(ANSWER),
    ]


@dataclass
class LateMail(AbstractCapability[Any]):
    """A hook that gives the event loop two turns before ``send_email``
    reaches the toolset: its call arrives after its siblings'."""

    async def before_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        if call.tool_name == "send_email":
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return args


def fanout_agent(
    model: Model | Any, tools: Tools, *, together: int = 0, late_mail: bool = False
) -> Agent[None, str]:
    """Tools that, with ``together``, do not return before ``together`` calls
    have started: a round run one call at a time never finishes."""
    started = asyncio.Event()
    agent: Agent[None, str] = Agent(
        model,
        instructions="Look the cities up; tell ops.",
        capabilities=[LateMail()] if late_mail else [],
    )

    async def gate() -> None:
        if together and sum(tools.starts.values()) >= together:
            started.set()
        if together:
            await started.wait()

    @agent.tool_plain(metadata=safe())
    async def lookup(city: str) -> dict[str, Any]:
        """Look up the current weather of a city."""
        await tools.enter("lookup")
        await gate()
        return {"city": city, "celsius": 20 + CITIES.index(city)}

    @agent.tool_plain
    async def send_email(to: str, body: str) -> str:
        """Send an email."""
        await tools.enter("send_email")
        await gate()
        return f"sent to {to}"

    return agent


async def finished(client: Client, engine: EngineServer, run_id: str, answer: str) -> pb.Run:
    run = await client.wait_for_run(run_id, timeout=60)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == answer
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
    return run


async def test_a_response_asking_for_four_tools_runs_them_as_one_group_on_the_provider(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    async with FakeProvider(parallel_script()) as provider, openai_client(provider) as api:
        agent = fanout_agent(chat_model(api), tools, together=4)
        async with Worker(
            engine.target, handlers={task: durable_agent(agent, follow_up_window=None)}
        ):
            run = await client.start_run(name, QUESTION)
            await finished(client, engine, run.run_id, ANSWER)
    assert tools.starts == {"lookup": 3, "send_email": 1}
    records = await read_journal(engine, run.run_id)
    (group,) = [r for r in records if r.HasField("tool_intents")]
    assert [(i.name, json.loads(i.input)) for i in group.tool_intents.intents] == [
        *(("lookup", {"city": c}) for c in CITIES),
        ("send_email", {"to": "ops@example.com", "body": "warm"}),
    ]
    asked = [m for m in provider.requests[1].body["messages"] if m["role"] == "tool"]
    assert [json.loads(m["content"]) for m in asked[:3]] == [
        {"city": c, "celsius": 20 + i} for i, c in enumerate(CITIES)
    ], "the results reach the model in the response's order"
    assert asked[3]["content"] == "sent to ops@example.com"
    assert len(set(tools.keys)) == 4, "each call keeps its own idempotency key"


def function_model() -> FunctionModel:
    async def reply(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[TextPart(ANSWER)])
        return ModelResponse(
            parts=[
                *(
                    ToolCallPart("lookup", {"city": c}, tool_call_id=f"l{i}")
                    for i, c in enumerate(CITIES)
                ),
                ToolCallPart("send_email", {"to": "ops", "body": "x"}, tool_call_id="s"),
            ]
        )

    return FunctionModel(reply)


async def test_a_call_that_reaches_the_toolset_a_loop_turn_late_joins_its_group(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    agent = fanout_agent(function_model(), tools, together=4, late_mail=True)
    async with Worker(engine.target, handlers={task: durable_agent(agent, follow_up_window=None)}):
        run = await client.start_run(name, QUESTION)
        await finished(client, engine, run.run_id, ANSWER)
    records = await read_journal(engine, run.run_id)
    (group,) = [r for r in records if r.HasField("tool_intents")]
    assert [i.name for i in group.tool_intents.intents] == ["lookup"] * 3 + ["send_email"]


async def test_the_sequential_option_runs_the_calls_one_at_a_time(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    handler = durable_agent(
        fanout_agent(function_model(), tools), follow_up_window=None, tool_calls="sequential"
    )
    async with Worker(engine.target, handlers={task: handler}):
        run = await client.start_run(name, QUESTION)
        await finished(client, engine, run.run_id, ANSWER)
    records = await read_journal(engine, run.run_id)
    assert not [r for r in records if r.HasField("tool_intents")]
    intents = [r.tool_intent for r in records if r.HasField("tool_intent")]
    assert [i.name for i in intents] == ["lookup"] * 3 + ["send_email"]


async def test_testmodel_calls_every_tool_at_once_as_one_group(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    agent = fanout_agent(TestModel(custom_output_text=ANSWER), tools, together=2)
    async with Worker(engine.target, handlers={task: durable_agent(agent, follow_up_window=None)}):
        run = await client.start_run(name, QUESTION)
        await finished(client, engine, run.run_id, ANSWER)
    assert sum(tools.starts.values()) == 2, "TestModel calls each tool once"
    records = await read_journal(engine, run.run_id)
    (group,) = [r for r in records if r.HasField("tool_intents")]
    assert sorted(i.name for i in group.tool_intents.intents) == ["lookup", "send_email"]


async def test_a_crash_inside_a_group_reuses_the_stored_results_and_tells_the_model(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools(block={"send_email": asyncio.Event()})  # the holder dies inside it
    handler = durable_agent(fanout_agent(function_model(), tools), follow_up_window=None)
    with Crasher("after_group_result", times=3) as crash:  # the three lookups stored
        async with crashing(engine, task, handler) as first:
            run = await client.start_run(name, QUESTION)
            await wait_for(lambda: crash.hits == 3 and tools.starts["send_email"] == 1, timeout=20)
            async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                await first.stop(grace=0)
                done = await finished(client, engine, run.run_id, ANSWER)
    assert done.status == pb.RUN_STATUS_COMPLETED
    assert tools.starts == {"lookup": 3, "send_email": 1}, "stored results reused, none rerun"
    records = await read_journal(engine, run.run_id)
    interrupted = [
        r.tool_result for r in records if r.HasField("tool_result") and r.tool_result.interrupted
    ]
    assert [r.partial for r in interrupted] == ["started send_email;"]
