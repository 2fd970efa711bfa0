"""A worker process for the crash-point matrix.

usage: matrix_worker.py TARGET TASK STATE [CRASH] [--gate N] [--inputs] [--name NAME]
                        [--standby] [--stream] [--apart] [--group KIND]
                        [--journal TARGET]

It runs the scripted agent of ``tests/workers/agent.py`` (a safe tool, an
unsafe tool, a safe tool, an answer). Tools count their starts and effects in files in STATE,
outside the journal; claims and placed inputs are logged there too. With
CRASH="seam:iteration" the process stops at that seam of that iteration,
after writing STATE/hit: the test kills it there (SIGKILL), or freezes it
(SIGSTOP) and later thaws it (SIGCONT), and the holder goes on from the seam
as a zombie.

``--gate N``: the first worker (of all sharing STATE) to start iteration N
writes its pid to STATE/gated and waits for SIGUSR1 before it claims, so the
test can arm a service's seam, or submit an input, at a known point of the
run. ``--inputs``: every turn places the step's queued inputs after its claim.
``--standby``: start, write STATE/standby-<name>, and poll only after SIGUSR2, so a
successor costs no start-up time when it is needed. ``--stream``: the model
streams its reply's JSON text (``j.streamed_model``), passing the seams
``before_tokens`` before its first token and ``inside_stream`` halfway through,
and logs each token it puts to STATE/tokens. ``--apart``: the agent
heartbeats after its model call and after its tool, so the response and the
result are stored in records of their own (``after_model``, ``after_result``)
rather than with its next call's. ``--group KIND``: the agent's first reply
asks for a parallel group of three calls (``agent.GROUPS``: safe, unsafe or
mixed), run with ``j.tools``; with CRASH, the calls finish in the response's
order, each once the one before it has its result stored, so a crash at the n-th
``after_group_result`` (CRASH="after_group_result@n:0") has the first n
results stored and no other; once the crash seam is hit no call returns.
``--journal TARGET``: the journal service's address (the split topology).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dagnats.core import seam
from dagnats.sdk import InputMode, TaskContext, TokenStream, ToolRun, Worker
from tests.workers import agent


def log(state: Path, name: str, line: str) -> None:
    with open(state / name, "a") as f:
        f.write(line + "\n")


def take(path: Path, content: str) -> bool:
    """Create ``path`` holding ``content`` unless it exists; atomic across processes."""
    partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    partial.write_text(content)
    try:
        os.link(partial, path)
    except FileExistsError:
        return False
    finally:
        partial.unlink()
    return True


def main(args: argparse.Namespace) -> None:
    # The SDK says at INFO why it stopped a handler that no successor fenced
    # (its run had ended); the matrix reads that from the worker's log.
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("dagnats.sdk").setLevel(logging.INFO)
    state: Path = args.state
    current = {"iteration": -1}
    seam_name, _, at = args.crash.partition(":")
    seam_name, _, nth = seam_name.partition("@")
    hits = {"n": 0}
    fired = False
    thawed = asyncio.Event()
    released = asyncio.Event()
    stored = asyncio.Condition()  # results of the group stored in this process
    results = {"n": 0}

    async def hook(name: str) -> None:
        nonlocal fired
        if name == "after_group_result":
            async with stored:
                results["n"] += 1
                stored.notify_all()
        if fired or name != seam_name or current["iteration"] != int(at or -1):
            return
        hits["n"] += 1
        if hits["n"] < int(nth or 1):
            return
        fired = True
        asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, thawed.set)
        async with stored:
            stored.notify_all()  # the group's other calls stop where they are
        (state / "hit").write_text(name)
        await thawed.wait()  # killed here, or frozen and thawed

    if seam_name or args.group:
        seam.install(hook)

    async def tool(run: ToolRun) -> Any:
        log(state, "starts", f"{run.call.name} {current['iteration']}{_nth(run)}")
        await seam.seam("inside_tool")
        if args.group and seam_name:  # the holder that stops runs every call, in order
            async with stored:  # the calls finish in the response's order
                await stored.wait_for(lambda: results["n"] >= int(_nth(run) or 0) or fired)
            if fired:
                await thawed.wait()  # the holder stopped: no other call returns
        log(state, "effects", f"{run.call.name} {current['iteration']}{_nth(run)}")
        return {"tool": run.call.name, "ok": True}

    async def model(history: list[Any], stream: TokenStream | None) -> Any:
        log(state, "model", str(current["iteration"]))
        if args.group:
            return agent.group_reply_for(history, args.group)
        reply = agent.reply_for(history)
        if stream is not None:
            tokens = agent.reply_tokens(reply)
            await seam.seam("before_tokens")  # the model call began; nothing put yet
            for n, token in enumerate(tokens):
                if n == len(tokens) // 2:
                    await seam.seam("inside_stream")  # the first half is on its way
                stream.put(token)
                log(state, "tokens", f"{os.getpid()} {current['iteration']} {n}")
        return reply

    async def gate(iteration: int) -> None:
        if iteration == args.gate and take(state / "gated", str(os.getpid())):
            await released.wait()

    async def turn(tc: TaskContext) -> None:
        current["iteration"] = tc.iteration
        pid = os.getpid()
        try:
            await gate(tc.iteration)
            j = await tc.journal()
            log(state, "claims", f"{pid} {tc.iteration}")
            history = await tc.load_checkpoint() or [tc.input]
            if args.inputs:
                for placed in await j.place_inputs(InputMode.STEER):
                    log(state, "placed", f"{pid} {tc.iteration} {placed.request_id}")
                    history = [*history, {"input": placed.content}]
            if args.group:
                await agent.group_turn(tc, j, history, model=model, tool=tool)
            else:
                await agent.turn(
                    tc, j, history, model=model, tool=tool, streamed=args.stream, apart=args.apart
                )
        except BaseException as signal:
            log(state, "turns", f"{pid} {tc.iteration} {type(signal).__name__}")
            raise
        log(state, "turns", f"{pid} {tc.iteration} returned")

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, released.set)
        label = args.name or args.crash or "clean"
        if args.standby:
            go = asyncio.Event()
            loop.add_signal_handler(signal.SIGUSR2, go.set)
            (state / f"standby-{label}").write_text("1")
            await go.wait()
        async with Worker(
            args.target,
            handlers={args.task: turn},
            poll_wait=0.5,
            concurrency=1,
            journal_target=args.journal,
        ):
            (state / f"ready-{label}").write_text("1")
            await asyncio.Event().wait()

    asyncio.run(serve())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("task")
    parser.add_argument("state", type=Path)
    parser.add_argument("crash", nargs="?", default="")
    parser.add_argument("--gate", type=int, default=None)
    parser.add_argument("--inputs", action="store_true")
    parser.add_argument("--name", default="")
    parser.add_argument("--standby", action="store_true")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--apart", action="store_true")
    parser.add_argument("--group", default="")
    parser.add_argument("--journal", default=None)
    return parser.parse_args(argv)


def _nth(run: ToolRun) -> str:
    """`` n``: a group call's place in the response; empty for a call alone."""
    n = run.call.input.get("n") if isinstance(run.call.input, dict) else None
    return "" if n is None else f" {n}"


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
