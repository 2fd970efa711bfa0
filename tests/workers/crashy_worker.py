"""A worker process for crash tests: counts iterations through a loop and, at
iteration CRASH_AT, writes MARKER and hangs until it is killed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dagnats.sdk import TaskContext, Worker


async def main(target: str, task: str, crash_at: int, marker: Path) -> None:
    async def handler(tc: TaskContext) -> None:
        if tc.iteration == crash_at:
            marker.write_text(f"{tc.iteration} {tc.attempt}")
            await asyncio.Event().wait()
        if tc.iteration >= 4:
            await tc.complete({"iterations": tc.iteration})
        else:
            await tc.continue_({"iteration": tc.iteration})

    async with Worker(target, handlers={task: handler}, poll_wait=1.0):
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])))
