"""A worker process for the state chain's crash tests: a conversation that
appends one message a turn (``tc.append_state``) for TURNS turns and, at turn
STOP_AT, after it appended and before it commits, writes MARKER and hangs
until it is killed (or frozen, and woken behind its successor). Each turn
checks that the state it loaded holds every earlier turn. With STOP_AT -1 it
never stops."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dagnats.sdk import TaskContext, Worker

TURN_BYTES = 2000


def message(n: int) -> str:
    return f"{n:06d}" + "m" * (TURN_BYTES - 6)


async def main(target: str, task: str, turns: int, stop_at: int, marker: Path) -> None:
    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        state = await tc.load_checkpoint()
        held = state["messages"] if state is not None else []
        if held != [message(n) for n in range(len(held))] or len(held) != tc.iteration:
            await tc.fail_permanent(
                f"turn {tc.iteration} loaded {len(held)} messages, not in order"
            )
            return
        await tc.append_state("messages", [message(tc.iteration)], turn=tc.iteration + 1)
        if tc.iteration == stop_at:
            marker.write_text(f"{tc.iteration} {tc.attempt}")
            await asyncio.Event().wait()
        if tc.iteration + 1 >= turns:
            await tc.complete({"turns": tc.iteration + 1})
        else:
            await tc.continue_()

    async with Worker(target, handlers={task: handler}, poll_wait=0.5):
        await asyncio.Event().wait()


if __name__ == "__main__":
    args = sys.argv
    asyncio.run(main(args[1], args[2], int(args[3]), int(args[4]), Path(args[5])))
