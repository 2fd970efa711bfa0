"""A local model provider for tests: OpenAI chat completions and Anthropic
messages on their wire formats, scripted reply by reply.

The model adapters and agent integrations are tested against this server as
they would run against the real providers (the ``openai`` and ``anthropic``
packages pointed at :attr:`FakeProvider.openai_base_url` and
:attr:`FakeProvider.anthropic_base_url`), never against the internet::

    async with FakeProvider([Reply("Hello there"), Reply(tools=[("lookup", {"q": "x"})])]) as p:
        client = openai.AsyncOpenAI(base_url=p.openai_base_url, api_key="test")
        ...
    assert p.requests[0].body["messages"][0]["content"] == "hi"

Each request takes the next scripted item: a :class:`Reply` (streamed when the
request asks for a stream, token by token) or a :class:`Failure` (an HTTP error
in the provider's error format, with ``retry-after`` when given). A reply with
``hold_after`` stops after that many tokens until :meth:`FakeProvider.release`
(``holding`` tells a test it got there), so a test can kill, stall or cancel a
caller mid-stream. A request with nothing left in the script gets a 500 and is
listed in ``unscripted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"


@dataclass
class Reply:
    """One model response: text, tool calls (name, arguments), or both."""

    text: str = ""
    tools: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    tokens: list[str] | None = None  # how the text streams; words by default
    hold_after: int | None = None  # stream this many tokens, then wait for release()
    cached: int = 0  # input tokens reported as read from the prompt cache

    def usage(self) -> tuple[int, int, int]:
        """(input, output, cached) tokens as the servers report this reply:
        10 fresh input tokens plus the cached ones; a token per streamed piece
        of text and per tool call out."""
        return 10 + self.cached, len(self.stream_tokens()) + len(self.tools), self.cached

    def stream_tokens(self) -> list[str]:
        if self.tokens is not None:
            assert "".join(self.tokens) == self.text, "tokens must join to the text"
            return self.tokens
        words = self.text.split(" ")
        return [w + " " for w in words[:-1]] + [words[-1]] if self.text else []


@dataclass
class Failure:
    """An HTTP error answered instead of a reply."""

    status: int
    message: str = "scripted failure"
    retry_after: float | None = None


@dataclass
class Received:
    """A request as the provider saw it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class FakeProvider:
    """Serves the script on a free loopback port for the life of the context."""

    def __init__(self, script: Iterable[Reply | Failure] = ()) -> None:
        self.script: deque[Reply | Failure] = deque(script)
        self.requests: list[Received] = []
        self.unscripted: list[Received] = []
        self.holding = asyncio.Event()
        self._released = asyncio.Event()
        self._ids = itertools.count(1)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url

    def add(self, *items: Reply | Failure) -> None:
        self.script.extend(items)

    def release(self) -> None:
        """Let a held reply stream the rest of its tokens."""
        self._released.set()

    async def __aenter__(self) -> FakeProvider:
        # IPPROTO_TCP, so that asyncio turns Nagle's algorithm off on each
        # connection as a provider's servers do (see the gateway's _bind).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._openai, methods=["POST"]),
                Route("/v1/messages", self._anthropic, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.005)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._released.set()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _take(self, request: Request) -> tuple[Received, Reply | Failure | None]:
        received = Received(request.url.path, dict(request.headers), await request.json())
        self.requests.append(received)
        if not self.script:
            self.unscripted.append(received)
            return received, None
        return received, self.script.popleft()

    async def _tokens(self, reply: Reply) -> AsyncIterator[str]:
        for n, token in enumerate(reply.stream_tokens()):
            if reply.hold_after is not None and n == reply.hold_after:
                self.holding.set()
                await self._released.wait()
            yield token
            await asyncio.sleep(0)

    # -- OpenAI chat completions ---------------------------------------------

    async def _openai(self, request: Request) -> Response:
        received, item = await self._take(request)
        if not isinstance(item, Reply):
            return _failure(item, {"error": {"message": _message(item), "type": _kind(item)}})
        rid = f"chatcmpl-{next(self._ids)}"
        calls = [self._openai_call(name, args) for name, args in item.tools]
        finish = "tool_calls" if calls else "stop"
        if not received.body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": item.text or None}
            if calls:
                message["tool_calls"] = calls
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": 0,
                    "model": received.body.get("model", MODEL),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": _openai_usage(item),
                }
            )
        usage = bool((received.body.get("stream_options") or {}).get("include_usage"))
        return _sse(self._openai_chunks(rid, item, calls, finish, usage), named=False)

    def _openai_call(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        arguments = json.dumps(args)
        return {
            "id": f"call_{next(self._ids)}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    async def _openai_chunks(
        self, rid: str, reply: Reply, calls: list[dict[str, Any]], finish: str, usage: bool
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        def chunk(
            delta: dict[str, Any], finish_reason: str | None = None
        ) -> tuple[str, dict[str, Any]]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return "", {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [choice],
            }

        yield chunk({"role": "assistant", "content": ""})
        async for token in self._tokens(reply):
            yield chunk({"content": token})
        for index, call in enumerate(calls):
            yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, finish)
        if usage:
            body = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": MODEL}
            yield "", {**body, "choices": [], "usage": _openai_usage(reply)}

    # -- Anthropic messages ----------------------------------------------------

    async def _anthropic(self, request: Request) -> Response:
        received, item = await self._take(request)
        if not isinstance(item, Reply):
            error = {"type": "error", "error": {"type": _kind(item), "message": _message(item)}}
            return _failure(item, error)
        mid = f"msg_{next(self._ids)}"
        uses = [
            {"type": "tool_use", "id": f"toolu_{next(self._ids)}", "name": name, "input": args}
            for name, args in item.tools
        ]
        stop = "tool_use" if uses else "end_turn"
        usage = _anthropic_usage(item)
        message = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": received.body.get("model", MODEL),
            "content": ([{"type": "text", "text": item.text}] if item.text else []) + uses,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not received.body.get("stream"):
            return JSONResponse(message)
        return _sse(self._anthropic_events(message, item, uses), named=True)

    async def _anthropic_events(
        self, message: dict[str, Any], reply: Reply, uses: list[dict[str, Any]]
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {**_anthropic_usage(reply), "output_tokens": 0},
        }
        yield "message_start", {"type": "message_start", "message": start}
        index = 0
        if reply.text:
            block: dict[str, Any] = {"type": "text", "text": ""}
            yield (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
            async for token in self._tokens(reply):
                delta = {"type": "text_delta", "text": token}
                yield (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            yield "content_block_stop", {"type": "content_block_stop", "index": 0}
            index = 1
        for use in uses:
            block = {**use, "input": {}}
            yield (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
            json_delta = {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": json_delta},
            )
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
            index += 1
        end = {"stop_reason": message["stop_reason"], "stop_sequence": None}
        out = {"output_tokens": message["usage"]["output_tokens"]}
        yield "message_delta", {"type": "message_delta", "delta": end, "usage": out}
        yield "message_stop", {"type": "message_stop"}


def _sse(events: AsyncIterator[tuple[str, dict[str, Any]]], *, named: bool) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for name, data in events:
            head = f"event: {name}\n" if named else ""
            yield f"{head}data: {json.dumps(data)}\n\n".encode()
        if not named:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _failure(item: Failure | None, body: dict[str, Any]) -> JSONResponse:
    status = item.status if item is not None else 500
    headers = {}
    if item is not None and item.retry_after is not None:
        headers["retry-after"] = str(item.retry_after)
    return JSONResponse(body, status_code=status, headers=headers)


def _message(item: Failure | None) -> str:
    return item.message if item is not None else "no scripted reply left"


def _kind(item: Failure | None) -> str:
    status = item.status if item is not None else 500
    return {429: "rate_limit_error", 400: "invalid_request_error", 401: "authentication_error"}.get(
        status, "api_error"
    )


def _openai_usage(reply: Reply) -> dict[str, Any]:
    # prompt_tokens counts the cached tokens too; the details say how many.
    prompt, completion, cached = reply.usage()
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _anthropic_usage(reply: Reply) -> dict[str, int]:
    # input_tokens leaves out what was read from the cache (cache_read_input_tokens).
    prompt, completion, cached = reply.usage()
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }
