"""What the two adapters share: the key, the client, retries and streaming.

Both provider packages are generated from one template: an async client
taking ``api_key``, ``base_url``, ``timeout`` and ``max_retries``, and the
same error classes. An adapter subclass builds its request and converts its
answer; this class sends it, by the retry rule of ``_retry``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar, Self

from dagnats.core.errors import InvalidArgument
from dagnats.sdk._stream import TokenStream
from dagnats.sdk.models._retry import RetryPolicy, classifier, retrying
from dagnats.sdk.models._shapes import Message, ModelResponse, ToolSpec


class StreamReader(ABC):
    """Reads one streamed answer, putting its text on the token stream."""

    def __init__(self, stream: TokenStream) -> None:
        self._stream = stream
        self.started = False  # a token went out: a retry would repeat it

    def put(self, text: str) -> None:
        self.started = True
        self._stream.put(text)

    @abstractmethod
    async def read(self, client: Any, request: dict[str, Any]) -> ModelResponse: ...


class ProviderModel(ABC):
    """A model behind a provider package's async client."""

    provider: ClassVar[str]
    key_variable: ClassVar[str]

    def __init__(
        self,
        model: str,
        *,
        sdk: ModuleType,
        client: str,
        base_url: str | None,
        api_key: str | None,
        retry: RetryPolicy | None,
        timeout: float,
        options: dict[str, Any] | None,
    ) -> None:
        key = api_key or os.environ.get(self.key_variable) or ""
        if not key and base_url is None:
            raise missing_key(self.key_variable, self.provider)
        self.model = model
        self.base_url = base_url
        self._retry = retry or RetryPolicy()
        self._classify = classifier(sdk)
        self._options = dict(options or {})
        # max_retries=0: the package counts tries; retries here go by time.
        self._client: Any = getattr(sdk, client)(
            api_key=key or "unused", base_url=base_url, timeout=timeout, max_retries=0
        )

    @property
    def name(self) -> str:
        """``provider:model``."""
        return f"{self.provider}:{self.model}"

    def __repr__(self) -> str:  # never the key
        where = f" at {self.base_url}" if self.base_url else ""
        return f"<{type(self).__name__} {self.model}{where}>"

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def generate(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        stream: TokenStream | None = None,
    ) -> ModelResponse:
        """One response to ``messages``, its text put on ``stream`` when given.

        Raises:
            ModelError: the request failed after its retries.
            ModelRejected: the server refused the request.
        """
        request = {**self._options, **self._request(messages, tools)}
        if stream is None:
            return await retrying(
                lambda: self._complete(request),
                provider=self.provider,
                policy=self._retry,
                classify=self._classify,
            )
        reader = self._reader(stream)
        return await retrying(
            lambda: reader.read(self._client, request),
            provider=self.provider,
            policy=self._retry,
            classify=self._classify,
            streamed=lambda: reader.started,
        )

    @abstractmethod
    def _request(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> dict[str, Any]:
        """The request body, in the provider's format."""

    @abstractmethod
    async def _complete(self, request: dict[str, Any]) -> ModelResponse:
        """Send ``request`` unstreamed and convert the answer."""

    @abstractmethod
    def _reader(self, stream: TokenStream) -> StreamReader: ...


def missing_key(variable: str, provider: str) -> InvalidArgument:
    return InvalidArgument(
        f"{variable} is not set: the {provider} model needs a key (pass api_key=, or set "
        f"{variable}; a server at a base URL may need none)",
        field=variable,
    )
