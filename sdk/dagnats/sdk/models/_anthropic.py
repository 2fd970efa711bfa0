"""An Anthropic messages model (the ``anthropic`` package).

System messages become the request's ``system``; a tool's result becomes a
``tool_result`` block in a user turn, and turns of one role in a row are
merged into one, as the messages API wants. A message (or its stream of
events) becomes a :class:`ModelResponse`; nothing else crosses this edge.
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
    "end_turn": StopReason.END,
    "tool_use": StopReason.TOOL_CALLS,
    "max_tokens": StopReason.MAX_TOKENS,
    "stop_sequence": StopReason.STOP_SEQUENCE,
    "refusal": StopReason.REFUSED,
}


class AnthropicModel(ProviderModel):
    """A messages API model.

    Args:
        model: The model's name, such as ``claude-sonnet-4-5``.
        base_url: The API root; Anthropic's by default.
        api_key: The key; ``ANTHROPIC_API_KEY`` by default. A server at a
            ``base_url`` may need none.
        retry: How long a failed request is retried (see ``RetryPolicy``).
        timeout: Seconds to connect, and to wait for each read of the answer.
        max_tokens: Upper bound on the response's tokens (the API requires one).
        options: More request fields, sent as they are (``temperature``, ...).

    Raises:
        ModuleNotFoundError: the ``anthropic`` package is not installed.
        InvalidArgument: no key for Anthropic's own server.
    """

    provider = "anthropic"
    key_variable = "ANTHROPIC_API_KEY"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = 120.0,
        max_tokens: int = 4096,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            model,
            sdk=require("anthropic", extra="anthropic", what="AnthropicModel"),
            client="AsyncAnthropic",
            base_url=base_url,
            api_key=api_key,
            retry=retry,
            timeout=timeout,
            options=options,
        )
        self._max_tokens = max_tokens

    def _request(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> dict[str, Any]:
        system, turns = to_anthropic(messages)
        request: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self._max_tokens,
            "messages": turns,
        }
        if system:
            request["system"] = system
        if tools:
            request["tools"] = [anthropic_tool(t) for t in tools]
        return request

    def _reader(self, stream: TokenStream) -> StreamReader:
        return _Events(stream)

    async def _complete(self, request: dict[str, Any]) -> ModelResponse:
        message = await self._client.messages.create(**request)
        text = "".join(b.text for b in message.content if b.type == "text")
        calls = tuple(
            ToolUse(id=b.id, name=b.name, arguments=b.input)
            for b in message.content
            if b.type == "tool_use"
        )
        return ModelResponse(
            text=text,
            tool_calls=calls,
            stop_reason=STOP.get(message.stop_reason or "end_turn", StopReason.OTHER),
            usage=_usage(message.usage, message.usage.output_tokens or 0),
            model=message.model or self.model,
        )


class _Events(StreamReader):
    """Assembles a streamed message, putting its text on the token stream."""

    async def read(self, client: Any, request: dict[str, Any]) -> ModelResponse:
        text: list[str] = []
        blocks: dict[int, dict[str, str]] = {}  # tool_use blocks by index
        stop, model = "end_turn", request["model"]
        started: Any = None
        output_tokens = 0
        streamed = await client.messages.create(**request, stream=True)
        async with streamed as events:
            async for event in events:
                match event.type:
                    case "message_start":
                        model = event.message.model or model
                        started = event.message.usage
                    case "content_block_start" if event.content_block.type == "tool_use":
                        block = event.content_block
                        blocks[event.index] = {"id": block.id, "name": block.name, "json": ""}
                    case "content_block_delta" if event.delta.type == "text_delta":
                        self.put(event.delta.text)
                        text.append(event.delta.text)
                    case "content_block_delta" if event.delta.type == "input_json_delta":
                        blocks[event.index]["json"] += event.delta.partial_json
                    case "message_delta":
                        stop = event.delta.stop_reason or stop
                        output_tokens = event.usage.output_tokens or output_tokens
        calls = tuple(
            ToolUse(id=b["id"], name=b["name"], arguments=_parsed(b["json"]))
            for _, b in sorted(blocks.items())
        )
        return ModelResponse(
            text="".join(text),
            tool_calls=calls,
            stop_reason=STOP.get(stop, StopReason.OTHER),
            usage=_usage(started, output_tokens),
            model=model,
        )


def _usage(usage: Any, output_tokens: int) -> Usage:
    """Anthropic counts the input read from the prompt cache, and the input
    written to it, apart from ``input_tokens``: all three are input here, the
    first also cached."""
    if usage is None:
        return Usage(output_tokens=output_tokens)
    read = getattr(usage, "cache_read_input_tokens", None) or 0
    written = getattr(usage, "cache_creation_input_tokens", None) or 0
    return Usage(
        input_tokens=(usage.input_tokens or 0) + read + written,
        output_tokens=output_tokens,
        cached_tokens=read,
    )


def to_anthropic(messages: Sequence[Message]) -> tuple[str, list[dict[str, Any]]]:
    """Neutral messages as the request's ``system`` and its turns."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        blocks: list[dict[str, Any]]
        match message:
            case SystemMessage(content=content):
                system.append(content)
                continue
            case UserMessage(content=content):
                role, blocks = "user", [{"type": "text", "text": content}] if content else []
            case AssistantMessage(content=content, tool_calls=calls):
                role = "assistant"
                blocks = [{"type": "text", "text": content}] if content else []
                blocks += [
                    {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
                    for c in calls
                ]
            case ToolMessage():
                role = "user"
                blocks = [
                    {
                        "type": "tool_result",
                        "tool_use_id": message.tool_call_id,
                        "content": message.content,
                        "is_error": message.is_error,
                    }
                ]
        if not blocks:
            continue  # the API refuses empty turns and empty text
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(system), turns


def anthropic_tool(tool: ToolSpec) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": tool.name, "input_schema": tool.parameters}
    if tool.description:
        spec["description"] = tool.description
    return spec


def _input(arguments: Any) -> Any:
    # tool_use.input must be an object; arguments the model gave as bad JSON
    # go back as it wrote them.
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


def _parsed(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text
