"""A pydantic-ai agent made durable with ``dagnats.integrations.pydantic_ai``:
its own OpenAI chat model pointed at the local provider (``tests/providers.py``),
a safe and an unsafe tool, on the real stack. One round per iteration; a crash
after a model record asks the provider nothing again; a crash inside the unsafe
tool never starts it again and the model is told; steering joins the next
request, a follow-up wakes the answered step; streamed tokens reach an SSE
reader and equal the committed record."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from pydantic_ai import Agent
from pydantic_ai.models import Model
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from dagnats.core.errors import InvalidArgument
from dagnats.core.seam import seam
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.integrations.pydantic_ai import current_tool_run, durable_agent, model_from_env, safe
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, InputMode, JournalClient, Worker, run_output
from tests.helpers import wait_for
from tests.journal_agent import Crasher
from tests.providers import MODEL, FakeProvider, Received, Reply
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_journal import NO_HEARTBEAT, journal_check, read_journal
from tests.test_live_stream import sse, until

ANSWER = "It is 21 °C in Lisbon; ops has been told."
QUESTION = "How warm is it in Lisbon? Tell ops."


def script() -> list[Reply]:
    """Three rounds: look the weather up (safe), mail ops (unsafe), answer."""
    return [
        Reply(tools=[("lookup", {"city": "Lisbon"})]),
        Reply(tools=[("send_email", {"to": "ops@example.com", "body": "21 °C"})]),
        Reply(ANSWER),
    ]


@dataclass
class Tools:
    """The agent's tools, counting their starts outside the journal; once
    started, a tool passes the seam ``inside_tool``, and one named in
    ``block`` waits for its event."""

    starts: Counter[str] = field(default_factory=Counter)
    keys: list[str] = field(default_factory=list)
    block: dict[str, asyncio.Event] = field(default_factory=dict)

    async def enter(self, name: str) -> None:
        self.starts[name] += 1
        run = current_tool_run()
        self.keys.append(run.call.key)
        await run.report(f"started {name};")
        await seam("inside_tool")
        if name in self.block:
            await self.block[name].wait()


@asynccontextmanager
async def openai_client(provider: FakeProvider) -> AsyncIterator[openai.AsyncOpenAI]:
    """The provider's client, no retries of its own: every request counts."""
    async with openai.AsyncOpenAI(
        base_url=provider.openai_base_url, api_key="test", max_retries=0
    ) as c:
        yield c


def chat_model(api: openai.AsyncOpenAI) -> OpenAIChatModel:
    return OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=api))


def weather_agent(model: Model | openai.AsyncOpenAI, tools: Tools) -> Agent[None, str]:
    """The agent on ``model``, or on the OpenAI chat model of a client."""
    if isinstance(model, openai.AsyncOpenAI):
        model = chat_model(model)
    agent = Agent(model, instructions="Answer weather questions; tell ops what you found.")

    @agent.tool_plain(metadata=safe())
    async def lookup(city: str) -> dict[str, Any]:
        """Look up the current weather of a city."""
        await tools.enter("lookup")
        return {"city": city, "celsius": 21}

    @agent.tool_plain
    async def send_email(to: str, body: str) -> str:
        """Send an email."""
        await tools.enter("send_email")
        return f"sent to {to}"

    return agent


async def register(client: Client) -> tuple[str, str]:
    task, name = unique("pyai"), unique("pyaiwf")
    await client.register_workflow(loop_workflow(name, task))
    return task, name


def messages(received: Received) -> list[dict[str, Any]]:
    return list(received.body["messages"])


async def finished(client: Client, engine: EngineServer, run_id: str) -> pb.Run:
    run = await client.wait_for_run(run_id, timeout=60)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == ANSWER
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
    assert steps_by_id(run)["agent"].iteration == 2, "one iteration per round, from 0"
    return run


@asynccontextmanager
async def crashing(engine: EngineServer, task: str, handler: Any) -> AsyncIterator[Worker]:
    """A worker whose holder goes silent (no heartbeat), as a killed one does."""
    async with Worker(
        engine.target, handlers={task: handler}, poll_wait=1.0, heartbeat_interval=NO_HEARTBEAT
    ) as worker:
        yield worker


async def test_an_agent_answers_over_rounds_with_its_calls_in_the_journal(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    async with FakeProvider(script()) as provider, openai_client(provider) as api:
        handler = durable_agent(weather_agent(api, tools), follow_up_window=None)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)
            await finished(client, engine, run.run_id)
    assert tools.starts == {"lookup": 1, "send_email": 1}
    assert len(provider.requests) == 3 and not provider.unscripted
    first, second, third = (messages(r) for r in provider.requests)
    assert first[-1] == {"role": "user", "content": QUESTION}
    assert second[-1]["role"] == "tool"
    assert json.loads(second[-1]["content"]) == {"city": "Lisbon", "celsius": 21}
    call = third[-2]["tool_calls"][0]
    assert call["function"]["name"] == "send_email"
    assert third[-1] == {
        "role": "tool",
        "content": "sent to ops@example.com",
        "tool_call_id": call["id"],
    }

    records = await read_journal(engine, run.run_id)
    responses = [json.loads(r.model.response) for r in records if r.HasField("model")]
    assert [p["part_kind"] for r in responses for p in r["parts"]] == [
        "tool-call",
        "tool-call",
        "text",
    ]
    assert responses[2]["parts"][0]["content"] == ANSWER
    intents = [r.tool_intent for r in records if r.HasField("tool_intent")]
    assert [(i.name, i.replay) for i in intents] == [
        ("lookup", jpb.REPLAY_SAFE),
        ("send_email", jpb.REPLAY_UNSAFE),
    ]
    assert json.loads(intents[1].input) == {"to": "ops@example.com", "body": "21 °C"}
    results = [json.loads(r.tool_result.output) for r in records if r.HasField("tool_result")]
    assert results == [
        {"return": {"city": "Lisbon", "celsius": 21}},
        {"return": "sent to ops@example.com"},
    ]
    assert tools.keys == [f"{run.run_id}.agent.0.2", f"{run.run_id}.agent.1.2"]
    commits = [r for r in records if r.HasField("commit")]
    # The commit stores what the round appended; the state it makes is rebuilt
    # from the chain (the snapshot and the deltas after it).
    async with JournalClient(engine.target) as journal:
        state = json.loads(await journal.state(run.run_id, "agent", at_seq=commits[-1].seq) or b"")
    assert commits[-1].commit.HasField("state_delta"), "the last round appended to the history"
    assert state["answered"] is True and state["output"] == ANSWER
    assert [m["kind"] for m in state["messages"]] == ["request", "response"] * 3


async def test_a_crash_after_a_model_record_asks_the_provider_nothing_again(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    async with FakeProvider(script()) as provider, openai_client(provider) as api:
        handler = durable_agent(weather_agent(api, tools), follow_up_window=None)
        with Crasher("after_model", skip=1) as crash:  # iteration 1: send_email's request
            async with crashing(engine, task, handler) as first:
                run = await client.start_run(name, QUESTION)
                await wait_for(crash.hit.is_set, timeout=20)
                assert len(provider.requests) == 2
                async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                    await first.stop(grace=0)
                    await finished(client, engine, run.run_id)
    assert len(provider.requests) == 3, "the recorded response was reused, not asked again"
    assert tools.starts == {"lookup": 1, "send_email": 1}


async def test_a_crash_inside_the_unsafe_tool_never_starts_it_again_and_the_model_is_told(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools(block={"send_email": asyncio.Event()})  # the holder dies inside it
    async with FakeProvider(script()) as provider, openai_client(provider) as api:
        handler = durable_agent(weather_agent(api, tools), follow_up_window=None)
        async with crashing(engine, task, handler) as first:
            run = await client.start_run(name, QUESTION)
            await wait_for(lambda: tools.starts["send_email"] == 1, timeout=20)
            async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                await first.stop(grace=0)
                await finished(client, engine, run.run_id)
    assert tools.starts == {"lookup": 1, "send_email": 1}, "started once, never again"
    told = messages(provider.requests[2])[-1]
    assert told["role"] == "tool"
    assert "did not finish" in told["content"] and "started send_email;" in told["content"]
    records = await read_journal(engine, run.run_id)
    (result,) = [
        r.tool_result for r in records if r.HasField("tool_result") and r.tool_result.interrupted
    ]
    assert result.partial == "started send_email;"


async def test_a_steer_input_joins_the_next_request_after_the_tool_round(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools(block={"lookup": asyncio.Event()})
    async with FakeProvider(script()) as provider, openai_client(provider) as api:
        handler = durable_agent(weather_agent(api, tools), follow_up_window=None)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)
            await wait_for(lambda: tools.starts["lookup"] == 1, timeout=20)
            await client.submit_input(
                run.run_id, "agent", "steer-1", {"text": "use Fahrenheit"}, mode=InputMode.STEER
            )
            tools.block["lookup"].set()
            await finished(client, engine, run.run_id)
    second = messages(provider.requests[1])
    assert [m["role"] for m in second[-2:]] == ["tool", "user"]
    assert second[-1]["content"] == "use Fahrenheit"
    assert all(m.get("content") != "use Fahrenheit" for m in messages(provider.requests[0]))
    status = await client.get_input(run.run_id, "agent", "steer-1")
    assert status.status == ipb.STATUS_DONE


async def test_a_follow_up_wakes_the_answered_step_and_is_answered(
    client: Client, engine: EngineServer
) -> None:
    task, name = await register(client)
    tools = Tools()
    follow_up = "And tomorrow?"
    async with (
        FakeProvider([*script(), Reply("Tomorrow: 23 °C.")]) as provider,
        openai_client(provider) as api,
    ):
        handler = durable_agent(weather_agent(api, tools))
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)

            async def waiting(after: int) -> pb.StepState | None:
                step = steps_by_id(await client.get_run(run.run_id))["agent"]
                return step if step.waiting_for_input and step.iteration > after else None

            answered = await wait_for(lambda: waiting(-1), timeout=30)
            assert json.loads(answered.output) == ANSWER
            await client.submit_input(
                run.run_id, "agent", "more-1", follow_up, mode=InputMode.FOLLOW_UP
            )
            again = await wait_for(lambda: waiting(answered.iteration), timeout=30)
            assert json.loads(again.output) == "Tomorrow: 23 °C."
            await client.cancel_run(run.run_id, "the test is over")
    last = messages(provider.requests[3])
    assert last[-2] == {"role": "assistant", "content": ANSWER}
    assert last[-1] == {"role": "user", "content": follow_up}
    assert len(provider.requests) == 4
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


async def test_streamed_tokens_reach_an_sse_reader_and_equal_the_committed_record(
    client: Client, engine: EngineServer, http: httpx.AsyncClient
) -> None:
    task, name = await register(client)
    text = "It is 21 degrees in Lisbon and the sky is clear all afternoon."
    async with (
        # Held before its first token: the run starts before the reader is
        # subscribed, and a token published before that reaches no one.
        FakeProvider([Reply(text, hold_after=0)]) as provider,
        openai_client(provider) as api,
    ):
        handler = durable_agent(weather_agent(api, Tools()), stream=True, follow_up_window=None)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)
            async with sse(http, run.run_id) as stream:
                await asyncio.wait_for(provider.holding.wait(), timeout=20)
                provider.release()
                events = await until(stream, lambda e: e.type != "token")
            done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == text
    tokens, end = events[:-1], events[-1]
    assert end.type == "committed"
    assert "".join(e.data["text"] for e in tokens) == text
    (model,) = [r for r in await read_journal(engine, run.run_id) if r.HasField("model")]
    assert end.data["record_seq"] == model.seq
    recorded = json.loads(model.model.response)
    assert [p["content"] for p in recorded["parts"] if p["part_kind"] == "text"] == [text]
    assert provider.requests[0].body["stream"] is True


async def test_the_example_agent_on_the_provider_and_its_run_script_offline(
    client: Client, engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.pydantic_ai import agent as example
    from examples.pydantic_ai import run as script_run

    task, name = await register(client)
    async with FakeProvider(script()) as provider, openai_client(provider) as api:
        handlers = {task: example.handler(chat_model(api), follow_up_window=None)}
        async with Worker(engine.target, handlers=handlers, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)
            await finished(client, engine, run.run_id)
    assert provider.requests[0].body["stream"] is True
    assert example.SENT[-1]["idempotency_key"] == f"{run.run_id}.agent.1.2"
    monkeypatch.setattr(script_run, "TARGET", engine.target)
    assert await script_run.main() == 0


async def test_the_run_script_on_the_model_dagnats_model_names(
    engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.pydantic_ai import run as script_run

    async with FakeProvider(script()) as provider:
        monkeypatch.setenv("DAGNATS_MODEL", f"openai:{MODEL}@{provider.openai_base_url}")
        monkeypatch.setattr(script_run, "TARGET", engine.target)
        assert await script_run.main() == 0
    assert len(provider.requests) == 3 and provider.unscripted == []
    assert all(r.body["model"] == MODEL and r.body["stream"] for r in provider.requests)
    with pytest.raises(InvalidArgument, match="DAGNATS_MODEL"):
        model_from_env({"DAGNATS_MODEL": "openai"})
    with pytest.raises(InvalidArgument, match="OPENAI_API_KEY"):
        model_from_env({"DAGNATS_MODEL": "openai:gpt-4.1-mini"})
    assert model_from_env({}) is None


def test_the_public_names_are_exactly_these() -> None:
    import dagnats.integrations.pydantic_ai as integration

    assert set(integration.__all__) == {
        "REPLAY_METADATA_KEY",
        "DurableAgent",
        "content_text",
        "current_tool_run",
        "dump_messages",
        "durable_agent",
        "load_messages",
        "model_from_env",
        "safe",
    }
    assert all(hasattr(integration, name) for name in integration.__all__)
