"""A worker for the SDK installed alone (``tests/test_thin_sdk.py``): serves a
journaled agent turn for TASK against the engine at TARGET until stdin closes.
It imports nothing but the SDK, so it runs in a venv with only the base install."""

from __future__ import annotations

import asyncio
import sys

import dagnats.sdk
from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun, Worker


async def turn(tc: TaskContext) -> None:
    j = await tc.journal()
    reply = await j.model(lambda: _model(tc.input))
    result = await j.tool(ToolCall(name="shout", input=reply), Replay.SAFE, _shout)
    await tc.complete({"answer": result.output, "sdk": dagnats.sdk.__file__})


async def _model(question: str) -> dict[str, str]:
    return {"text": f"you asked: {question}"}


async def _shout(run: ToolRun) -> str:
    return str(run.call.input["text"]).upper()


async def main(target: str, task: str) -> None:
    async with Worker(target, handlers={task: turn}, poll_wait=1.0):
        print("serving", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
