"""The scripted agent of the console's browser tests, in a process of its own.

usage: console_worker.py TARGET TASK STATE

Each run's input names its script (``{"script": ...}``); the handler is
journaled. Where a script stops at a gate it makes the FIFO STATE/<run>.<gate>
and waits until the test writes to it (:func:`tests.test_console.release`),
so the test decides when the agent goes on, and nothing polls.

- ``wait``: waits for an input (``continue_(until_input=True)``), then
  places the steer inputs and completes with their contents.
- ``delay``, ``until``: waits ten minutes (``continue_(delay=...)``, or
  ``until=`` ten minutes from now), then completes.
- ``inputs``: iteration 0 stops at ``queued``, places the steer inputs, stops
  at ``placed``, then completes with their contents.
- ``journal``: a streamed model call that stops at ``model`` before its
  first token (a preview reaches only readers already there) and at
  ``tokens`` halfway through its tokens; an unsafe tool ``send`` that writes
  partial output and stops at ``tool`` (the test kills the process there; a
  successor's replay answers the intent ``interrupted``); then a streamed
  model call that fails halfway (abandoned); then completes with the tool's
  result.
- ``group``: three tool calls at once (a parallel group: safe ``search``,
  unsafe ``send``, safe ``search``), the second stopping at ``send`` until
  released; then completes with their outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from dagnats.sdk import (
    InputMode,
    InputsQueued,
    Replay,
    TaskContext,
    TokenStream,
    ToolCall,
    ToolRun,
    Usage,
    WithUsage,
    Worker,
)

REPLY = "Sending the weekly report to the ops team now."
PARTIAL = "connecting to mail relay; sending to ops"
FAILING = "Drafting a follow-up for the"


class ModelDown(Exception):
    """The scripted model's failure: its stream is abandoned."""


def words(text: str) -> list[str]:
    """The tokens a scripted model puts for ``text``: word by word, spaces kept."""
    parts = text.split(" ")
    return [p + " " for p in parts[:-1]] + [parts[-1]]


async def gate(state: Path, tc: TaskContext, name: str) -> None:
    fifo = state / f"{tc.run_id}.{name}"
    os.mkfifo(fifo)
    await asyncio.to_thread(fifo.read_bytes)  # returns once the test wrote and closed it


def main(target: str, task: str, state: Path) -> None:
    async def wait_script(tc: TaskContext) -> None:
        await tc.journal()
        placed = await tc.place_inputs(InputMode.STEER)
        if not placed:
            try:
                await tc.continue_(until_input=True)
                return
            except InputsQueued:  # one came in since: place it now
                placed = await tc.place_inputs(InputMode.STEER)
        await tc.complete({"placed": [p.content for p in placed]})

    async def wait_script_timed(tc: TaskContext) -> None:
        await tc.journal()
        if tc.iteration > 0:
            await tc.complete()
        elif tc.input["script"] == "delay":
            await tc.continue_(delay=600)
        else:
            await tc.continue_(until=datetime.now(UTC) + timedelta(minutes=10))

    async def inputs_script(tc: TaskContext) -> None:
        await tc.journal()
        await gate(state, tc, "queued")
        placed = await tc.place_inputs(InputMode.STEER)
        await gate(state, tc, "placed")
        await tc.complete({"placed": [p.content for p in placed]})

    async def journal_script(tc: TaskContext) -> None:
        j = await tc.journal()

        async def model(stream: TokenStream) -> Any:
            tokens = words(REPLY)
            await gate(state, tc, "model")
            for n, token in enumerate(tokens):
                if n == len(tokens) // 2:
                    await gate(state, tc, "tokens")
                stream.put(token)
            return REPLY

        async def send(run: ToolRun) -> Any:
            await run.report(PARTIAL)
            await gate(state, tc, "tool")  # killed here
            return {"sent": True}

        async def failing(stream: TokenStream) -> Any:
            for token in words(FAILING):
                stream.put(token)
            raise ModelDown("the scripted model is down")

        await j.streamed_model(model)
        result = await j.tool(ToolCall(name="send", input={"to": "ops"}), Replay.UNSAFE, send)
        with contextlib.suppress(ModelDown):
            await j.streamed_model(failing)
        await tc.complete({"interrupted": result.interrupted, "partial": result.partial})

    async def group_script(tc: TaskContext) -> None:
        j = await tc.journal()

        async def search(run: ToolRun) -> Any:
            return {"found": run.call.input["q"]}

        async def send(run: ToolRun) -> Any:
            await run.report(PARTIAL)
            await gate(state, tc, "send")
            return {"sent": True}

        results = await j.tools(
            [
                (ToolCall(name="search", input={"q": "a"}), Replay.SAFE, search),
                (ToolCall(name="send", input={"to": "ops"}), Replay.UNSAFE, send),
                (ToolCall(name="search", input={"q": "b"}), Replay.SAFE, search),
            ]
        )
        await tc.complete([r.output for r in results])

    async def usage_script(tc: TaskContext) -> None:
        """Two model calls that report their usage, then a third that the
        run's budget (set by the test) refuses: the step fails."""
        j = await tc.journal()
        for n in range(3):

            async def call(n: int = n) -> WithUsage:
                return WithUsage({"n": n}, Usage(input_tokens=100, output_tokens=20, model="m1"))

            await j.model(call)
        await tc.complete("not reached")

    scripts = {
        "usage": usage_script,
        "wait": wait_script,
        "delay": wait_script_timed,
        "until": wait_script_timed,
        "inputs": inputs_script,
        "journal": journal_script,
        "group": group_script,
    }

    async def turn(tc: TaskContext) -> None:
        await scripts[tc.input["script"]](tc)

    async def serve() -> None:
        async with Worker(target, handlers={task: turn}, poll_wait=0.5, concurrency=8):
            (state / f"ready-{os.getpid()}").write_text("1")
            await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
