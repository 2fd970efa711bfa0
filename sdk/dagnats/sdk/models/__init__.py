"""Model adapters: one neutral shape of messages, tools and responses, and an
adapter per provider that converts at its edge.

``OpenAIModel`` speaks chat completions (OpenAI, and any compatible server by
``base_url``: vLLM, Ollama, LM Studio); ``AnthropicModel`` speaks Anthropic's
messages API. ``ask(j, model, messages, tools=...)`` makes a journaled,
streamed model call whose record is the :class:`ModelResponse`;
``model_from_env()`` builds the model ``DAGNATS_MODEL`` names. The provider
packages are optional extras (``dagnats[openai]``, ``dagnats[anthropic]``),
imported only when an adapter is built.
"""

from dagnats.sdk.models._anthropic import AnthropicModel
from dagnats.sdk.models._ask import ChatModel, ask
from dagnats.sdk.models._env import ModelSpec, model_from_env, parse_model, spec_from_env
from dagnats.sdk.models._openai import OpenAIModel
from dagnats.sdk.models._retry import ModelError, ModelRejected, RetryPolicy, retry_after
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
    message_from_json,
    message_to_json,
    messages_from_json,
    messages_to_json,
    tool_message,
)

__all__ = [
    "AnthropicModel",
    "AssistantMessage",
    "ChatModel",
    "Message",
    "ModelError",
    "ModelRejected",
    "ModelResponse",
    "ModelSpec",
    "OpenAIModel",
    "RetryPolicy",
    "StopReason",
    "SystemMessage",
    "ToolMessage",
    "ToolSpec",
    "ToolUse",
    "Usage",
    "UserMessage",
    "ask",
    "message_from_json",
    "message_to_json",
    "messages_from_json",
    "messages_to_json",
    "model_from_env",
    "parse_model",
    "retry_after",
    "spec_from_env",
    "tool_message",
]
