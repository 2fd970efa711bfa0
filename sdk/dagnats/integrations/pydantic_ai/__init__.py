"""Durable pydantic-ai agents: an ``Agent`` run as a journaled agent loop.

``durable_agent(agent)`` returns a handler for a ``Worker``. Each iteration of
its ``agent_loop`` step is one round of the agent: one model request and the
tool calls it asks for. The model request goes through the journal (reused
after a crash, never asked again), each tool call through ``j.tool`` with its
``Replay`` declaration (``Replay.UNSAFE`` unless the tool is declared safe),
and the message history is the state each commit carries. Steering inputs
join the conversation at the next tool-round boundary, follow-ups after a
final answer, and the step waits for a follow-up holding no worker.

Needs the ``pydantic-ai`` extra: ``pip install 'dagnats[pydantic-ai]'``.
"""

try:
    import pydantic_ai as _pydantic_ai  # noqa: F401 - fail here, with the extra's name
except ImportError as err:  # pragma: no cover - the dev extra installs it
    raise ImportError(
        "dagnats.integrations.pydantic_ai needs pydantic-ai: "
        "pip install 'dagnats[pydantic-ai]' (pydantic-ai-slim)"
    ) from err

from dagnats.integrations.pydantic_ai._agent import DurableAgent, durable_agent
from dagnats.integrations.pydantic_ai._env import model_from_env
from dagnats.integrations.pydantic_ai._history import content_text, dump_messages, load_messages
from dagnats.integrations.pydantic_ai._journaled import REPLAY_METADATA_KEY, current_tool_run, safe

__all__ = [
    "REPLAY_METADATA_KEY",
    "DurableAgent",
    "content_text",
    "current_tool_run",
    "dump_messages",
    "durable_agent",
    "load_messages",
    "model_from_env",
    "safe",
]
