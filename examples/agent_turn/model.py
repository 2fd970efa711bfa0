"""A real model behind the example handler's ``call_model``.

The handler speaks its own JSON turns (``{"done": false, "tool": ...}``,
``{"done": true, "answer": ...}``) and keeps its own history; this module
converts that history to the neutral messages of ``dagnats.sdk.models`` and
the model's response back to a turn, so any model those adapters speak to
(``DAGNATS_MODEL``) can play the model's part. A turn carries one tool call:
when the model asks for several, the first is taken, and only that one is
shown to it again with its result.
"""

from __future__ import annotations

import json
from typing import Any

from dagnats.sdk import ToolResult
from dagnats.sdk.models import (
    AssistantMessage,
    ChatModel,
    Message,
    ModelResponse,
    SystemMessage,
    ToolSpec,
    ToolUse,
    UserMessage,
    tool_message,
)
from examples.agent_turn.handler import CallModel, History

SYSTEM = (
    "You are an operations assistant. Use search to look things up and send_email to "
    "tell people; call one tool at a time, then answer in one or two sentences."
)

TOOLS = (
    ToolSpec(
        name="search",
        description="Search the web; returns a list of result snippets.",
        parameters={
            "type": "object",
            "properties": {"q": {"type": "string", "description": "The query"}},
            "required": ["q"],
        },
    ),
    ToolSpec(
        name="send_email",
        description="Send an email. Sending twice sends two emails.",
        parameters={
            "type": "object",
            "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
            "required": ["to", "body"],
        },
    ),
)


def call_model_with(model: ChatModel, *, tools: tuple[ToolSpec, ...] = TOOLS) -> CallModel:
    """The handler's ``call_model`` over ``model``."""

    async def call_model(history: History) -> Any:
        return to_turn(await model.generate(to_messages(history), tools=tools))

    return call_model


def to_turn(response: ModelResponse) -> dict[str, Any]:
    """The model's response as the handler's turn."""
    if response.tool_calls:
        call = response.tool_calls[0]
        return {"done": False, "tool": call.name, "input": call.arguments, "id": call.id}
    return {"done": True, "answer": response.text}


def to_messages(history: History) -> list[Message]:
    """The handler's history as neutral messages, after the system prompt."""
    messages: list[Message] = [SystemMessage(content=SYSTEM)]
    last: ToolUse | None = None
    for n, entry in enumerate(history):
        match entry:
            case {"role": "assistant", "content": {"done": False} as turn}:
                last = ToolUse(
                    id=turn.get("id") or f"call_{n}", name=turn["tool"], arguments=turn.get("input")
                )
                messages.append(AssistantMessage(tool_calls=(last,)))
            case {"role": "assistant", "content": {"answer": answer}}:
                messages.append(AssistantMessage(content=_text(answer)))
            case {"role": "tool"} if last is not None:
                result = ToolResult(
                    output=entry.get("output"),
                    error=entry.get("error", ""),
                    interrupted=entry.get("interrupted", False),
                    partial=entry.get("partial", ""),
                )
                messages.append(tool_message(last, result))
                last = None
            case {"role": "user", "content": content}:
                messages.append(UserMessage(content=_text(content)))
    return messages


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
