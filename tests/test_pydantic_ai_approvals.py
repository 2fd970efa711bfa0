"""pydantic-ai's tools that need approval (``requires_approval=True``, and
``ApprovalRequired`` raised by a tool) as the journal's approvals bound to
their arguments: the round stops and the step waits, holding no worker; the
approval wakes it, the model's response is replayed (the provider is not
asked again) and the tool runs once; a denial reaches the model as the tool's
return. On the fake OpenAI provider and on a ``FunctionModel``."""

from __future__ import annotations

import json
from typing import Any

import httpx
from pydantic_ai import Agent, ApprovalRequired, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.integrations.pydantic_ai import durable_agent
from dagnats.sdk import Client, Worker, run_output
from tests.providers import FakeProvider, Reply
from tests.stack import unique
from tests.test_approvals import asked, decide, start
from tests.test_journal import journal_check, read_journal
from tests.test_pydantic_ai import chat_model, messages, openai_client

MAIL = {"to": "ops@example.com", "body": "21 °C"}


def mail_agent(model: Any, sent: list[dict[str, Any]]) -> Agent[None, str]:
    agent = Agent(model, instructions="Tell ops what you found.")

    @agent.tool_plain(requires_approval=True)
    async def send_email(to: str, body: str) -> str:
        """Send an email."""
        sent.append({"to": to, "body": body})
        return f"sent to {to}"

    return agent


async def test_requires_approval_waits_and_runs_once_on_the_openai_provider(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    task, sent = unique("pyaiapprove"), list[dict[str, Any]]()
    script = [Reply(tools=[("send_email", MAIL)]), Reply("Ops has been told.")]
    async with FakeProvider(script) as provider, openai_client(provider) as api:
        handler = durable_agent(mail_agent(chat_model(api), sent), follow_up_window=None)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=0.5):
            run_id = await start(client, task)
            call = await asked(client, http, run_id)
            assert (call["tool"], call["args"]) == ("send_email", MAIL)
            assert sent == [] and len(provider.requests) == 1
            assert (await decide(http, run_id, call, "approve")).status_code == 201
            run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == "Ops has been told."
    assert sent == [MAIL]
    # The response that asked was replayed, not requested again; the model
    # got the tool's return.
    assert len(provider.requests) == 2 and not provider.unscripted
    last = messages(provider.requests[1])[-1]
    assert last["role"] == "tool" and last["content"] == "sent to ops@example.com"
    assert list((await journal_check(engine, run_id)).violations) == []


def function_model(seen: list[list[ModelMessage]]) -> FunctionModel:
    """Asks for ``send_email`` once, then answers with what the tool returned."""

    def respond(history: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(history)
        returns = [
            p.content
            for m in history
            for p in getattr(m, "parts", ())
            if getattr(p, "part_kind", "") == "tool-return"
        ]
        if not returns:
            return ModelResponse(parts=[ToolCallPart("send_email", MAIL, tool_call_id="call-1")])
        return ModelResponse(parts=[TextPart(json.dumps(returns[-1]))])

    return FunctionModel(respond)


async def test_a_denial_reaches_the_model_as_the_tools_return(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    task, sent, seen = unique("pyaideny"), list[dict[str, Any]](), list[list[ModelMessage]]()
    handler = durable_agent(mail_agent(function_model(seen), sent), follow_up_window=None)
    async with Worker(engine.target, handlers={task: handler}, poll_wait=0.5):
        run_id = await start(client, task)
        call = await asked(client, http, run_id)
        answer = await decide(http, run_id, call, "deny", reason="ops is asleep")
        assert answer.status_code == 201, answer.text
        run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert sent == []
    assert json.loads(run_output(run)) == {"denied": True, "reason": "ops is asleep"}
    assert len(seen) == 2  # asked once, answered once: the asking response was replayed
    assert list((await journal_check(engine, run_id)).violations) == []


async def test_approval_required_raised_by_a_tool_is_an_approval_with_edited_arguments(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    task, sent, seen = unique("pyaiedit"), list[dict[str, Any]](), list[list[ModelMessage]]()
    agent: Agent[None, str] = Agent(function_model(seen))

    @agent.tool
    async def send_email(ctx: RunContext[None], to: str, body: str) -> str:
        """Send an email; to anyone outside example.com only once approved."""
        if not to.endswith("@example.com") or not ctx.tool_call_approved:
            raise ApprovalRequired
        sent.append({"to": to, "body": body})
        return f"sent to {to}"

    handler = durable_agent(agent, follow_up_window=None)
    async with Worker(engine.target, handlers={task: handler}, poll_wait=0.5):
        run_id = await start(client, task)
        call = await asked(client, http, run_id)
        edited = {**MAIL, "body": "21 °C, sunny"}
        answer = await decide(http, run_id, call, "approve", args=edited)
        assert answer.status_code == 201, answer.text
        run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert sent == [edited]
    assert json.loads(run_output(run)) == "sent to ops@example.com"
    assert list((await journal_check(engine, run_id)).violations) == []


def three_at_once(seen: list[list[ModelMessage]]) -> FunctionModel:
    """Asks for three tools in one response, ``send_email`` last; then answers
    with the tool returns it got, in order."""

    def respond(history: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(history)
        returns = [
            p.content
            for m in history
            for p in getattr(m, "parts", ())
            if getattr(p, "part_kind", "") == "tool-return"
        ]
        if not returns:
            return ModelResponse(
                parts=[
                    ToolCallPart("lookup", {"who": "ops"}, tool_call_id="call-1"),
                    ToolCallPart("weather", {"city": "Paris"}, tool_call_id="call-2"),
                    ToolCallPart("send_email", MAIL, tool_call_id="call-3"),
                ]
            )
        return ModelResponse(parts=[TextPart(json.dumps(returns))])

    return FunctionModel(respond)


async def test_in_parallel_mode_the_others_run_while_the_call_needing_approval_waits(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    task, seen = unique("pyaigroup"), list[list[ModelMessage]]()
    ran: list[str] = []
    agent = mail_agent(three_at_once(seen), sent := list[dict[str, Any]]())

    @agent.tool_plain
    async def lookup(who: str) -> str:
        """Find someone's address."""
        ran.append("lookup")
        return f"{who}@example.com"

    @agent.tool_plain
    async def weather(city: str) -> str:
        """The weather in a city."""
        ran.append("weather")
        return "21 °C"

    handler = durable_agent(agent, follow_up_window=None, tool_calls="parallel")
    async with Worker(engine.target, handlers={task: handler}, poll_wait=0.5):
        run_id = await start(client, task)
        call = await asked(client, http, run_id)
        assert (call["tool"], call["args"]) == ("send_email", MAIL)
        assert sorted(ran) == ["lookup", "weather"] and sent == []
        records = await read_journal(engine, run_id, "agent")
        [group] = [r.tool_intents for r in records if r.WhichOneof("kind") == "tool_intents"]
        assert [(i.name, bool(i.digest)) for i in group.intents] == [
            ("lookup", False),
            ("weather", False),
            ("send_email", True),
        ]
        assert (await decide(http, run_id, call, "approve")).status_code == 201
        run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    # The model got all three returns, in its response's order; the two that
    # ran before the wait did not run again, the approved one ran once.
    assert json.loads(run_output(run)) == ["ops@example.com", "21 °C", "sent to ops@example.com"]
    assert sorted(ran) == ["lookup", "weather"] and sent == [MAIL]
    assert len(seen) == 2  # the asking response was replayed, not requested again
    assert list((await journal_check(engine, run_id)).violations) == []
