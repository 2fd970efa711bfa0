"""The conversation a durable agent carries from iteration to iteration.

Pure: messages in, messages out. The state a commit carries is
``{"messages": [...], "answered": bool, "output": ...}``: the message history
in pydantic-ai's own JSON form (``ModelMessagesTypeAdapter``), whether it ends
in a final answer, and that answer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from pydantic_ai import ModelMessagesTypeAdapter
from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart


def dump_messages(messages: Sequence[ModelMessage]) -> list[Any]:
    """A message history as JSON (pydantic-ai's own form), as checkpoints carry it."""
    return list(ModelMessagesTypeAdapter.dump_python(list(messages), mode="json"))


def load_messages(data: Any) -> list[ModelMessage]:
    """The message history a checkpoint carries."""
    return list(ModelMessagesTypeAdapter.validate_python(data))


def content_text(content: Any) -> str:
    """An input's content as the text of a user message: a string as is,
    ``{"text": ...}`` as its text (the shape of the spec's inputs), anything
    else as its JSON."""
    match content:
        case str(text):
            return text
        case {"text": str(text)}:
            return text
    return json.dumps(content, ensure_ascii=False)


def with_user_messages(messages: list[ModelMessage], texts: Sequence[str]) -> list[ModelMessage]:
    """The history with ``texts`` as user messages in its pending request.

    At a tool-round boundary the history ends in the request that carries the
    tool results; the texts join that request, after the results, as
    pydantic-ai itself places a prompt that follows tool results. A history
    that ends otherwise gets a new request.
    """
    if not texts:
        return messages
    parts = [UserPromptPart(text) for text in texts]
    if messages and isinstance(last := messages[-1], ModelRequest):
        return [*messages[:-1], dataclasses.replace(last, parts=[*last.parts, *parts])]
    return [*messages, ModelRequest(parts=parts)]
