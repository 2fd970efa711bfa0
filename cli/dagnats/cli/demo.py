"""The demo agent that ``dagnats dev`` runs: a journaled agent loop over the
model ``DAGNATS_MODEL`` names, or over a stand-in model when it names none,
so the demo runs anywhere with no model provider.

Either way the model call streams (``dagnats run watch RUN --stream`` shows
its tokens), and the record is the neutral response of
``dagnats.sdk.models``. The stand-in answers from the conversation it is
shown (how many tool results it holds), not from a counter, so the one worker
of ``dagnats dev`` serves any number of runs, retries and redeliveries alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dagnats.sdk import Handler, Replay, TaskContext, TokenStream, ToolCall, ToolRun
from dagnats.sdk.models import (
    ChatModel,
    Message,
    ModelResponse,
    StopReason,
    SystemMessage,
    ToolMessage,
    ToolSpec,
    ToolUse,
    UserMessage,
    ask,
    messages_from_json,
    messages_to_json,
    model_from_env,
    tool_message,
)

NAME = "demo-agent"
STEP_ID = "agent"
TASK_TYPE = "demo-agent"
WORKFLOW: dict[str, Any] = {
    "name": NAME,
    "version": "1",
    "steps": [
        {
            "id": STEP_ID,
            "type": "agent_loop",
            "task": TASK_TYPE,
            "agent_loop": {"max_iterations": 10, "max_duration": "5m"},
            "retry": {"max_attempts": 3, "backoff": "exponential", "initial_delay": "1s"},
        }
    ],
}

SYSTEM = (
    "You answer questions about the weather in one sentence. Use the lookup tool for a "
    "city's temperature in °C and the convert tool for °F; give both."
)

TOOL_SPECS = (
    ToolSpec(
        name="lookup",
        description="The current temperature in a city, in degrees Celsius.",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    ),
    ToolSpec(
        name="convert",
        description="Degrees Celsius in degrees Fahrenheit.",
        parameters={
            "type": "object",
            "properties": {"celsius": {"type": "number"}},
            "required": ["celsius"],
        },
    ),
)

TOOLS = {
    "lookup": lambda args: {"city": args["city"], "celsius": 21},
    "convert": lambda args: {"fahrenheit": round(args["celsius"] * 9 / 5 + 32, 1)},
}

# The stand-in model's moves, by the number of tool results so far.
SCRIPT: list[dict[str, Any]] = [
    {"tool": "lookup", "input": {"city": "Lisbon"}},
    {"tool": "convert", "input": {"celsius": 21}},
    {"answer": "It is 21 °C (69.8 °F) in Lisbon right now."},
]


class StandIn:
    """The stand-in model: the next line of the script after the tool
    results the conversation already holds, its answer streamed word by word."""

    name = "stand-in"

    async def generate(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        stream: TokenStream | None = None,
    ) -> ModelResponse:
        done = sum(1 for m in messages if isinstance(m, ToolMessage))
        move = SCRIPT[min(done, len(SCRIPT) - 1)]
        if "tool" in move:
            call = ToolUse(id=f"call_{done}", name=move["tool"], arguments=move["input"])
            return ModelResponse(
                tool_calls=(call,), stop_reason=StopReason.TOOL_CALLS, model=self.name
            )
        words = move["answer"].split(" ")
        if stream is not None:
            for n, word in enumerate(words):
                stream.put(word if n == len(words) - 1 else word + " ")
        return ModelResponse(text=move["answer"], model=self.name)


def demo_model() -> ChatModel:
    """The model ``DAGNATS_MODEL`` names (key from the environment), else the stand-in.

    Raises:
        InvalidArgument: ``DAGNATS_MODEL`` is malformed or its key is not set.
        ModuleNotFoundError: its provider's package is not installed.
    """
    return model_from_env() or StandIn()


def opening(input: Any) -> list[Message]:
    """The conversation a run starts with: its ``question``, or its whole input."""
    match input:
        case {"question": str(question)}:
            text = question
        case str(text):
            pass
        case _:
            text = json.dumps(input, ensure_ascii=False)
    return [SystemMessage(content=SYSTEM), UserMessage(content=text)]


async def _run_tool(run: ToolRun) -> Any:
    return TOOLS[run.call.name](run.call.input)


def make_agent_turn(model: ChatModel) -> Handler:
    """The demo's handler over ``model``."""

    async def agent_turn(tc: TaskContext) -> None:
        """One turn per iteration: ask the model (streamed), run the tools it
        picks, repeat. Both go through the journal, so ``dagnats journal
        read`` shows them."""
        j = await tc.journal()
        saved = await tc.load_checkpoint()
        history = messages_from_json(saved) if saved else opening(tc.input)
        response = await ask(j, model, history, tools=TOOL_SPECS)
        if not response.tool_calls:
            await tc.complete(response.text)
            return
        history.append(response.message())
        progress: dict[str, Any] = {}
        for use in response.tool_calls:
            call = ToolCall(name=use.name, input=use.arguments)
            result = await j.tool(call, Replay.SAFE, _run_tool)
            history.append(tool_message(use, result))
            progress = {"tool": use.name, "result": result.output, "error": result.error}
        await tc.checkpoint(messages_to_json(history))
        await tc.continue_(progress)

    return agent_turn


agent_turn = make_agent_turn(StandIn())
"""The demo's handler over the stand-in model."""
