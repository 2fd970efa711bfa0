"""The scripted agent that the crash matrix's and the chaos soak's worker
processes run: a safe search, an unsafe send, a safe search, then the answer.
Its model is a pure function of the conversation, so any process answers the
same; each worker supplies the model's and the tool's side effects (logs,
latency) and builds the conversation it passes in."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from dagnats.sdk import Journal, Replay, TaskContext, TokenStream, ToolCall, ToolRun

SCRIPT: list[dict[str, Any]] = [
    {"tool": "search", "input": {"q": "weather"}},
    {"tool": "send", "input": {"to": "ops"}},
    {"tool": "search", "input": {"q": "confirm"}},
    {"answer": "done"},
]
ANSWER = "done"
ITERATIONS = 3  # the continues before the answer
TOKEN_CHARS = 4  # characters of a reply's JSON text per streamed token

# The model of a turn: the conversation, and the live stream to put its reply
# on when the turn streams (else None).
ModelFn = Callable[[list[Any], TokenStream | None], Awaitable[Any]]


def reply_for(history: list[Any]) -> dict[str, Any]:
    """The model's reply: the script's step after the replies in ``history``."""
    turns = sum(1 for m in history if isinstance(m, dict) and "reply" in m)
    return SCRIPT[turns]


def reply_tokens(reply: Any) -> list[str]:
    """The tokens a streaming model puts for ``reply``: its JSON text as the
    journal records it, cut every ``TOKEN_CHARS`` characters."""
    text = json.dumps(reply, separators=(",", ":"))
    return [text[i : i + TOKEN_CHARS] for i in range(0, len(text), TOKEN_CHARS)]


async def turn(
    tc: TaskContext,
    j: Journal,
    history: list[Any],
    *,
    model: ModelFn,
    tool: Callable[[ToolRun], Awaitable[Any]],
    streamed: bool = False,
    apart: bool = False,
) -> None:
    """One turn after the claim: ask the model (``streamed``: with a live
    stream, ``j.streamed_model``), then answer, or run the tool it picked
    (``search`` is safe, anything else unsafe), checkpoint and continue.
    ``apart``: heartbeat after the model call and after the tool, so each is
    stored in a record of its own before the next journal call."""
    if streamed:
        reply = await j.streamed_model(lambda stream: model(history, stream))
    else:
        reply = await j.model(lambda: model(history, None))
    if apart:
        await tc.heartbeat()
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    replay = Replay.SAFE if reply["tool"] == "search" else Replay.UNSAFE
    result = await j.tool(ToolCall(name=reply["tool"], input=reply["input"]), replay, tool)
    if apart:
        await tc.heartbeat()
    entry = {"reply": reply, "output": result.output, "interrupted": result.interrupted}
    await tc.checkpoint([*history, entry])
    await tc.continue_()


# Parallel groups: the first reply asks for three calls at once, of one kind;
# the second answers. ``n`` is the call's place in the response.
GROUPS: dict[str, list[dict[str, Any]]] = {
    "safe": [{"tool": "search", "input": {"q": f"city {n}", "n": n}} for n in range(3)],
    "unsafe": [{"tool": "send", "input": {"to": f"team {n}", "n": n}} for n in range(3)],
    "mixed": [
        {"tool": "search", "input": {"q": "city 0", "n": 0}},
        {"tool": "send", "input": {"to": "team 1", "n": 1}},
        {"tool": "search", "input": {"q": "city 2", "n": 2}},
    ],
}
GROUP_ITERATIONS = 1  # the continues before the answer


def group_reply_for(history: list[Any], kind: str) -> dict[str, Any]:
    """The model's reply in a group run: the group first, then the answer."""
    turns = sum(1 for m in history if isinstance(m, dict) and "reply" in m)
    return {"tools": GROUPS[kind]} if turns == 0 else {"answer": ANSWER}


async def group_turn(
    tc: TaskContext,
    j: Journal,
    history: list[Any],
    *,
    model: ModelFn,
    tool: Callable[[ToolRun], Awaitable[Any]],
) -> None:
    """One turn of a group run: ask the model, then answer, or run the calls
    it asks for at once (``j.tools``), checkpoint and continue."""
    reply = await j.model(lambda: model(history, None))
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    calls = [
        (
            ToolCall(name=c["tool"], input=c["input"]),
            Replay.SAFE if c["tool"] == "search" else Replay.UNSAFE,
            tool,
        )
        for c in reply["tools"]
    ]
    results = await j.tools(calls)
    entry = {
        "reply": reply,
        "outputs": [r.output for r in results],
        "interrupted": [r.interrupted for r in results],
    }
    await tc.checkpoint([*history, entry])
    await tc.continue_()
