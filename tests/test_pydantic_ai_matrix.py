"""The crash-point matrix on a wrapped pydantic-ai agent: its holder stops at
every worker seam of a round -- on the round that calls the safe tool and on
the one that calls the unsafe tool -- and a successor finishes the run, once
on the local OpenAI provider (pydantic-ai's ``OpenAIChatModel``) and once on
pydantic-ai's ``FunctionModel``. Every case ends with the crash-free run's
answer and a clean journal; the unsafe tool is never started twice; the model
is asked exactly what the crash-free run asked it, plus the one request a
crash interrupted after the model answered and before its record (inside the
model call, or with the response pending for the next journal call)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dagnats.core.seam import seam
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.integrations.pydantic_ai import durable_agent
from dagnats.sdk import Client, Worker, run_output
from tests.helpers import wait_for
from tests.journal_agent import Crasher
from tests.matrix import MATRIX, WORKER_SEAMS
from tests.providers import FakeProvider
from tests.stack import steps_by_id
from tests.test_journal import NO_HEARTBEAT, journal_check
from tests.test_pydantic_ai import (
    ANSWER,
    QUESTION,
    Tools,
    chat_model,
    register,
    script,
    weather_agent,
)

SAFE_ROUND, UNSAFE_ROUND = 0, 1  # the rounds that call lookup and send_email
ROUNDS = 3

# The matrix's worker seams, and two the wrapped agent adds: every round
# places its step's steering inputs, and ``inside_model`` is passed once the
# model answered, before the journal records the response.
SEAMS = (*WORKER_SEAMS, "after_inputs_placed", "inside_model")
# Both rounds call a tool, so each passes every seam once.
CASES = list(itertools.product(SEAMS, (SAFE_ROUND, UNSAFE_ROUND)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: Any) -> AsyncIterator[EngineServer]:
    """One-second leases: a stopped holder loses its task a second later."""
    server = await start_engine(nats_server.url, config=MATRIX)
    yield server
    await server.stop()


@dataclass
class Asked:
    """What the model was asked, request by request, counted where it answers."""

    conversations: list[Any]


@asynccontextmanager
async def on_provider(tools: Tools, again: int | None) -> AsyncIterator[tuple[Model, Asked]]:
    """The agent's model: pydantic-ai's OpenAI chat model on the local provider,
    which passes ``inside_model`` when the provider's response arrives. The
    script repeats round ``again``'s reply, for the request asked again."""
    replies = script()
    if again is not None:
        replies.insert(again, replies[again])

    async def answered(response: httpx.Response) -> None:
        await seam("inside_model")

    async with (
        FakeProvider(replies) as provider,
        openai.AsyncOpenAI(
            base_url=provider.openai_base_url,
            api_key="test",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [answered]}),
        ) as api,
    ):
        asked = Asked([])
        yield chat_model(api), asked
        asked.conversations[:] = [r.body["messages"] for r in provider.requests]
        assert provider.unscripted == []


@asynccontextmanager
async def on_function(tools: Tools, again: int | None) -> AsyncIterator[tuple[Model, Asked]]:
    """pydantic-ai's ``FunctionModel``: the script's reply for the round the
    conversation is at, each call counted and then passing ``inside_model``."""
    asked = Asked([])

    async def reply(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.conversations.append(_said(messages))
        at = sum(isinstance(m, ModelResponse) for m in messages)
        response = ModelResponse(parts=[_part(at)])
        await seam("inside_model")
        return response

    yield FunctionModel(reply), asked


def _said(messages: list[ModelMessage]) -> list[list[tuple[str, Any]]]:
    """What a conversation says, part by part, without its timestamps."""
    return [
        [(p.part_kind, getattr(p, "content", None) or getattr(p, "args", None)) for p in m.parts]
        for m in messages
    ]


def _part(at: int) -> TextPart | ToolCallPart:
    scripted = script()[at]
    if scripted.tools:
        ((name, args),) = scripted.tools
        return ToolCallPart(name, args, tool_call_id=f"call-{at}")
    return TextPart(scripted.text)


BACKENDS = {"openai": on_provider, "function": on_function}


@dataclass(frozen=True)
class Outcome:
    output: Any
    requests: int
    starts: dict[str, int]


async def crash_free(client: Client, engine: EngineServer, backend: str) -> Outcome:
    task, name = await register(client)
    tools = Tools()
    async with BACKENDS[backend](tools, None) as (model, asked):
        handler = durable_agent(weather_agent(model, tools), follow_up_window=None)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)
            done = await finished(client, engine, run.run_id)
    return Outcome(run_output(done), len(asked.conversations), dict(tools.starts))


async def finished(client: Client, engine: EngineServer, run_id: str) -> pb.Run:
    run = await client.wait_for_run(run_id, timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
    assert steps_by_id(run)["agent"].iteration == ROUNDS - 1, "one iteration per round"
    return run


CLEAN: dict[str, Outcome] = {}


def starts_after(seam_name: str, at: int) -> dict[str, int]:
    """The tools' starts when the holder stopped at ``seam_name`` of round ``at``:
    a safe tool stopped inside, or after it returned with its result not yet
    stored, runs again; an unsafe tool whose intent was recorded is never
    started by the successor, and was not by the holder stopped right after
    the intent."""
    starts = {"lookup": 1, "send_email": 1}
    if seam_name in ("inside_tool", "result_pending") and at == SAFE_ROUND:
        starts["lookup"] = 2  # its intent unanswered: a safe tool runs again
    if (seam_name, at) == ("after_intent", UNSAFE_ROUND):
        del starts["send_email"]
    return starts


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(("seam_name", "at"), CASES)
async def test_a_holder_stopped_at_a_seam(
    client: Client, engine: EngineServer, backend: str, seam_name: str, at: int
) -> None:
    if backend not in CLEAN:
        CLEAN[backend] = await crash_free(client, engine, backend)
    clean = CLEAN[backend]
    assert clean == Outcome(ANSWER, ROUNDS, {"lookup": 1, "send_email": 1})

    task, name = await register(client)
    tools = Tools()
    again = at if seam_name in ("inside_model", "model_pending") else None
    async with BACKENDS[backend](tools, again) as (model, asked):
        handler = durable_agent(weather_agent(model, tools), follow_up_window=None)
        with Crasher(seam_name, skip=at) as crash:
            async with Worker(
                engine.target,
                handlers={task: handler},
                poll_wait=1.0,
                concurrency=1,
                heartbeat_interval=NO_HEARTBEAT,  # a stopped holder sends nothing
            ) as holder:
                run = await client.start_run(name, QUESTION)
                await wait_for(crash.hit.is_set, timeout=20, message=f"{seam_name} not reached")
                async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                    await holder.stop(grace=0)
                    done = await finished(client, engine, run.run_id)

    assert run_output(done) == clean.output
    assert dict(tools.starts) == starts_after(seam_name, at)
    if again is None:
        assert len(asked.conversations) == clean.requests, "a recorded response was asked again"
    else:
        # The response the provider gave before its record is lost with its
        # holder: that request, and only it, is asked again, as it was.
        assert len(asked.conversations) == clean.requests + 1
        assert asked.conversations[again] == asked.conversations[again + 1]
