"""Your first durable agent: a journaled handler, a run, and a crash you cause.

    python docs/examples/first_agent.py                 # run it once
    python docs/examples/first_agent.py --crash         # die inside the tool
    python docs/examples/first_agent.py --resume RUN_ID # a new worker finishes it

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker, run_output

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
CRASH = "--crash" in sys.argv
OUTBOX = Path("outbox.txt")  # where send_email "sends" (the current directory)


# --8<-- [start:model]
async def call_model(history: list[Any]) -> dict[str, Any]:
    """A stand-in for a model: search, then mail ops, then answer."""
    turn = sum(1 for m in history if m.get("role") == "assistant") + 1
    print(f"asking the model (turn {turn})")
    if turn == 1:
        return {"tool": "search", "input": {"q": "weather in Lisbon"}}
    if turn == 2:
        return {"tool": "send_email", "input": {"to": "ops", "body": "Lisbon: 21 C"}}
    return {"answer": "It is 21 C in Lisbon; ops has been told."}


# --8<-- [end:model]


# --8<-- [start:tools]
async def run_tool(run: ToolRun) -> Any:
    if run.call.name == "search":
        return {"celsius": 21}
    with OUTBOX.open("a") as outbox:  # the side effect: an email "sent"
        outbox.write(f"{run.call.key} {run.call.input}\n")
    if CRASH:
        print("crashing inside send_email, after the email went out")
        os._exit(3)  # the process dies: no report, no heartbeat
    return "sent"


# --8<-- [end:tools]


# --8<-- [start:handler]
async def turn(tc: TaskContext) -> None:
    j = await tc.journal()  # claims the step; fences any earlier holder
    history = await tc.load_checkpoint() or [{"role": "user", "content": tc.input}]
    reply = await j.model(lambda: call_model(history))  # stored; reused after a crash
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    replay = Replay.SAFE if reply["tool"] == "search" else Replay.UNSAFE
    result = await j.tool(ToolCall(name=reply["tool"], input=reply["input"]), replay, run_tool)
    history += [
        {"role": "assistant", **reply},
        {"role": "tool", "output": result.output, "interrupted": result.interrupted},
    ]
    await tc.checkpoint(history)
    await tc.continue_()  # commits the iteration; the engine dispatches the next


# --8<-- [end:handler]

# --8<-- [start:workflow]
WORKFLOW = {
    "name": "first-agent",
    "steps": [
        {
            "id": "agent",
            "type": "agent_loop",
            "task": "first-agent",
            "agent_loop": {"max_iterations": 10},
        }
    ],
}
# --8<-- [end:workflow]


# --8<-- [start:main]
async def main() -> None:
    async with Client(ENGINE) as client:
        await client.register_workflow(WORKFLOW)
        async with Worker(ENGINE, handlers={"first-agent": turn}):
            if sys.argv[1:2] == ["--resume"]:
                run_id = sys.argv[2]
            else:
                run_id = (await client.start_run("first-agent", "How warm is Lisbon?")).run_id
                print(f"run {run_id}")
            done = await client.wait_for_run(run_id, timeout=120)
            print(f"answer: {run_output(done)}" if done.output else f"ended: {done.error}")


if __name__ == "__main__":
    asyncio.run(main())
# --8<-- [end:main]
