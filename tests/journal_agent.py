"""A scripted journaled agent and a crash harness for the journal tests.

The agent is the spec's handler in miniature: claim the journal, load the
conversation, ask the scripted model, run the tool it picks (``search`` is
safe, everything else unsafe), checkpoint, continue; answer when told to.
Tools count their starts outside the journal.

A "crash" is a holder that stops at a seam and never sends another byte nor
a heartbeat, exactly what a killed process looks like from outside; a
"stall" is the same holder released later, a zombie.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dagnats.core import seam
from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun
from dagnats.sdk.testing import ScriptedModel

SCRIPT: list[dict[str, Any]] = [
    {"tool": "search", "input": {"q": "weather"}},
    {"tool": "send_email", "input": {"to": "ops"}},
    {"tool": "search", "input": {"q": "confirm"}},
    {"answer": "done"},
]


class ConversationModel(ScriptedModel):
    """The script's reply for the conversation's turn (a conversation is the
    input, then a reply and an outcome per turn), not for the request's count:
    a request asked again gets the same answer, as from a deterministic model."""

    def __init__(self) -> None:
        super().__init__(SCRIPT)

    async def __call__(self, request: Any) -> Any:
        self.requests.append(copy.deepcopy(request))
        return copy.deepcopy(SCRIPT[(len(request) - 1) // 2])


@dataclass
class Tools:
    starts: Counter[str] = field(default_factory=Counter)
    effects: Counter[str] = field(default_factory=Counter)
    block: dict[str, asyncio.Event] = field(default_factory=dict)

    async def run(self, run: ToolRun) -> Any:
        name = run.call.name
        self.starts[name] += 1
        await run.report(f"started {name};")
        if name in self.block:
            await self.block[name].wait()
        self.effects[name] += 1
        return {"tool": name, "ok": True, "key": run.call.key}


@dataclass
class Seen:
    signals: list[str] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)


def agent(
    model: ScriptedModel, tools: Tools, seen: Seen | None = None, *, apart: bool = False
) -> Any:
    """The agent's handler. ``apart``: it heartbeats after its model call and
    after its tool, so the response and the result are stored in records of
    their own before its next journal call, as they were before
    they could ride that call's record."""
    seen = seen or Seen()

    async def turn(tc: TaskContext) -> None:
        try:
            j = await tc.journal()
            history = await tc.load_checkpoint() or [tc.input]
            reply = await j.model(lambda: model(history))
            if apart:
                await tc.heartbeat()
            if "answer" in reply:
                await tc.checkpoint([*history, reply])
                await tc.complete(reply["answer"])
                return
            replay = Replay.SAFE if reply["tool"] == "search" else Replay.UNSAFE
            call = ToolCall(name=reply["tool"], input=reply["input"])
            result = await j.tool(call, replay, tools.run)
            if apart:
                await tc.heartbeat()
            outcome = {
                "tool": reply["tool"],
                "output": result.output,
                "interrupted": result.interrupted,
                "partial": result.partial,
            }
            seen.results.append(outcome)
            await tc.checkpoint([*history, reply, outcome])
            await tc.continue_()
        except BaseException as signal:
            seen.signals.append(type(signal).__name__)
            raise

    return turn


class Crasher:
    """A seam hook: the ``skip``-th later hit of ``name`` stops there until
    released (never, for a crash)."""

    def __init__(self, name: str, *, skip: int = 0, times: int = 1) -> None:
        self.name = name
        self.skip = skip
        self.times = times
        self.hit = asyncio.Event()
        self.hits = 0
        self.release = asyncio.Event()

    async def __call__(self, name: str) -> None:
        if name != self.name or self.times <= 0:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self.times -= 1
        self.hits += 1
        self.hit.set()
        await self.release.wait()

    def __enter__(self) -> Crasher:
        seam.install(self)
        return self

    def __exit__(self, *exc: object) -> None:
        seam.install(None)
        self.release.set()
