"""A pydantic-ai agent made durable: plain pydantic-ai, plus durable_agent().

    python docs/examples/pydantic_agent.py                                  # a stand-in model
    DAGNATS_MODEL=openai:gpt-4.1-mini python docs/examples/pydantic_agent.py  # a real one

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dagnats.integrations.pydantic_ai import current_tool_run, durable_agent, model_from_env, safe
from dagnats.sdk import Client, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
SENT: list[str] = []  # stands in for a mail provider


# --8<-- [start:agent]
def make_agent(model: Any) -> Agent[None, str]:
    agent = Agent(model, instructions="Answer weather questions, and tell ops what you found.")

    @agent.tool_plain(metadata=safe())  # a read: harmless to run twice
    async def lookup(city: str) -> dict[str, Any]:
        """Look up the current weather of a city."""
        return {"city": city, "celsius": 21, "sky": "clear"}

    @agent.tool_plain  # unsafe by default: never started twice
    async def send_email(to: str, body: str) -> str:
        """Send an email."""
        key = current_tool_run().call.key  # the same on every attempt: give it to the provider
        SENT.append(key)
        return f"sent to {to}"

    return agent


# --8<-- [end:agent]


# --8<-- [start:fake]
def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """What a model would say: look the weather up, mail ops, answer."""
    rounds = sum(isinstance(m, ModelResponse) for m in messages)
    if rounds == 0:
        return ModelResponse(parts=[ToolCallPart("lookup", {"city": "Lisbon"})])
    if rounds == 1:
        body = {"to": "ops@example.com", "body": "Lisbon: 21 C, clear"}
        return ModelResponse(parts=[ToolCallPart("send_email", body)])
    return ModelResponse(parts=[TextPart("It is 21 C and clear in Lisbon; ops has been told.")])


# --8<-- [end:fake]


# --8<-- [start:main]
WORKFLOW = {
    "name": "weather",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "weather"}],
}


async def main(engine: str = ENGINE) -> Any:
    # DAGNATS_MODEL names a real model (provider:model[@base-url]); else the stand-in.
    # --8<-- [start:worker]
    model = model_from_env() or FunctionModel(scripted)
    handler = durable_agent(make_agent(model), follow_up_window=None)  # end at the answer
    async with model, Client(engine) as client, Worker(engine, handlers={"weather": handler}):
        await client.register_workflow(WORKFLOW)
        answer = await client.run("weather", "How warm is it in Lisbon? Tell ops.", timeout=300)
        # --8<-- [end:worker]
        print(f"answer: {answer}")
        return answer


if __name__ == "__main__":
    asyncio.run(main())
# --8<-- [end:main]
