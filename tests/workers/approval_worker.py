"""A worker process whose agent calls a tool that needs approval, for the
approval crash tests.

usage: approval_worker.py TARGET TASK STATE [SEAM[:PASS]] [--group] [--standby]
       [--journal TARGET] [--inputs TARGET]

The agent (``tests.test_approvals.approval_agent``) asks for ``send_email``,
which needs approval; with ``--group`` it is ``group_agent``, whose model asks
for three tools at once, the third needing approval. Each tool logs its start
to STATE/runs, outside the journal (``send_email``'s input, or a group's
``(name, input)``). With SEAM the process stops at the PASS-th pass of that
seam (the first by default), after writing STATE/hit, for the test to kill it
(SIGKILL), or freeze it (SIGSTOP) and thaw it later (SIGCONT): it then goes
on from the seam as a zombie. Each turn's end is logged to STATE/turns as
``returned`` or the name of what it raised. It writes STATE/ready once it
polls; with ``--standby`` it first writes STATE/standby-clean and polls only
once SIGUSR2 came (``tests.matrix.activate``). ``--journal`` and ``--inputs``
dial those services apart from the engine (the split topology).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

from dagnats.core import seam
from dagnats.sdk import TaskContext, Worker
from tests.approval_agents import MATRIX_SAFE, approval_agent, group_agent


class Runs(list[Any]):
    """The tool's starts, appended to STATE/runs as they happen."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def append(self, item: Any) -> None:
        with open(self.path, "a") as f:
            f.write(f"{item}\n")
        super().append(item)


async def main(args: argparse.Namespace) -> None:
    state: Path = args.state
    name_at, _, nth = args.seam.partition(":")
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

    if args.seam:
        seam.install(hook)
    runs = Runs(state / "runs")
    agent = group_agent(runs, safe=MATRIX_SAFE) if args.group else approval_agent(runs)

    async def handler(tc: TaskContext) -> None:
        try:
            await agent(tc)
        except BaseException as err:
            with open(state / "turns", "a") as f:
                f.write(f"{type(err).__name__}\n")
            raise
        with open(state / "turns", "a") as f:
            f.write("returned\n")

    if args.standby:
        go = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, go.set)
        (state / "standby-clean").write_text("1")
        await go.wait()
    async with Worker(
        args.target,
        handlers={args.task: handler},
        poll_wait=0.5,
        concurrency=1,
        journal_target=args.journal,
        inputs_target=args.inputs,
    ):
        (state / "ready").write_text("1")
        await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("task")
    parser.add_argument("state", type=Path)
    parser.add_argument("seam", nargs="?", default="")
    parser.add_argument("--group", action="store_true")
    parser.add_argument("--standby", action="store_true")
    parser.add_argument("--journal", default=None)
    parser.add_argument("--inputs", default=None)
    asyncio.run(main(parser.parse_args()))
