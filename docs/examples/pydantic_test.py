"""A test of a durable pydantic-ai agent on a real local stack: pytest runs
it as it is (with pytest-asyncio), and so does tests/test_docs.py."""

from __future__ import annotations

# --8<-- [start:test]
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel

from dagnats.integrations.pydantic_ai import durable_agent
from dagnats.sdk.testing import LocalStack


async def test_the_agent_answers() -> None:
    agent = Agent(TestModel(custom_output_text="21 °C"))
    async with LocalStack() as stack:  # nats-server and the engine, on free ports
        answer = await stack.run(durable_agent(agent, follow_up_window=None), "Lisbon?")
    assert answer == "21 °C"


# --8<-- [end:test]
