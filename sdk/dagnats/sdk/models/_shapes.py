"""The neutral shapes a handler speaks to any model in: messages, tools, and
the response the journal records.

Every adapter converts these to its provider's wire format and back at its
edge, so a handler written against them runs with either provider, and a
recorded response replays the same whichever provider wrote it.

Invariants:

- Every shape is JSON both ways (``to_json`` / ``from_json``); ``from_json``
  validates and names the offending field, so a checkpoint or a record read
  back cannot smuggle in a malformed message.
- A response holds what the model said and nothing about the request: no key,
  no headers, no base URL.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dagnats.core.errors import InvalidArgument
from dagnats.core.usage import Usage as Usage
from dagnats.sdk._journal import ToolResult


class StopReason(enum.Enum):
    """Why the model stopped, the same for every provider."""

    END = "end"
    """A final answer (OpenAI ``stop``, Anthropic ``end_turn``)."""
    TOOL_CALLS = "tool_calls"
    """The model asks for tool calls (``tool_calls``, ``tool_use``)."""
    MAX_TOKENS = "max_tokens"
    """Cut short by the output limit (``length``, ``max_tokens``)."""
    STOP_SEQUENCE = "stop_sequence"
    """A stop sequence was generated."""
    REFUSED = "refused"
    """The provider's filter or the model refused (``content_filter``, ``refusal``)."""
    OTHER = "other"
    """Anything else the provider said (``pause_turn``, an unknown reason)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A tool the model may call: its name, what it does, and the JSON schema
    of its arguments (an ``object`` schema)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolUse:
    """A tool call the model asks for. ``arguments`` is the JSON the model
    gave, parsed; the text itself when it is not JSON (tell the model)."""

    id: str
    name: str
    arguments: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @staticmethod
    def from_json(data: Any, *, where: str) -> ToolUse:
        obj = _object(data, where)
        return ToolUse(
            id=_text(obj, "id", where),
            name=_text(obj, "name", where, required=True),
            arguments=obj.get("arguments"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelResponse:
    """One model response: what the journal records for a model call."""

    text: str = ""
    tool_calls: tuple[ToolUse, ...] = ()
    stop_reason: StopReason = StopReason.END
    usage: Usage = field(default_factory=Usage)
    model: str = ""  # the model that answered, as the provider named it

    def message(self) -> AssistantMessage:
        """The response as the assistant's message, to append to the history."""
        return AssistantMessage(content=self.text, tool_calls=self.tool_calls)

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tool_calls": [call.to_json() for call in self.tool_calls],
            "stop_reason": self.stop_reason.value,
            "usage": {
                "input_tokens": self.usage.input_tokens,
                "output_tokens": self.usage.output_tokens,
                "cached_tokens": self.usage.cached_tokens,
            },
            "model": self.model,
        }

    @staticmethod
    def from_json(data: Any) -> ModelResponse:
        """The response a record holds.

        Raises:
            InvalidArgument: ``data`` is not a response; names the field.
        """
        obj = _object(data, "response")
        reason = obj.get("stop_reason", StopReason.END.value)
        try:
            stop = StopReason(reason)
        except ValueError:
            raise InvalidArgument(
                f"response.stop_reason is not a stop reason: {reason!r}",
                field="response.stop_reason",
            ) from None
        usage = _object(obj.get("usage", {}), "response.usage")
        return ModelResponse(
            text=_text(obj, "text", "response"),
            tool_calls=tuple(
                ToolUse.from_json(call, where=f"response.tool_calls[{n}]")
                for n, call in enumerate(_list(obj, "tool_calls", "response"))
            ),
            stop_reason=stop,
            usage=Usage(
                input_tokens=_count(usage, "input_tokens", "response.usage"),
                output_tokens=_count(usage, "output_tokens", "response.usage"),
                cached_tokens=_count(usage, "cached_tokens", "response.usage"),
            ),
            model=_text(obj, "model", "response"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemMessage:
    """Instructions for the model (OpenAI: a system message; Anthropic: ``system``)."""

    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UserMessage:
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AssistantMessage:
    """What the model said: text, tool calls, or both."""

    content: str = ""
    tool_calls: tuple[ToolUse, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolMessage:
    """A tool's result, answering the assistant's call ``tool_call_id``."""

    tool_call_id: str
    content: str
    name: str = ""
    is_error: bool = False


Message = SystemMessage | UserMessage | AssistantMessage | ToolMessage


def tool_message(call: ToolUse, result: ToolResult) -> ToolMessage:
    """The message that hands a journaled tool's result back to the model.

    The output goes as JSON text; a tool's own error, or a call an earlier
    holder started and did not finish (``interrupted``, with its partial
    output), goes as an error the model can read and act on.
    """
    if result.interrupted:
        partial = f" Its partial output: {result.partial}" if result.partial else ""
        text = (
            "The call was started and did not finish (the worker running it stopped); "
            f"it may or may not have taken effect.{partial}"
        )
        return ToolMessage(tool_call_id=call.id, name=call.name, content=text, is_error=True)
    if result.error:
        return ToolMessage(
            tool_call_id=call.id, name=call.name, content=result.error, is_error=True
        )
    output = result.output
    text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
    return ToolMessage(tool_call_id=call.id, name=call.name, content=text)


def message_to_json(message: Message) -> dict[str, Any]:
    """A message as JSON, for a checkpoint."""
    match message:
        case SystemMessage(content=content):
            return {"role": "system", "content": content}
        case UserMessage(content=content):
            return {"role": "user", "content": content}
        case AssistantMessage(content=content, tool_calls=calls):
            data: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                data["tool_calls"] = [call.to_json() for call in calls]
            return data
        case ToolMessage():
            return {
                "role": "tool",
                "tool_call_id": message.tool_call_id,
                "name": message.name,
                "content": message.content,
                "is_error": message.is_error,
            }


def messages_to_json(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """A history as JSON, for a checkpoint."""
    return [message_to_json(m) for m in messages]


def messages_from_json(data: Any) -> list[Message]:
    """A history read back from JSON (a checkpoint, a run's input).

    Raises:
        InvalidArgument: ``data`` is not a list of messages; names the field.
    """
    if not isinstance(data, list):
        raise InvalidArgument(
            f"messages must be a list, got {type(data).__name__}", field="messages"
        )
    return [message_from_json(item, where=f"messages[{n}]") for n, item in enumerate(data)]


def message_from_json(data: Any, *, where: str = "message") -> Message:
    """One message read back from JSON.

    Raises:
        InvalidArgument: ``data`` is not a message; names the field.
    """
    obj = _object(data, where)
    match obj.get("role"):
        case "system":
            return SystemMessage(content=_text(obj, "content", where))
        case "user":
            return UserMessage(content=_text(obj, "content", where))
        case "assistant":
            calls = _list(obj, "tool_calls", where)
            return AssistantMessage(
                content=_text(obj, "content", where),
                tool_calls=tuple(
                    ToolUse.from_json(c, where=f"{where}.tool_calls[{n}]")
                    for n, c in enumerate(calls)
                ),
            )
        case "tool":
            is_error = obj.get("is_error", False)
            if not isinstance(is_error, bool):
                raise InvalidArgument(
                    f"{where}.is_error must be a boolean", field=f"{where}.is_error"
                )
            return ToolMessage(
                tool_call_id=_text(obj, "tool_call_id", where, required=True),
                name=_text(obj, "name", where),
                content=_text(obj, "content", where),
                is_error=is_error,
            )
    raise InvalidArgument(
        f"{where}.role must be system, user, assistant or tool, got {obj.get('role')!r}",
        field=f"{where}.role",
    )


def _object(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where} must be an object, got {type(data).__name__}", field=where)
    return data


def _text(obj: dict[str, Any], key: str, where: str, *, required: bool = False) -> str:
    value = obj.get(key, "")
    if value is None:
        value = ""
    if not isinstance(value, str) or (required and not value):
        want = "a non-empty string" if required else "a string"
        raise InvalidArgument(f"{where}.{key} must be {want}", field=f"{where}.{key}")
    return value


def _list(obj: dict[str, Any], key: str, where: str) -> list[Any]:
    value = obj.get(key) or []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}.{key} must be a list", field=f"{where}.{key}")
    return value


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key, 0) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{where}.{key} must be a count", field=f"{where}.{key}")
    return value
