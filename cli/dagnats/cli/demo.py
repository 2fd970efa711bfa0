"""The demo agent that ``dagnats dev`` runs: an agent loop whose model is
scripted, so it runs anywhere with no model provider."""

from __future__ import annotations

from typing import Any

from dagnats.sdk import TaskContext
from dagnats.sdk.testing import ScriptedModel

NAME = "demo-agent"
STEP_ID = "agent"
WORKFLOW: dict[str, Any] = {
    "name": NAME,
    "version": "1",
    "steps": [
        {
            "id": STEP_ID,
            "type": "agent_loop",
            "task": "demo-agent",
            "agent_loop": {"max_iterations": 10, "max_duration": "5m"},
            "retry": {"max_attempts": 3, "backoff": "exponential", "initial_delay": "1s"},
        }
    ],
}

TASK_TYPE = "demo-agent"

SCRIPT: list[dict[str, Any]] = [
    {"tool": "lookup", "input": {"city": "Lisbon"}},
    {"tool": "convert", "input": {"celsius": 21}},
    {"answer": "It is 21 °C (69.8 °F) in Lisbon right now."},
]

TOOLS = {
    "lookup": lambda args: {"city": args["city"], "celsius": 21},
    "convert": lambda args: {"fahrenheit": round(args["celsius"] * 9 / 5 + 32, 1)},
}


def scripted_model() -> ScriptedModel:
    return ScriptedModel(SCRIPT)


def agent_handler(model: ScriptedModel) -> Any:
    """One turn per iteration: ask the model, run the tool it picks, repeat."""

    async def turn(tc: TaskContext) -> None:
        history = await tc.load_checkpoint() or [{"role": "user", "content": tc.input}]
        reply = await model(history)
        if "answer" in reply:
            await tc.complete(reply["answer"])
            return
        result = TOOLS[reply["tool"]](reply["input"])
        history += [{"role": "assistant", "content": reply}, {"role": "tool", "content": result}]
        await tc.checkpoint(history)
        await tc.continue_({"tool": reply["tool"], "result": result})

    return turn
