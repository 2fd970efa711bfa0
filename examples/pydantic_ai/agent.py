"""A pydantic-ai agent made durable: the agent is plain pydantic-ai, and
:func:`handler` is all dagnats adds.

``lookup`` is declared safe (a read: running it twice is harmless);
``send_email`` is not, so it is never started twice, and it passes its call's
idempotency key to the mail provider.
"""

from __future__ import annotations

from typing import Any

from pydantic_ai import Agent
from pydantic_ai.models import Model

from dagnats.integrations.pydantic_ai import DurableAgent, current_tool_run, durable_agent, safe

SENT: list[dict[str, str]] = []  # stands in for the mail provider


def make_agent(model: Model | str) -> Agent[None, str]:
    """The weather agent on ``model`` (a pydantic-ai model or model name)."""
    agent = Agent(model, instructions="Answer weather questions, and tell ops what you found.")

    @agent.tool_plain(metadata=safe())
    async def lookup(city: str) -> dict[str, Any]:
        """Look up the current weather of a city."""
        return {"city": city, "celsius": 21, "sky": "clear"}

    @agent.tool_plain
    async def send_email(to: str, body: str) -> str:
        """Send an email."""
        key = current_tool_run().call.key  # the same on every attempt of this call
        SENT.append({"to": to, "body": body, "idempotency_key": key})
        return f"sent to {to}"

    return agent


def handler(
    model: Model | str, *, stream: bool = True, follow_up_window: float | None = 3600.0
) -> DurableAgent:
    """The step's handler: one round of the agent per iteration, its text
    streamed to the step's readers; after its answer, the step waits (holding
    no worker) for a follow-up."""
    return durable_agent(make_agent(model), stream=stream, follow_up_window=follow_up_window)
