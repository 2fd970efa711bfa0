"""The pydantic-ai model ``DAGNATS_MODEL`` names, in the syntax the SDK's own
adapters read (``provider:model[@base-url]``), so one setting serves both."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic_ai.models import Model

from dagnats.sdk.models import spec_from_env


def model_from_env(env: Mapping[str, str] | None = None) -> Model | None:
    """pydantic-ai's OpenAI chat or Anthropic model for ``DAGNATS_MODEL``, with
    its key from the environment; None when the variable is not set.

    Raises:
        InvalidArgument: ``DAGNATS_MODEL`` is malformed, or its provider's key
            is not set for the provider's own server.
    """
    found = spec_from_env(env)
    if found is None:
        return None
    spec, key = found
    if spec.provider == "openai":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        # A compatible server without keys still wants the header filled.
        openai = OpenAIProvider(base_url=spec.base_url, api_key=key or "none")
        return OpenAIChatModel(spec.model, provider=openai)
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    anthropic = AnthropicProvider(base_url=spec.base_url, api_key=key or "none")
    return AnthropicModel(spec.model, provider=anthropic)
