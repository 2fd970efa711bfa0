"""The journal handle a handler gets from ``await tc.journal()``.

Every decision (reuse a recorded response, run a tool, honour an earlier
attempt's unsafe intent, record ``interrupted``) is made by the journal
service's replay rules; this module only carries calls and results, counts
positions, and turns the service's answers into values and signals.

Invariants:

- Positions count every journaled call of the dispatch from 0, model and tool
  calls alike, in the order the handler makes them.
- One asyncio task at a time: calls are matched by position, so concurrent use
  raises ``ConcurrentJournalUse`` instead of recording a race.
- After ``Fenced`` the handle writes nothing more.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dagnats.core.errors import Fenced as FencedError
from dagnats.core.errors import InvalidArgument
from dagnats.core.seam import seam
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._codec import decode, encode
from dagnats.sdk._errors import ConcurrentJournalUse, Fenced

if TYPE_CHECKING:
    from dagnats.sdk._rpc import EngineRpc


class Replay(enum.Enum):
    """Whether running a tool twice is harmless."""

    SAFE = "safe"
    """A read, or a write keyed on the call's idempotency key."""
    UNSAFE = "unsafe"
    """Send a message, open a pull request, charge a card."""


class InputMode(enum.Enum):
    """Where an input enters the conversation."""

    STEER = 1
    """Joins the current run after the next tool round."""
    FOLLOW_UP = 2
    """Starts the next turn after the agent gives a final answer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedInput:
    """An input placed into this iteration; ``content`` is the caller's JSON."""

    request_id: str
    mode: InputMode
    content: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A tool call. ``key`` is ``{run}.{step}.{iteration}.{position}``, filled
    in by the journal: pass it to any system that deduplicates."""

    name: str
    input: Any = None
    key: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """What a tool call produced. ``error`` is the tool's own error (part of
    the result); ``interrupted`` means an earlier holder started it and did not
    finish, with ``partial`` the output it reported."""

    output: Any = None
    error: str = ""
    interrupted: bool = False
    partial: str = ""
    replayed: bool = False


@dataclass
class ToolRun:
    """Given to a tool function: the call, and a way to report partial output."""

    call: ToolCall
    _report: Callable[[str], Awaitable[None]] = field(repr=False)

    async def report(self, chunk: str) -> None:
        """Record partial output; a successor that finds the tool unfinished
        hands it to the model with the ``interrupted`` result."""
        await self._report(chunk)


ToolFn = Callable[[ToolRun], Awaitable[Any]]
ModelFn = Callable[[], Awaitable[Any]]


class Journal:
    """Durable model and tool calls for one dispatch of a step."""

    def __init__(self, rpc: EngineRpc, token: jpb.WriterToken) -> None:
        self._rpc = rpc
        self._token = token
        self._position = 0
        self._busy = False
        self._fenced = False

    @property
    def token(self) -> jpb.WriterToken:
        return self._token

    @property
    def fenced(self) -> bool:
        return self._fenced

    async def model(self, fn: ModelFn) -> Any:
        """The response recorded at this position, or ``await fn()`` recorded.

        A failed ``fn`` records nothing (the exception propagates).

        Raises:
            ReplayMismatch: a tool call was recorded at this position.
            Fenced: a successor holds the step.
        """
        with self._turn() as position:
            begin = await self._guard(
                self._rpc.begin_model(jpb.BeginModelRequest(token=self._token, position=position))
            )
            if begin.recorded:
                return decode(begin.response, field="response")
            response = await fn()
            data = encode(response, field="response")
            recorded = await self._guard(
                self._rpc.record_model(
                    jpb.RecordModelRequest(token=self._token, position=position, response=data)
                )
            )
            self._token = recorded.token
            await seam("after_model")
            return response

    async def tool(self, call: ToolCall, replay: Replay, fn: ToolFn) -> ToolResult:
        """Run a tool call durably: intent before, result after.

        ``fn`` gets a :class:`ToolRun` and returns the tool's output, which
        must be JSON. An exception from ``fn`` is the tool's own error and part
        of the result; it does not stop the step.

        Raises:
            InvalidArgument: the input or the output is not JSON.
            ReplayMismatch: a different call was recorded at this position.
            Fenced: a successor holds the step.
        """
        with self._turn() as position:
            t = self._token
            call = replace(call, key=f"{t.run_id}.{t.step_id}.{t.iteration}.{position}")
            begin = await self._guard(
                self._rpc.begin_tool(
                    jpb.BeginToolRequest(
                        token=self._token,
                        position=position,
                        name=call.name,
                        input=encode(call.input, field="input"),
                        replay=jpb.REPLAY_SAFE if replay is Replay.SAFE else jpb.REPLAY_UNSAFE,
                    )
                )
            )
            self._token = begin.token
            if not begin.run:
                return _result(begin.result, replayed=True)
            await seam("after_intent")
            result = await self._run(call, begin.intent_seq, fn)
            await seam("after_result")
            return result

    async def _run(self, call: ToolCall, intent_seq: int, fn: ToolFn) -> ToolResult:
        async def report(chunk: str) -> None:
            out = await self._guard(
                self._rpc.tool_output(
                    jpb.ToolOutputRequest(token=self._token, intent_seq=intent_seq, chunk=chunk)
                )
            )
            self._token = out.token

        error, data, raised = "", b"", None
        try:
            output = await fn(ToolRun(call=call, _report=report))
        except Exception as err:  # the tool's own error is part of its result
            error = f"{type(err).__name__}: {err}"
        else:
            try:
                data = encode(output, field="output")
            except InvalidArgument as err:
                error, raised = f"tool output is not JSON: {err.message}", err
        finished = await self._guard(
            self._rpc.finish_tool(
                jpb.FinishToolRequest(
                    token=self._token, intent_seq=intent_seq, output=data, error=error
                )
            )
        )
        self._token = finished.token
        if raised is not None:
            raise raised
        return ToolResult(output=decode(data, field="output") if data else None, error=error)

    async def place_inputs(self, mode: InputMode) -> list[PlacedInput]:
        """Place the step's queued inputs of ``mode`` (see ``TaskContext.place_inputs``)."""
        with self._turn() as position:
            placed = await self._guard(
                self._rpc.place_inputs(
                    jpb.PlaceInputsRequest(token=self._token, position=position, mode=mode.value)
                )
            )
            self._token = placed.token
            await seam("after_inputs_placed")
            return [
                PlacedInput(
                    request_id=p.request_id,
                    mode=InputMode(p.mode),
                    content=decode(p.content, field="content") if p.content else None,
                )
                for p in placed.inputs
            ]

    async def hold(self) -> None:
        """Raise ``Fenced`` unless this holder still owns the step."""
        await self._guard(self._rpc.hold(jpb.HoldRequest(token=self._token)))

    async def commit(self, commit: jpb.Commit) -> int:
        """Store the dispatch's commit; returns its sequence."""
        done = await self._guard(
            self._rpc.commit(jpb.CommitRequest(token=self._token, commit=commit))
        )
        await seam("after_commit")
        return int(done.commit_seq)

    def _turn(self) -> _Turn:
        if self._busy:
            raise ConcurrentJournalUse(
                "two asyncio tasks used one journal handle at once; make journaled calls "
                "one at a time"
            )
        if self._fenced:
            raise Fenced(self._token.run_id, self._token.step_id)
        return _Turn(self)

    async def _guard(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except FencedError as err:
            self._fenced = True
            raise Fenced(
                self._token.run_id, self._token.step_id, expected=err.expected, actual=err.actual
            ) from None


class _Turn:
    """Marks the handle busy for one call and hands out its position."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    def __enter__(self) -> int:
        self._journal._busy = True
        position = self._journal._position
        self._journal._position += 1
        return position

    def __exit__(self, *exc: object) -> None:
        self._journal._busy = False


def _result(result: jpb.ToolResult, *, replayed: bool) -> ToolResult:
    return ToolResult(
        output=decode(result.output, field="output") if result.output else None,
        error=result.error,
        interrupted=result.interrupted,
        partial=result.partial,
        replayed=replayed,
    )
