"""``DAGNATS_MODEL``: which model a worker uses, named in one variable.

The syntax is ``provider:model`` or ``provider:model@base-url``:

- ``openai:gpt-4.1-mini``: OpenAI, key in ``OPENAI_API_KEY``;
- ``anthropic:claude-sonnet-4-5``: Anthropic, key in ``ANTHROPIC_API_KEY``;
- ``openai:llama3.1:8b@http://localhost:11434/v1``: any OpenAI-compatible
  server (Ollama, vLLM, LM Studio) at that URL; the key is optional there.

The provider ends at the first ``:``, the model at the first ``@`` (so a model
name may hold ``:`` and ``/``, not ``@``). Keys never go in the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dagnats.core.errors import InvalidArgument
from dagnats.sdk.models._ask import ChatModel
from dagnats.sdk.models._base import missing_key

VARIABLE = "DAGNATS_MODEL"
PROVIDERS = ("openai", "anthropic")
KEYS = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
SYNTAX = (
    "want provider:model or provider:model@base-url with provider openai or anthropic, "
    "e.g. openai:gpt-4.1-mini or openai:llama3@http://localhost:11434/v1"
)
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]*")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A parsed ``DAGNATS_MODEL``."""

    provider: str
    model: str
    base_url: str | None = None

    def __str__(self) -> str:
        at = f"@{self.base_url}" if self.base_url else ""
        return f"{self.provider}:{self.model}{at}"


def parse_model(text: str, *, name: str = VARIABLE) -> ModelSpec:
    """Parse ``provider:model[@base-url]``.

    Raises:
        InvalidArgument: ``text`` is not that; the message says what is wrong
            and shows the syntax, ``field`` is ``name``.
    """

    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(f"{name}={text!r}: {why}; {SYNTAX}", field=name)

    if text != text.strip() or any(c.isspace() for c in text):
        raise bad("it holds white space")
    provider, colon, rest = text.partition(":")
    if not colon:
        raise bad("no provider")
    if provider not in PROVIDERS:
        raise bad(f"unknown provider {provider!r}")
    model, at, url = rest.partition("@")
    if not model:
        raise bad("no model name")
    if not _MODEL.fullmatch(model):
        raise bad(f"{model!r} is not a model name")
    if not at:
        return ModelSpec(provider=provider, model=model)
    return ModelSpec(provider=provider, model=model, base_url=_base_url(url, bad))


def _base_url(url: str, bad: Any) -> str:
    if not url:
        raise bad("nothing after @")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as err:
        raise bad(f"the base URL {url!r} is not a URL ({err})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad(f"the base URL {url!r} is not an http(s) URL with a host")
    if "@" in parts.netloc:
        raise bad("the base URL holds credentials: put the key in its variable instead")
    if parts.query or parts.fragment:
        raise bad(f"the base URL {url!r} has a query or a fragment")
    return url


def spec_from_env(env: Mapping[str, str] | None = None) -> tuple[ModelSpec, str | None] | None:
    """What ``DAGNATS_MODEL`` names and its provider's key (None with a base URL
    and no key set); None when the variable is not set (or empty).

    Raises:
        InvalidArgument: ``DAGNATS_MODEL`` is malformed, or its provider's key
            is not set for the provider's own server.
    """
    env = os.environ if env is None else env
    text = env.get(VARIABLE, "")
    if not text:
        return None
    spec = parse_model(text)
    key = env.get(KEYS[spec.provider]) or None
    if key is None and spec.base_url is None:
        raise missing_key(KEYS[spec.provider], spec.provider)
    return spec, key


def model_from_env(env: Mapping[str, str] | None = None, **options: Any) -> ChatModel | None:
    """The model ``DAGNATS_MODEL`` names, with its key from the environment;
    None when the variable is not set (or empty).

    Args:
        env: Where to read the variables; ``os.environ`` by default.
        options: Passed to the model (``retry``, ``timeout``, ``max_tokens``, ...).

    Raises:
        InvalidArgument: ``DAGNATS_MODEL`` is malformed, or its provider's key
            is not set for the provider's own server.
        ModuleNotFoundError: the provider's package is not installed (the
            message names the extra that installs it).
    """
    found = spec_from_env(env)
    if found is None:
        return None
    spec, key = found
    if spec.provider == "openai":
        from dagnats.sdk.models._openai import OpenAIModel

        return OpenAIModel(spec.model, base_url=spec.base_url, api_key=key, **options)
    from dagnats.sdk.models._anthropic import AnthropicModel

    return AnthropicModel(spec.model, base_url=spec.base_url, api_key=key, **options)
