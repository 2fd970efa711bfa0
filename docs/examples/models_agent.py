"""A handler on the SDK's model adapters: the model DAGNATS_MODEL names
(provider:model[@base-url]), else a stand-in, behind one shape of messages.

    python docs/examples/models_agent.py
    DAGNATS_MODEL=openai:gpt-4.1-mini python docs/examples/models_agent.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import dagnats.sdk as sdk
import dagnats.sdk.models as sdk_models

# --8<-- [start:imports]
from dagnats.sdk import Replay, TaskContext, ToolCall
from dagnats.sdk.models import (
    ToolSpec,
    UserMessage,
    ask,
    messages_from_json,
    messages_to_json,
    model_from_env,
    tool_message,
)

# --8<-- [end:imports]

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")


class StandInModel:
    """A stand-in for a model: it looks the city up, then answers from it."""

    name = "stand-in:weather"

    async def generate(
        self,
        messages: Sequence[sdk_models.Message],
        *,
        tools: Sequence[ToolSpec] = (),
        stream: sdk.TokenStream | None = None,
    ) -> sdk_models.ModelResponse:
        found = [m for m in messages if isinstance(m, sdk_models.ToolMessage)]
        if not found:
            lookup = sdk_models.ToolUse(id="c1", name="lookup", arguments={"city": "Lisbon"})
            return sdk_models.ModelResponse(tool_calls=(lookup,))
        text = f"It is {found[-1].content} C in Lisbon."
        if stream is not None:
            stream.put(text)
        return sdk_models.ModelResponse(text=text)


# --8<-- [start:handler]
model = model_from_env() or StandInModel()  # or OpenAIModel("gpt-4.1-mini"), AnthropicModel(...)
LOOKUP = ToolSpec(
    name="lookup",
    description="A city's temperature",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)


async def turn(tc: TaskContext) -> None:
    j = await tc.journal()
    saved = await tc.load_checkpoint()
    history = messages_from_json(saved) if saved else [UserMessage(content=tc.input)]
    response = await ask(j, model, history, tools=[LOOKUP])  # journaled, streamed
    if not response.tool_calls:
        await tc.complete(response.text)
        return
    history.append(response.message())
    for use in response.tool_calls:
        call = ToolCall(name=use.name, input=use.arguments)
        result = await j.tool(call, Replay.SAFE, lookup)  # lookup(run): your tool
        history.append(tool_message(use, result))  # back in the provider's format
    await tc.checkpoint(messages_to_json(history))
    await tc.continue_()


# --8<-- [end:handler]


async def lookup(run: sdk.ToolRun) -> Any:
    return 21 if run.call.input.get("city") == "Lisbon" else 15


WORKFLOW = {
    "name": "weather-models",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "weather-models"}],
}


async def main(engine: str = ENGINE) -> Any:
    async with sdk.Client(engine) as client, sdk.Worker(engine, handlers={"weather-models": turn}):
        await client.register_workflow(WORKFLOW)
        answer = await client.run("weather-models", "How warm is Lisbon?", timeout=300)
        print(f"answer: {answer}")
        return answer


if __name__ == "__main__":
    asyncio.run(main())
