"""The one call a handler makes: a journaled, streamed model request."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any, Protocol

from dagnats.core.usage import Usage
from dagnats.sdk._journal import Journal
from dagnats.sdk._stream import TokenStream
from dagnats.sdk._usage import WithUsage
from dagnats.sdk.models._shapes import Message, ModelResponse, ToolSpec


class ChatModel(Protocol):
    """A model a handler can ask: the adapters here, or a stand-in of yours."""

    @property
    def name(self) -> str:
        """``provider:model``, for logs and for people."""
        ...

    async def generate(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        stream: TokenStream | None = None,
    ) -> ModelResponse:
        """One model response to ``messages``; text deltas go on ``stream``
        while it is generated, when one is given."""
        ...


async def ask(
    j: Journal,
    model: ChatModel,
    messages: Sequence[Message],
    *,
    tools: Sequence[ToolSpec] = (),
    stream: bool = True,
) -> ModelResponse:
    """Ask ``model`` through the journal: the response recorded at this
    position, or a new request whose response is recorded.

    With ``stream`` (the default) the text streams to the step's readers while
    it is generated (:meth:`Journal.streamed_model`); the record is the whole
    response either way, as :meth:`ModelResponse.to_json` shapes it.

    Raises:
        ModelError: the request failed after its retries (nothing recorded).
        ModelRejected: the provider refused the request (nothing recorded).
        Fenced: a successor holds the step.
    """

    async def call(live: TokenStream | None) -> Any:
        response = await model.generate(messages, tools=tools, stream=live)
        if not response.usage.tokens:  # a stand-in, or a server that counts nothing
            return response.to_json()
        return WithUsage(response.to_json(), spent(response, model))

    if stream:
        recorded = await j.streamed_model(call)
    else:
        recorded = await j.model(lambda: call(None))
    return ModelResponse.from_json(recorded)


def spent(response: ModelResponse, model: ChatModel) -> Usage:
    """What a response's call spent, for the usage ledger: the provider's
    counts, under the model that answered (the one asked when unnamed)."""
    named = response.model or model.name.partition(":")[2] or model.name
    return replace(response.usage, model=named)


def require(module: str, *, extra: str, what: str) -> ModuleType:
    """Import an optional provider package, or say which extra installs it.

    Raises:
        ModuleNotFoundError: the package is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ModuleNotFoundError(
            f"{what} needs the {module!r} package: pip install 'dagnats[{extra}]'",
            name=module,
        ) from err
