"""A worker process for the chaos soak: many runs of the scripted agent at once.

usage: worker.py TARGET TASK STATE CONCURRENCY

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

    async def model(history: list[Any], _stream: TokenStream | None) -> Any:
        await asyncio.sleep(random.uniform(0, 0.01))  # the model's own latency
        return agent.reply_for(history)

    async def serve() -> None:
        async with Worker(target, handlers={task: turn}, poll_wait=0.5, concurrency=concurrency):
            (state / f"ready-{os.getpid()}").write_text("1")
            await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
