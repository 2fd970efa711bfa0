"""The spec's example handler ("A handler") with the Python SDK: one turn of a
tool-using agent per iteration of an ``agent_loop`` step.

A turn claims the step's journal, places the steering inputs people sent
(and, after a final answer, the follow-ups), asks the model for its next move
through the journal (a retry reuses a recorded reply instead of asking again),
runs the tool the model picked through the journal (``search`` may run twice,
anything else at most once), checkpoints the conversation and asks for the next
iteration. After a final answer the step stays open: it waits, holding no
worker, until a follow-up arrives or an hour passes.

The model and the tools are yours: :func:`make_agent_turn` takes them and
returns the handler. The model's reply is JSON shaped like
``{"done": false, "tool": "search", "input": {...}}`` or
``{"done": true, "answer": ...}``.

The journal's signals (``Stale``, ``Committed``, ``RestartLimit``, ``Fenced``)
derive from ``BaseException`` and pass through: each means the dispatch is
already settled, and the worker knows what to do with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dagnats.sdk import (
    Handler,
    InputMode,
    InputsQueued,
    PlacedInput,
    Replay,
    TaskContext,
    ToolCall,
    ToolResult,
    ToolRun,
)

__all__ = [
    "SAFE_TOOLS",
    "BadReply",
    "CallModel",
    "History",
    "RunTool",
    "Turn",
    "answered",
    "append_inputs",
    "append_turn",
    "decode_turn",
    "make_agent_turn",
    "opening",
]

History = list[Any]
CallModel = Callable[[History], Awaitable[Any]]
"""``await call_model(history)``: the model's reply to the conversation (JSON)."""
RunTool = Callable[[str, Any, str], Awaitable[Any]]
"""``await run_tool(name, input, key)``: the tool's output (JSON). Pass ``key``
to any system that deduplicates: it is the same on every attempt of the call."""

FOLLOW_UP_WINDOW = 3600.0
"""Seconds an answered step waits for a follow-up before the next turn."""

SAFE_TOOLS = frozenset({"search"})
"""Tools that are harmless to run twice; every other tool runs at most once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """A decoded model reply: a tool to call, or the final answer."""

    done: bool
    tool: str = ""
    input: Any = None
    answer: Any = None


class BadReply(ValueError):
    """The model's reply is not a turn.

    Attributes:
        reply: The reply as the model gave it.
    """

    def __init__(self, reply: Any) -> None:
        shown = repr(reply)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        super().__init__(
            "model reply is not a turn (want done: true with an answer, "
            f"or done: false with a tool name): {shown}"
        )
        self.reply = reply


def make_agent_turn(call_model: CallModel, run_tool: RunTool) -> Handler:
    """The agent-turn handler for a model and a set of tools.

    Args:
        call_model: Asks the model for its next move; its reply is recorded in
            the journal.
        run_tool: Runs one tool call; ``search`` is treated as safe to repeat,
            every other tool as unsafe.

    Returns:
        ``async def agent_turn(tc)``, to register with a ``Worker``.
    """

    async def agent_turn(tc: TaskContext) -> None:
        j = await tc.journal()  # first: the checkpoint comes with the claim
        history = await tc.load_checkpoint()
        if history is None:
            history = opening(tc.input)
        placed = await tc.place_inputs(InputMode.STEER)
        # A turn after a final answer was woken by a follow-up, and the
        # follow-up is what this turn answers.
        if answered(history):
            placed += await tc.place_inputs(InputMode.FOLLOW_UP)
        history = append_inputs(history, placed)

        reply = await j.model(lambda: call_model(history))
        try:
            turn = decode_turn(reply)
        except BadReply as err:
            await tc.fail_permanent(err)  # asking again would get the same recorded reply
            return
        if not turn.done:
            replay = Replay.SAFE if turn.tool in SAFE_TOOLS else Replay.UNSAFE

            async def tool(run: ToolRun) -> Any:
                return await run_tool(run.call.name, run.call.input, run.call.key)

            result = await j.tool(ToolCall(name=turn.tool, input=turn.input), replay, tool)
            await tc.checkpoint(append_turn(history, reply, result))
            await tc.continue_()
            return

        await tc.checkpoint(append_turn(history, reply))
        try:
            await tc.continue_(turn.answer, until_input=True, delay=FOLLOW_UP_WINDOW)
        except InputsQueued:
            await tc.continue_(turn.answer)  # the next turn places what was queued

    return agent_turn


def opening(input: Any) -> History:
    """The conversation a run starts with: its input when that is a list of
    messages, else the input as one user message."""
    if isinstance(input, list):
        return input
    return [{"role": "user", "content": input}]


def decode_turn(reply: Any) -> Turn:
    """Decode the model's reply.

    Raises:
        BadReply: the reply is neither a tool call nor a final answer.
    """
    match reply:
        case {"done": True, "answer": answer}:
            return Turn(done=True, answer=answer)
        case {"done": False, "tool": str(tool)} if tool:
            return Turn(done=False, tool=tool, input=reply.get("input"))
    raise BadReply(reply)


def append_turn(history: History, reply: Any, result: ToolResult | None = None) -> History:
    """The history with the model's reply and, for a tool call, its result.

    A tool an earlier holder started and did not finish comes back
    ``interrupted``, with the output it reported so far as ``partial``: the
    model is told, so it can check before trying again.
    """
    turn = [*history, {"role": "assistant", "content": reply}]
    if result is None:
        return turn
    message: dict[str, Any] = {"role": "tool", "output": result.output}
    if result.error:
        message["error"] = result.error
    if result.interrupted:
        message |= {"interrupted": True, "partial": result.partial}
    return [*turn, message]


def append_inputs(history: History, placed: list[PlacedInput]) -> History:
    """The history with each placed input as a user message, once."""
    return [*history, *({"role": "user", "content": p.content} for p in placed)]


def answered(history: History) -> bool:
    """Whether the history ends in the model's final answer."""
    match history:
        case [*_, {"role": "assistant", "content": {"done": True}}]:
            return True
    return False
