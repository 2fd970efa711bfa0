"""A worker process for the crash-point matrix.

It runs a scripted agent (a safe tool, an unsafe tool, a safe tool, an
answer) whose model is a pure function of the conversation, so any process
answers the same. Tools count their starts and effects in files in STATE, outside
the journal. With CRASH="seam:iteration" the process stops at that seam of
that iteration, after writing STATE/hit: the test kills it there (SIGKILL), or
freezes it (SIGSTOP) and later thaws it (SIGCONT), and the holder goes on
from the seam as a zombie.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dagnats.core import seam
from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun, Worker

SCRIPT: list[dict[str, Any]] = [
    {"tool": "search", "input": {"q": "weather"}},
    {"tool": "send", "input": {"to": "ops"}},
    {"tool": "search", "input": {"q": "confirm"}},
    {"answer": "done"},
]
ANSWER = "done"


def log(state: Path, name: str, line: str) -> None:
    with open(state / name, "a") as f:
        f.write(line + "\n")


def main(target: str, task: str, state: Path, crash: str) -> None:
    current = {"iteration": -1}
    seam_name, _, at = crash.partition(":")
    fired = False

    thawed = asyncio.Event()

    async def hook(name: str) -> None:
        nonlocal fired
        if fired or name != seam_name or current["iteration"] != int(at or -1):
            return
        fired = True
        asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, thawed.set)
        (state / "hit").write_text(name)
        await thawed.wait()  # killed here, or frozen and thawed

    if seam_name:
        seam.install(hook)

    async def tool(run: ToolRun) -> Any:
        log(state, "starts", f"{run.call.name} {current['iteration']}")
        await seam.seam("inside_tool")
        log(state, "effects", f"{run.call.name} {current['iteration']}")
        return {"tool": run.call.name, "ok": True}

    async def model(history: list[Any]) -> Any:
        log(state, "model", str(current["iteration"]))
        turns = sum(1 for m in history if isinstance(m, dict) and "reply" in m)
        return SCRIPT[turns]

    async def turn(tc: TaskContext) -> None:
        current["iteration"] = tc.iteration
        try:
            j = await tc.journal()
            history = await tc.load_checkpoint() or [tc.input]
            reply = await j.model(lambda: model(history))
            if "answer" in reply:
                await tc.complete(reply["answer"])
                return
            replay = Replay.SAFE if reply["tool"] == "search" else Replay.UNSAFE
            result = await j.tool(ToolCall(name=reply["tool"], input=reply["input"]), replay, tool)
            entry = {"reply": reply, "output": result.output, "interrupted": result.interrupted}
            await tc.checkpoint([*history, entry])
            await tc.continue_()
        except BaseException as signal:
            log(state, "turns", f"{os.getpid()} {tc.iteration} {type(signal).__name__}")
            raise
        log(state, "turns", f"{os.getpid()} {tc.iteration} returned")

    async def serve() -> None:
        async with Worker(target, handlers={task: turn}, poll_wait=0.5, concurrency=1):
            (state / f"ready-{crash or 'clean'}").write_text("1")
            await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
