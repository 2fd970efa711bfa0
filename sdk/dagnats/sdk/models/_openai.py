"""An OpenAI-compatible chat completions model (the ``openai`` package).

Any server that speaks ``/v1/chat/completions`` works by ``base_url``: OpenAI
itself, vLLM, Ollama, LM Studio, llama.cpp's server. The neutral shapes become
chat messages and function tools here, and a completion (or its stream of
chunks) becomes a :class:`ModelResponse`; nothing else crosses this edge.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dagnats.sdk._stream import TokenStream
from dagnats.sdk.models._ask import require
from dagnats.sdk.models._base import ProviderModel, StreamReader
from dagnats.sdk.models._retry import RetryPolicy
from dagnats.sdk.models._shapes import (
    AssistantMessage,
    Message,
    ModelResponse,
    StopReason,
    SystemMessage,
    ToolMessage,
    ToolSpec,
    ToolUse,
    Usage,
    UserMessage,
)

STOP = {
    "stop": StopReason.END,
    "tool_calls": StopReason.TOOL_CALLS,
    "function_call": StopReason.TOOL_CALLS,
    "length": StopReason.MAX_TOKENS,
    "content_filter": StopReason.REFUSED,
}


class OpenAIModel(ProviderModel):
    """A chat completions model.

    Args:
        model: The model's name at the server, such as ``gpt-4.1-mini``.
        base_url: The server's API root (``http://localhost:11434/v1`` for
            Ollama); OpenAI's by default.
        api_key: The key; ``OPENAI_API_KEY`` by default. A server at a
            ``base_url`` may need none.
        retry: How long a failed request is retried (see ``RetryPolicy``).
        timeout: Seconds to connect, and to wait for each read of the answer.
        max_tokens: Upper bound on the response's tokens (the server's default
            when None).
        options: More request fields, sent as they are (``temperature``, ...).

    Raises:
        ModuleNotFoundError: the ``openai`` package is not installed.
        InvalidArgument: no key for OpenAI's own server.
    """

    provider = "openai"
    key_variable = "OPENAI_API_KEY"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = 120.0,
        max_tokens: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            model,
            sdk=require("openai", extra="openai", what="OpenAIModel"),
            client="AsyncOpenAI",
            base_url=base_url,
            api_key=api_key,
            retry=retry,
            timeout=timeout,
            options=options,
        )
        self._max_tokens = max_tokens

    def _request(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [to_openai(m) for m in messages],
        }
        if tools:
            request["tools"] = [openai_tool(t) for t in tools]
        if self._max_tokens is not None:
            request["max_completion_tokens"] = self._max_tokens
        return request

    def _reader(self, stream: TokenStream) -> StreamReader:
        return _Chunks(stream)

    async def _complete(self, request: dict[str, Any]) -> ModelResponse:
        completion = await self._client.chat.completions.create(**request)
        choice = completion.choices[0]
        message = choice.message
        calls = tuple(
            _tool_use(c.id, c.function.name, c.function.arguments)
            for c in (message.tool_calls or ())
        )
        return ModelResponse(
            text=message.content or "",
            tool_calls=calls,
            stop_reason=_stop(choice.finish_reason, calls),
            usage=_usage(completion.usage),
            model=completion.model or self.model,
        )


class _Chunks(StreamReader):
    """Assembles a streamed completion, putting its text on the token stream."""

    async def read(self, client: Any, request: dict[str, Any]) -> ModelResponse:
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        finish: str | None = None
        usage: Any = None
        model = request["model"]
        streamed = await client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        async with streamed as chunks:
            async for chunk in chunks:
                model = chunk.model or model
                usage = chunk.usage or usage
                for choice in chunk.choices[:1]:
                    delta = choice.delta
                    if delta.content:
                        self.put(delta.content)
                        text.append(delta.content)
                    for part in delta.tool_calls or ():
                        call = calls.setdefault(part.index, {"id": "", "name": "", "args": ""})
                        if part.id:
                            call["id"] = part.id
                        if part.function is not None:
                            call["name"] += part.function.name or ""
                            call["args"] += part.function.arguments or ""
                    finish = choice.finish_reason or finish
        uses = tuple(_tool_use(c["id"], c["name"], c["args"]) for _, c in sorted(calls.items()))
        return ModelResponse(
            text="".join(text),
            tool_calls=uses,
            stop_reason=_stop(finish, uses),
            usage=_usage(usage),
            model=model,
        )


def to_openai(message: Message) -> dict[str, Any]:
    """A neutral message as a chat completions message."""
    match message:
        case SystemMessage(content=content):
            return {"role": "system", "content": content}
        case UserMessage(content=content):
            return {"role": "user", "content": content}
        case AssistantMessage(content=content, tool_calls=calls):
            out: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                out["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments(c.arguments)},
                    }
                    for c in calls
                ]
            return out
        case ToolMessage():
            # Chat completions has no error flag on a tool message: say it.
            text = f"error: {message.content}" if message.is_error else message.content
            return {"role": "tool", "tool_call_id": message.tool_call_id, "content": text}


def openai_tool(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _tool_use(call_id: str | None, name: str, arguments: str | None) -> ToolUse:
    try:
        parsed: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = arguments  # the model's own text, for the handler to show it
    return ToolUse(id=call_id or "", name=name, arguments=parsed)


def _stop(reason: str | None, calls: tuple[ToolUse, ...]) -> StopReason:
    if reason is None:
        return StopReason.TOOL_CALLS if calls else StopReason.END
    return STOP.get(reason, StopReason.OTHER)


def _usage(usage: Any) -> Usage:
    if usage is None:
        return Usage()
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", 0) if details is not None else 0
    return Usage(
        input_tokens=usage.prompt_tokens or 0,
        output_tokens=usage.completion_tokens or 0,
        cached_tokens=cached or 0,
    )
