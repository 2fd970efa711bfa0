"""The scripted agent that the crash matrix's and the chaos soak's worker
processes run: a safe search, an unsafe send, a safe search, then the answer.
Its model is a pure function of the conversation, so any process answers the
same; each worker supplies the model's and the tool's side effects (logs,
latency) and builds the conversation it passes in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from dagnats.sdk import Journal, Replay, TaskContext, ToolCall, ToolRun

SCRIPT: list[dict[str, Any]] = [
    {"tool": "search", "input": {"q": "weather"}},
    {"tool": "send", "input": {"to": "ops"}},
    {"tool": "search", "input": {"q": "confirm"}},
    {"answer": "done"},
]
ANSWER = "done"
ITERATIONS = 3  # the continues before the answer


def reply_for(history: list[Any]) -> dict[str, Any]:
    """The model's reply: the script's step after the replies in ``history``."""
    turns = sum(1 for m in history if isinstance(m, dict) and "reply" in m)
    return SCRIPT[turns]


async def turn(
    tc: TaskContext,
    j: Journal,
    history: list[Any],
    *,
    model: Callable[[list[Any]], Awaitable[Any]],
    tool: Callable[[ToolRun], Awaitable[Any]],
) -> None:
    """One turn after the claim: ask the model, then answer, or run the tool it
    picked (``search`` is safe, anything else unsafe), checkpoint and continue."""
    reply = await j.model(lambda: model(history))
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    replay = Replay.SAFE if reply["tool"] == "search" else Replay.UNSAFE
    result = await j.tool(ToolCall(name=reply["tool"], input=reply["input"]), replay, tool)
    entry = {"reply": reply, "output": result.output, "interrupted": result.interrupted}
    await tc.checkpoint([*history, entry])
    await tc.continue_()
