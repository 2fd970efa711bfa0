"""A worker process whose agent calls a tool that needs approval, for the
approval crash tests.

usage: approval_worker.py TARGET TASK STATE [SEAM[:PASS]]

The agent (``tests.test_approvals.approval_agent``) asks for ``send_email``,
which needs approval; the tool logs each start to STATE/runs, outside the
journal. With SEAM the process stops at the PASS-th pass of that seam (the
first by default), after writing STATE/hit, for the test to kill it
(SIGKILL), or freeze it (SIGSTOP) and thaw it later (SIGCONT): it then goes
on from the seam as a zombie. Each turn's end is logged to STATE/turns as
``returned`` or the name of what it raised. It writes STATE/ready
once it polls.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from dagnats.core import seam
from dagnats.sdk import TaskContext, Worker
from tests.test_approvals import approval_agent


class Runs(list[Any]):
    """The tool's starts, appended to STATE/runs as they happen."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def append(self, item: Any) -> None:
        with open(self.path, "a") as f:
            f.write(f"{item}\n")
        super().append(item)


async def main(target: str, task: str, state: Path, stop_at: str) -> None:
    name_at, _, nth = stop_at.partition(":")
    passes = {"left": int(nth or 1)}

    thawed = asyncio.Event()

    async def hook(name: str) -> None:
        if name != name_at:
            return
        passes["left"] -= 1
        if passes["left"] == 0:
            asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, thawed.set)
            (state / "hit").write_text(name)
            await thawed.wait()  # killed here, or frozen and thawed

    if stop_at:
        seam.install(hook)
    agent = approval_agent(Runs(state / "runs"))

    async def handler(tc: TaskContext) -> None:
        try:
            await agent(tc)
        except BaseException as err:
            with open(state / "turns", "a") as f:
                f.write(f"{type(err).__name__}\n")
            raise
        with open(state / "turns", "a") as f:
            f.write("returned\n")

    async with Worker(target, handlers={task: handler}, poll_wait=0.5, concurrency=1):
        (state / "ready").write_text("1")
        await asyncio.Event().wait()


if __name__ == "__main__":
    target, task, state, *rest = sys.argv[1:]
    asyncio.run(main(target, task, Path(state), rest[0] if rest else ""))
