"""The demo agent that ``dagnats dev`` runs: a journaled agent loop whose
model is a stand-in, so it runs anywhere with no model provider.

The stand-in model answers from the conversation it is shown (how many tool
results it holds), not from a counter, so the one worker of ``dagnats dev``
serves any number of runs, retries and redeliveries alike.
"""

from __future__ import annotations

import copy
from typing import Any

from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun

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

# The stand-in model's replies, by the number of tool results so far.
SCRIPT: list[dict[str, Any]] = [
    {"tool": "lookup", "input": {"city": "Lisbon"}},
    {"tool": "convert", "input": {"celsius": 21}},
    {"answer": "It is 21 °C (69.8 °F) in Lisbon right now."},
]

TOOLS = {
    "lookup": lambda args: {"city": args["city"], "celsius": 21},
    "convert": lambda args: {"fahrenheit": round(args["celsius"] * 9 / 5 + 32, 1)},
}


async def demo_model(history: list[Any]) -> dict[str, Any]:
    """The stand-in model's reply to ``history``: the next line of the script
    after the tool results the conversation already holds."""
    done = sum(1 for message in history if message.get("role") == "tool")
    return copy.deepcopy(SCRIPT[min(done, len(SCRIPT) - 1)])


async def _run_tool(run: ToolRun) -> Any:
    return TOOLS[run.call.name](run.call.input)


async def agent_turn(tc: TaskContext) -> None:
    """One turn per iteration: ask the model, run the tool it picks, repeat.
    Both go through the journal, so ``dagnats journal read`` shows them."""
    j = await tc.journal()
    history = await tc.load_checkpoint() or [{"role": "user", "content": tc.input}]
    reply = await j.model(lambda: demo_model(history))
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    call = ToolCall(name=reply["tool"], input=reply["input"])
    result = await j.tool(call, Replay.SAFE, _run_tool)
    history += [
        {"role": "assistant", "content": reply},
        {"role": "tool", "content": result.output},
    ]
    await tc.checkpoint(history)
    await tc.continue_({"tool": call.name, "result": result.output})
