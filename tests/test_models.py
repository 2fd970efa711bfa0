"""The model adapters (``dagnats.sdk.models``) against a local server speaking
each provider's wire format (``tests.providers``), through a real worker,
engine and nats-server: a streamed turn seen by an SSE reader and recorded
whole, a tool round in the provider's format, retries the journal never sees,
a crash after the record, a cancel mid-stream; ``DAGNATS_MODEL``; the demo of
``dagnats dev`` on a real model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import dagnats.sdk.models as models
from dagnats.core.errors import InvalidArgument
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from dagnats.sdk.models import (
    AnthropicModel,
    AssistantMessage,
    ChatModel,
    Message,
    ModelError,
    ModelResponse,
    OpenAIModel,
    RetryPolicy,
    StopReason,
    SystemMessage,
    ToolMessage,
    ToolSpec,
    ToolUse,
    UserMessage,
    ask,
    messages_from_json,
    messages_to_json,
    model_from_env,
    parse_model,
    retry_after,
    tool_message,
)
from dagnats.sdk.models._anthropic import to_anthropic
from tests.helpers import body, holds, wait_for
from tests.journal_agent import Crasher
from tests.providers import MODEL, Failure, FakeProvider, Reply
from tests.stack import dev_args, loop_workflow, unique
from tests.test_journal import NO_HEARTBEAT, journal_check, read_journal
from tests.test_live_stream import sse, until

PROVIDERS = ["openai", "anthropic"]
KEY = "sk-test-7f3a9c-never-journal-me"
FAST_RETRY = RetryPolicy(budget=10.0, backoff=0.01, max_backoff=0.05)
LOOKUP = ToolSpec(
    name="lookup",
    description="The temperature in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)


def adapter(provider: str, fake: FakeProvider, **options: Any) -> OpenAIModel | AnthropicModel:
    options.setdefault("retry", FAST_RETRY)
    if provider == "openai":
        return OpenAIModel(MODEL, base_url=fake.openai_base_url, **options)
    return AnthropicModel(MODEL, base_url=fake.anthropic_base_url, **options)


Turn = Callable[[TaskContext], Awaitable[None]]


async def run_to_end(client: Client, engine: EngineServer, handler: Turn) -> pb.Run:
    task, name = unique("models"), unique("models-wf")
    await client.register_workflow(loop_workflow(name, task))
    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
        run = await client.start_run(name)
        return await client.wait_for_run(run.run_id, timeout=40)


def answering(model: ChatModel, *, tools: tuple[ToolSpec, ...] = (), apart: bool = False) -> Turn:
    """A handler that asks once and completes with the text (``apart``: it
    heartbeats in between, so the response has a record of its own)."""

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()
        response = await ask(j, model, [UserMessage(content="hi")], tools=tools)
        if apart:
            await tc.heartbeat()
        await tc.complete(response.text)

    return turn


async def model_records(engine: EngineServer, run_id: str) -> list[Any]:
    records = await read_journal(engine, run_id)
    return [json.loads(body(r, "model").response) for r in records if holds(r, "model")]


# ---- a streamed turn ----------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_streamed_turn_reaches_an_sse_reader_and_the_record_is_the_response(
    provider: str, http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    text = "It is twenty-one degrees in Lisbon today"
    start = asyncio.Event()
    async with FakeProvider([Reply(text)]) as fake:
        model = adapter(provider, fake, api_key=KEY)

        async def turn(tc: TaskContext) -> None:
            await start.wait()  # until the reader is subscribed
            j = await tc.journal()
            response = await ask(j, model, [UserMessage(content="How warm is it?")])
            await tc.complete(response.text)

        task, name = unique("models"), unique("models-wf")
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(engine.target, handlers={task: turn}, poll_wait=1.0):
            run = await client.start_run(name)
            async with sse(http, run.run_id) as stream:
                start.set()
                events = await until(stream, lambda e: e.type != "token")
            done = await client.wait_for_run(run.run_id, timeout=30)
        await model.aclose()

    assert done.status == pb.RUN_STATUS_COMPLETED and json.loads(done.output) == text
    tokens, end = events[:-1], events[-1]
    assert tokens and "".join(e.data["text"] for e in tokens) == text
    assert end.type == "committed"
    # The record is the whole response in the neutral shape, and nothing else.
    [record] = await model_records(engine, run.run_id)
    assert record == {
        "text": text,
        "tool_calls": [],
        "stop_reason": "end",
        "usage": record["usage"],
        "model": MODEL,
    }
    assert record["usage"]["input_tokens"] == 10 and record["usage"]["output_tokens"] > 0
    assert end.data["response"] == record
    [request] = fake.requests
    assert request.body["stream"] is True
    assert request.body["messages"][-1]["content"] in (
        "How warm is it?",
        [{"type": "text", "text": "How warm is it?"}],
    )
    # The key went to the provider and into no journal record.
    sent = request.headers.get("authorization", "") + request.headers.get("x-api-key", "")
    assert KEY in sent
    for raw in await read_journal(engine, run.run_id):
        assert KEY.encode() not in raw.SerializeToString(), raw
    assert KEY not in repr(model)


# ---- a tool round ---------------------------------------------------------------------


def tool_agent(model: ChatModel, starts: list[str]) -> Turn:
    """Ask, run the tools the model asks for through the journal, ask again
    with their results; complete with the answer."""

    async def lookup(run: ToolRun) -> Any:
        starts.append(run.call.name)
        return {"city": run.call.input["city"], "celsius": 21}

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()
        history: list[Message] = [
            SystemMessage(content="Answer about the weather."),
            UserMessage(content="How warm is it in Lisbon?"),
        ]
        for _ in range(3):
            response = await ask(j, model, history, tools=(LOOKUP,))
            if not response.tool_calls:
                await tc.complete(response.text)
                return
            history.append(response.message())
            for use in response.tool_calls:
                call = ToolCall(name=use.name, input=use.arguments)
                history.append(tool_message(use, await j.tool(call, Replay.SAFE, lookup)))
        await tc.fail_permanent("no answer after three rounds")

    return turn


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_tool_round_sends_the_result_back_in_the_providers_format(
    provider: str, client: Client, engine: EngineServer
) -> None:
    script = [Reply(tools=[("lookup", {"city": "Lisbon"})]), Reply("21 °C in Lisbon.")]
    starts: list[str] = []
    async with FakeProvider(script) as fake, adapter(provider, fake) as model:
        run = await run_to_end(client, engine, tool_agent(model, starts))

    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert json.loads(run.output) == "21 °C in Lisbon." and starts == ["lookup"]
    asked, answered = await model_records(engine, run.run_id)
    assert asked["stop_reason"] == "tool_calls" and answered["stop_reason"] == "end"
    [use] = asked["tool_calls"]
    assert use["name"] == "lookup" and use["arguments"] == {"city": "Lisbon"} and use["id"]
    first, second = (r.body for r in fake.requests)
    result = json.dumps({"city": "Lisbon", "celsius": 21})
    if provider == "openai":
        assert first["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "parameters": LOOKUP.parameters,
                    "description": LOOKUP.description,
                },
            }
        ]
        assert first["messages"][0] == {"role": "system", "content": "Answer about the weather."}
        call, answer = second["messages"][-2:]
        assert call["role"] == "assistant"
        assert call["tool_calls"] == [
            {
                "id": use["id"],
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"city": "Lisbon"}'},
            }
        ]
        assert answer == {"role": "tool", "tool_call_id": use["id"], "content": result}
    else:
        assert first["tools"] == [
            {
                "name": "lookup",
                "input_schema": LOOKUP.parameters,
                "description": LOOKUP.description,
            }
        ]
        assert first["system"] == "Answer about the weather."
        call, answer = second["messages"][-2:]
        assert call == {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": use["id"], "name": "lookup", "input": {"city": "Lisbon"}}
            ],
        }
        assert answer == {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use["id"],
                    "content": result,
                    "is_error": False,
                }
            ],
        }
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


# ---- retries ---------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_429_is_retried_after_its_retry_after_and_the_journal_sees_one_call(
    provider: str, client: Client, engine: EngineServer
) -> None:
    waited: list[float] = []
    script: list[Reply | Failure] = [Failure(429, "slow down", retry_after=0.4), Reply("fine now")]
    # No backoff of our own: only the provider's retry-after can space the tries.
    policy = RetryPolicy(budget=10.0, backoff=0.0)
    async with FakeProvider(script) as fake, adapter(provider, fake, retry=policy) as model:
        asking = answering(model)

        async def timed(tc: TaskContext) -> None:
            began = time.monotonic()
            await asking(tc)
            waited.append(time.monotonic() - began)

        run = await run_to_end(client, engine, timed)

    assert run.status == pb.RUN_STATUS_COMPLETED and json.loads(run.output) == "fine now"
    assert len(fake.requests) == 2 and fake.requests[0].body == fake.requests[1].body
    assert waited[0] >= 0.4, "the retry went before the provider's retry-after"
    [record] = await model_records(engine, run.run_id)
    assert record["text"] == "fine now"
    assert steps_attempt(run) == 1, "the retry was inside the model call, not the step's"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_500_is_retried_and_the_journal_sees_one_call(
    provider: str, client: Client, engine: EngineServer
) -> None:
    script: list[Reply | Failure] = [Failure(500, "overloaded"), Failure(503), Reply("back")]
    async with FakeProvider(script) as fake, adapter(provider, fake) as model:
        run = await run_to_end(client, engine, answering(model))

    assert run.status == pb.RUN_STATUS_COMPLETED and json.loads(run.output) == "back"
    assert len(fake.requests) == 3
    assert [r["text"] for r in await model_records(engine, run.run_id)] == ["back"]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_retry_after_past_the_budget_fails_at_once_and_a_400_is_not_retried(
    provider: str, client: Client, engine: EngineServer
) -> None:
    failures: list[ModelError] = []
    policy = RetryPolicy(budget=2.0, backoff=0.01)
    script = [Failure(429, "later", retry_after=30), Failure(400, "bad tool schema")]
    async with FakeProvider(script) as fake, adapter(provider, fake, retry=policy) as model:
        asking = answering(model)

        async def turn(tc: TaskContext) -> None:
            for _ in range(2):
                try:
                    await asking(tc)
                except ModelError as err:
                    failures.append(err)
            await tc.fail_permanent(" | ".join(str(f) for f in failures))

        run = await run_to_end(client, engine, turn)

    assert run.status == pb.RUN_STATUS_FAILED
    late, bad = failures
    assert (late.status, late.tries, type(late)) == (429, 1, ModelError)
    assert "asked to wait 30.0s" in str(late) and "later" in str(late)
    assert (bad.status, bad.tries, type(bad)) == (400, 1, models.ModelRejected)
    assert "bad tool schema" in str(bad)
    assert len(fake.requests) == 2 and not fake.unscripted
    assert await model_records(engine, run.run_id) == []


def steps_attempt(run: pb.Run) -> int:
    return next(s.attempt for s in run.steps if s.step_id == "agent")


# ---- a crash after the record, a cancel mid-stream -------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_successor_after_a_crash_past_the_record_sends_no_request(
    provider: str, client: Client, engine: EngineServer
) -> None:
    task, name = unique("models"), unique("models-wf")
    await client.register_workflow(loop_workflow(name, task))
    async with FakeProvider([Reply("asked once")]) as fake, adapter(provider, fake) as model:
        handler = answering(model, apart=True)
        with Crasher("after_model") as crash:
            async with Worker(
                engine.target,
                handlers={task: handler},
                poll_wait=1.0,
                heartbeat_interval=NO_HEARTBEAT,
            ) as first:
                run = await client.start_run(name)
                await wait_for(crash.hit.is_set, timeout=20)
                async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                    await first.stop(grace=0)
                    done = await client.wait_for_run(run.run_id, timeout=30)

    assert done.status == pb.RUN_STATUS_COMPLETED and json.loads(done.output) == "asked once"
    assert len(fake.requests) == 1 and not fake.unscripted
    assert steps_attempt(done) == 1
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_cancelling_the_run_mid_stream_closes_the_request_and_records_nothing(
    provider: str, client: Client, engine: EngineServer
) -> None:
    task, name = unique("models"), unique("models-wf")
    await client.register_workflow(loop_workflow(name, task))
    ended: list[str] = []
    reply = Reply("one two three four five six", hold_after=2)
    async with FakeProvider([reply]) as fake, adapter(provider, fake) as model:
        asking = answering(model)

        async def turn(tc: TaskContext) -> None:
            try:
                await asking(tc)
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise

        async with Worker(engine.target, handlers={task: turn}, poll_wait=1.0) as worker:
            run = await client.start_run(name)
            await wait_for(fake.holding.is_set, timeout=20)
            await client.cancel_run(run.run_id, "enough")
            # The provider still holds its reply: the handler can only end if
            # the request it awaited was given up.
            await wait_for(lambda: worker.in_flight == 0, timeout=20)
            assert not fake._released.is_set()

    assert ended == ["cancelled"]
    assert (await client.get_run(run.run_id)).status == pb.RUN_STATUS_CANCELLED
    assert await model_records(engine, run.run_id) == []
    assert len(fake.requests) == 1


# ---- DAGNATS_MODEL ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "provider", "model", "base_url"),
    [
        ("openai:gpt-4.1-mini", "openai", "gpt-4.1-mini", None),
        ("anthropic:claude-sonnet-4-5", "anthropic", "claude-sonnet-4-5", None),
        (
            "openai:llama3.1:8b@http://localhost:11434/v1",
            "openai",
            "llama3.1:8b",
            "http://localhost:11434/v1",
        ),
        (
            "openai:meta-llama/Llama-3-8B@https://vllm.internal:8000/v1",
            "openai",
            "meta-llama/Llama-3-8B",
            "https://vllm.internal:8000/v1",
        ),
    ],
)
def test_dagnats_model_names_a_provider_a_model_and_maybe_a_base_url(
    text: str, provider: str, model: str, base_url: str | None
) -> None:
    spec = parse_model(text)
    assert (spec.provider, spec.model, spec.base_url) == (provider, model, base_url)
    assert str(spec) == text


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("gpt-4.1-mini", "no provider"),
        ("gemini:pro", "unknown provider 'gemini'"),
        ("openai:", "no model name"),
        ("openai:@http://localhost/v1", "no model name"),
        ("openai: gpt-4", "white space"),
        ("openai:gpt 4", "white space"),
        ("openai:-rm", "is not a model name"),
        ("openai:llama3@", "nothing after @"),
        ("openai:llama3@localhost:11434", "not an http(s) URL with a host"),
        ("openai:llama3@ftp://host/v1", "not an http(s) URL with a host"),
        ("openai:llama3@http://:80/v1", "not an http(s) URL with a host"),
        ("openai:llama3@http://host:port/v1", "is not a URL"),
        ("openai:llama3@http://user:sk-1@host/v1", "holds credentials"),
        ("openai:llama3@http://host/v1?key=1", "a query or a fragment"),
    ],
)
def test_a_bad_dagnats_model_is_a_clear_error(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        parse_model(text)
    message = str(raised.value)
    assert why in message and message.startswith(f"DAGNATS_MODEL={text!r}: ")
    assert "e.g. openai:gpt-4.1-mini" in message
    assert raised.value.field == "DAGNATS_MODEL"


def test_model_from_env_reads_the_key_and_wants_one_for_the_providers_own_server() -> None:
    assert model_from_env({}) is None and model_from_env({"DAGNATS_MODEL": ""}) is None
    for provider, variable in (("openai", "OPENAI_API_KEY"), ("anthropic", "ANTHROPIC_API_KEY")):
        with pytest.raises(InvalidArgument, match=f"{variable} is not set") as raised:
            model_from_env({"DAGNATS_MODEL": f"{provider}:m"})
        assert raised.value.field == variable
        built = model_from_env({"DAGNATS_MODEL": f"{provider}:m", variable: KEY})
        assert built is not None and built.name == f"{provider}:m" and KEY not in repr(built)
        # A server at a base URL may need no key.
        local = model_from_env({"DAGNATS_MODEL": f"{provider}:m@http://127.0.0.1:9/v1"})
        assert isinstance(local, OpenAIModel if provider == "openai" else AnthropicModel)
        assert local.base_url == "http://127.0.0.1:9/v1"


def test_the_sdk_works_without_the_provider_packages_and_says_which_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['openai'] = None; sys.modules['anthropic'] = None\n"
        "import dagnats.sdk.models as m\n"
        "assert m.model_from_env({}) is None\n"
        "for name in ('openai:x@http://h/v1', 'anthropic:x@http://h'):\n"
        "    try:\n"
        "        m.model_from_env({'DAGNATS_MODEL': name})\n"
        "    except ModuleNotFoundError as err:\n"
        "        print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "OpenAIModel needs the 'openai' package: pip install 'dagnats[openai]'",
        "AnthropicModel needs the 'anthropic' package: pip install 'dagnats[anthropic]'",
    ]


# ---- the neutral shapes, and the retry rule ---------------------------------------------


def test_a_history_and_a_response_go_through_json_unchanged() -> None:
    use = ToolUse(id="call_1", name="lookup", arguments={"city": "Lisbon"})
    history: list[Message] = [
        SystemMessage(content="be brief"),
        UserMessage(content="hi"),
        AssistantMessage(content="let me look", tool_calls=(use,)),
        ToolMessage(tool_call_id="call_1", name="lookup", content='{"c": 21}'),
    ]
    data = json.loads(json.dumps(messages_to_json(history)))
    assert messages_from_json(data) == history
    response = ModelResponse(text="x", tool_calls=(use,), stop_reason=StopReason.TOOL_CALLS)
    assert ModelResponse.from_json(json.loads(json.dumps(response.to_json()))) == response


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"role": "user"}, None),  # content defaults to ""
        ({"role": "robot", "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": 3}, "messages[0].content"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "tool_calls": [{"id": "a"}]}, "messages[0].tool_calls[0].name"),
        ("hello", "messages[0]"),
    ],
)
def test_a_malformed_history_names_its_field(data: Any, field: str | None) -> None:
    if field is None:
        assert messages_from_json([data]) == [UserMessage(content="")]
        return
    with pytest.raises(InvalidArgument) as raised:
        messages_from_json([data])
    assert raised.value.field == field


def test_a_tool_result_goes_to_the_model_as_text_and_an_interrupted_call_as_an_error() -> None:
    from dagnats.sdk import ToolResult

    use = ToolUse(id="c", name="send", arguments={})
    assert tool_message(use, ToolResult(output={"ok": True})).content == '{"ok": true}'
    assert tool_message(use, ToolResult(output="plain")).content == "plain"
    failed = tool_message(use, ToolResult(error="KeyError: 'city'"))
    assert failed.is_error and failed.content == "KeyError: 'city'"
    cut = tool_message(use, ToolResult(interrupted=True, partial="sending;"))
    assert cut.is_error and "did not finish" in cut.content and "sending;" in cut.content


def test_anthropic_turns_merge_tool_results_and_a_following_user_message() -> None:
    use = ToolUse(id="t1", name="lookup", arguments={})
    system, turns = to_anthropic(
        [
            SystemMessage(content="one"),
            UserMessage(content="hi"),
            AssistantMessage(tool_calls=(use,)),
            ToolMessage(tool_call_id="t1", content="21", is_error=False),
            UserMessage(content="and in °F?"),
        ]
    )
    assert system == "one"
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert [b["type"] for b in turns[2]["content"]] == ["tool_result", "text"]


def test_retry_after_reads_seconds_milliseconds_and_a_date() -> None:
    assert retry_after({"Retry-After": "2.5"}) == 2.5
    assert retry_after({"retry-after-ms": "300", "retry-after": "9"}) == 0.3
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=1445412480.0) == 10
    assert retry_after({"retry-after": "soon"}) is None and retry_after({}) is None
    assert retry_after({"retry-after": "-1"}) is None


def test_a_retry_policy_is_validated() -> None:
    with pytest.raises(InvalidArgument) as raised:
        RetryPolicy(budget=float("nan"))
    assert raised.value.field == "budget"


def test_the_public_names_are_exactly_the_documented_ones() -> None:
    assert set(models.__all__) == {
        "AnthropicModel",
        "AssistantMessage",
        "ChatModel",
        "Message",
        "ModelError",
        "ModelRejected",
        "ModelResponse",
        "ModelSpec",
        "OpenAIModel",
        "RetryPolicy",
        "StopReason",
        "SystemMessage",
        "ToolMessage",
        "ToolSpec",
        "ToolUse",
        "Usage",
        "UserMessage",
        "ask",
        "message_from_json",
        "message_to_json",
        "messages_from_json",
        "messages_to_json",
        "model_from_env",
        "parse_model",
        "retry_after",
        "spec_from_env",
        "tool_message",
    }


# ---- the demo of `dagnats dev` on a real model -----------------------------------------


def dev(data: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "dagnats.cli.main", *dev_args(data, "--exit-after-demo")]
    return subprocess.run(command, capture_output=True, text=True, timeout=90, env=env)


def clean_env(**extra: str) -> dict[str, str]:
    names = ("DAGNATS_", "OPENAI_", "ANTHROPIC_")
    return {k: v for k, v in os.environ.items() if not k.startswith(names)} | extra


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_the_demo_uses_the_model_dagnats_model_names_and_streams_it(
    provider: str, tmp_path: Path
) -> None:
    script = [
        Reply(tools=[("lookup", {"city": "Lisbon"})]),
        Reply(tools=[("convert", {"celsius": 21})]),
        Reply("Lisbon is at 21 °C, which is 69.8 °F."),
    ]
    async with FakeProvider(script) as fake:
        url = fake.openai_base_url if provider == "openai" else fake.anthropic_base_url
        env = clean_env(DAGNATS_MODEL=f"{provider}:{MODEL}@{url}")
        done = await asyncio.to_thread(dev, tmp_path / "data", env)

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model        {provider}:{MODEL} at {url}" in done.stdout
    assert "status    completed" in done.stdout
    assert "Lisbon is at 21 °C, which is 69.8 °F." in done.stdout
    assert len(fake.requests) == 3 and not fake.unscripted
    assert all(r.body["stream"] is True for r in fake.requests)
    named = [t.get("name") or t["function"]["name"] for t in fake.requests[0].body["tools"]]
    assert named == ["lookup", "convert"]
    last = json.dumps(fake.requests[2].body["messages"], ensure_ascii=False)
    assert '{\\"city\\": \\"Lisbon\\", \\"celsius\\": 21}' in last
    assert '{\\"fahrenheit\\": 69.8}' in last


def test_dev_with_a_bad_dagnats_model_says_so_in_one_line(tmp_path: Path) -> None:
    done = dev(tmp_path / "data", clean_env(DAGNATS_MODEL="openai:gpt-4.1-mini"))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: OPENAI_API_KEY is not set: the openai model needs a key (pass api_key=, or "
        "set OPENAI_API_KEY; a server at a base URL may need none)"
    ]
    done = dev(tmp_path / "data", clean_env(DAGNATS_MODEL="gpt-4.1-mini"))
    assert done.returncode == 1 and done.stderr.startswith("error: DAGNATS_MODEL='gpt-4.1-mini'")
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_the_stand_in_demo_streams_its_answer_too() -> None:
    from dagnats.cli.demo import StandIn

    class Tokens:
        def __init__(self) -> None:
            self.got: list[str] = []

        def put(self, chunk: str) -> None:
            self.got.append(chunk)

    tokens = Tokens()
    done = [ToolMessage(tool_call_id="a", content="x"), ToolMessage(tool_call_id="b", content="y")]
    response = asyncio.run(StandIn().generate(done, stream=tokens))  # type: ignore[arg-type]
    assert len(tokens.got) > 1 and "".join(tokens.got) == response.text
    assert "Lisbon" in response.text


async def test_the_example_runs_on_the_model_dagnats_model_names(engine: EngineServer) -> None:
    script = [
        Reply(tools=[("search", {"q": "Lisbon weather"})]),
        Reply(tools=[("send_email", {"to": "ops@example.com", "body": "21 °C"})]),
        Reply("It is 21 °C in Lisbon; ops knows."),
        Reply("Tomorrow: 23 °C."),
    ]
    root = Path(__file__).parent.parent
    async with FakeProvider(script) as fake:
        env = clean_env(
            DAGNATS_ENGINE=engine.target, DAGNATS_MODEL=f"openai:{MODEL}@{fake.openai_base_url}"
        )
        command = [sys.executable, "-m", "examples.agent_turn.run"]
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=100, cwd=root, env=env
        )

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model openai:{MODEL}" in done.stdout
    assert "answer: It is 21 °C in Lisbon; ops knows." in done.stdout
    assert "answer: Tomorrow: 23 °C." in done.stdout
    assert len(fake.requests) == 4 and not fake.unscripted
    # The follow-up reaches the model after the first answer; the email's
    # result went back answering the model's own call id.
    messages = fake.requests[3].body["messages"]
    assert messages[-1] == {"role": "user", "content": "And tomorrow?"}
    call = next(
        m
        for m in messages
        if m["role"] == "assistant"
        and m.get("tool_calls")
        and m["tool_calls"][0]["function"]["name"] == "send_email"
    )
    result = messages[messages.index(call) + 1]
    assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]
    assert json.loads(result["content"])["sent"] is True
