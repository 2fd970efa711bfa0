"""A worker process for the chaos soak: many runs of the scripted agent at once.

usage: worker.py TARGET TASK STATE CONCURRENCY

TASK also names the conversation's task, TASK-conversation: a turn appends one
message to the step's state (the state chain) and continues, until the run's
input ``turns`` are done. STATE/conversation.holder names the process that
ran its last turn, so the soak can aim a fault at it.

Each turn claims the journal, places the step's queued inputs, and runs a
turn of the scripted agent (``tests/workers/agent.py``): a safe search, an
unsafe send, a safe search, then the answer. Tools take a few milliseconds, so a fault can land
inside one. Every tool start and effect is appended to STATE/<run_id>.tools,
outside the journal, for the soak's after-run checks; STATE/ready-<pid> says
the process polls. The soak kills and freezes this process; nothing here
knows about faults.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path
from typing import Any

from dagnats.sdk import InputMode, TaskContext, TokenStream, ToolRun, Worker
from tests.workers import agent

TURN_BYTES = 200  # what a turn of the conversation appends


def conversation_task(task: str) -> str:
    return f"{task}-conversation"


def conversation_message(turn: int, iteration: int) -> str:
    """The message the conversation's turn ``turn`` appends in ``iteration``."""
    return f"{turn:06d}/{iteration:06d} ".ljust(TURN_BYTES, "m")


def main(target: str, task: str, state: Path, concurrency: int) -> None:
    def log(run_id: str, line: str) -> None:
        with open(state / f"{run_id}.tools", "a") as f:
            f.write(line + "\n")

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()
        history = await tc.load_checkpoint() or [tc.input]
        for placed in await j.place_inputs(InputMode.STEER):
            history = [*history, {"input": placed.request_id}]

        async def tool(run: ToolRun) -> Any:
            log(tc.run_id, f"start {run.call.name} {tc.iteration}")
            await asyncio.sleep(random.uniform(0, 0.02))  # the tool's own work
            log(tc.run_id, f"effect {run.call.name} {tc.iteration}")
            return {"tool": run.call.name, "ok": True}

        await agent.turn(tc, j, history, model=model, tool=tool)

    async def converse(tc: TaskContext) -> None:
        (state / "conversation.holder").write_text(str(os.getpid()))
        await tc.journal()
        held = await tc.load_checkpoint()
        n = len(held["messages"]) if held is not None else 0
        # Its turn and the iteration it ran in: a turn lost or written twice
        # shows in the final state.
        message = conversation_message(n, tc.iteration)
        await tc.append_state("messages", [message], turns=n + 1)
        if n + 1 >= tc.input["turns"]:
            await tc.complete({"turns": n + 1})
        else:
            await tc.continue_()

    async def model(history: list[Any], _stream: TokenStream | None) -> Any:
        await asyncio.sleep(random.uniform(0, 0.01))  # the model's own latency
        return agent.reply_for(history)

    async def serve() -> None:
        async with Worker(
            target,
            handlers={task: turn, conversation_task(task): converse},
            poll_wait=0.5,
            concurrency=concurrency,
        ):
            (state / f"ready-{os.getpid()}").write_text("1")
            await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
