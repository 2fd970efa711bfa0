"""Parallel tool calls: a model response that asks for three lookups and a
message at once runs them together, durably, as one parallel group.

    python docs/examples/parallel_tools.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker, run_output

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
CITIES = ["Lisbon", "Porto", "Faro"]


async def model(history: list[Any]) -> dict[str, Any]:
    """A stand-in for a model: first it asks for every lookup and the message
    at once, then it answers from what they returned."""
    if len(history) == 1:
        calls = [{"tool": "weather", "input": {"city": c}} for c in CITIES]
        return {"tools": [*calls, {"tool": "notify", "input": {"to": "ops"}}]}
    found = history[-1]["outputs"][: len(CITIES)]
    return {"answer": ", ".join(f"{w['city']} {w['celsius']} °C" for w in found)}


async def weather(run: ToolRun) -> dict[str, Any]:
    await asyncio.sleep(0.2)  # a slow API: the three run at once
    return {"city": run.call.input["city"], "celsius": 20 + len(run.call.input["city"]) % 5}


async def notify(run: ToolRun) -> dict[str, Any]:
    # Unsafe, so never started twice; a real service would deduplicate on the key.
    return {"sent": True, "key": run.call.key}


TOOLS = {"weather": (Replay.SAFE, weather), "notify": (Replay.UNSAFE, notify)}


# --8<-- [start:handler]
async def agent(tc: TaskContext) -> None:
    j = await tc.journal()
    history = await tc.load_checkpoint() or [tc.input]
    reply = await j.model(lambda: model(history))
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    calls = [
        (ToolCall(name=c["tool"], input=c["input"]), *TOOLS[c["tool"]]) for c in reply["tools"]
    ]
    results = await j.tools(calls)  # at once; results in the response's order
    await tc.checkpoint([*history, reply, {"outputs": [r.output for r in results]}])
    await tc.continue_()


# --8<-- [end:handler]


WORKFLOW = {
    "name": "parallel-tools",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "parallel-tools"}],
}


async def main(engine: str = ENGINE) -> tuple[str, str]:
    """Run the agent once; its answer and the run's id."""
    async with (
        Client(engine) as client,
        Worker(engine, handlers={"parallel-tools": agent}),
    ):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("parallel-tools", "How warm is it?")
        done = await client.wait_for_run(run.run_id, timeout=60)
    return run_output(done), run.run_id


if __name__ == "__main__":
    answer, run_id = asyncio.run(main())
    print(answer)
    print(f"its journal, one parallel group: dagnats journal read {run_id} agent")
