"""The journal under a pydantic-ai run: a model whose requests are journaled
model calls, and a toolset whose calls are journaled tool calls.

Both are handed to pydantic-ai through its public extension points: a
capability's ``get_wrapper_model`` (a ``WrapperModel`` around whichever model
serves a request) and ``get_wrapper_toolset`` (a ``WrapperToolset`` around the
run's assembled toolset, function tools included; output tools are not in it,
and processing the output is local and deterministic).

Invariants:

- Journaled calls are matched by position. In pydantic-ai's parallel mode
  (the default) the tool calls pydantic-ai starts together are one parallel
  group (``Journal.tools``): the calls that reach the toolset before the event
  loop has a turn with no new arrival, ordered as in the model's response,
  whatever order they arrive or finish in. A lone call is an ordinary
  ``Journal.tool``. In ``sequential`` mode every call is one at a time. A
  recorded response gives the same tool calls again, so the same groups.
- A model response is recorded as pydantic-ai's own JSON form of a
  ``ModelResponse`` and read back with the same adapter.
- A tool's record says what pydantic-ai made of the call: ``{"return": ...}``
  (the tool's return value as JSON), or ``{"retry": ...}`` when it raised
  ``ModelRetry``, so a replay asks the model to retry exactly as the first run
  did. A tool's own error is recorded as its error and reaches the model as a
  failed tool result (``ToolFailed``); so does an interrupted call, with the
  output it reported.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import ModelMessagesTypeAdapter, ModelRetry, RunContext, ToolFailed
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
)
from pydantic_ai.models import (
    CompletedStreamedResponse,
    Model,
    ModelRequestParameters,
    StreamedResponse,
)
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
from pydantic_core import to_jsonable_python

from dagnats.sdk import Journal, Replay, TokenStream, ToolCall, ToolResult, ToolRun

REPLAY_METADATA_KEY = "dagnats_replay"
"""The key of a tool's pydantic-ai ``metadata`` that declares its replay."""

ToolFn = Callable[[ToolRun], Awaitable[Any]]

_tool_run: contextvars.ContextVar[ToolRun | None] = contextvars.ContextVar(
    "dagnats_tool_run", default=None
)


def safe(metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Tool metadata declaring the tool safe to run twice, for pydantic-ai's
    tool decorators: ``@agent.tool_plain(metadata=safe())``. Other metadata
    may be passed in and is kept.

    A safe tool whose holder crashed while it ran is run again; an unsafe one
    (the default) is recorded ``interrupted`` and never started twice.
    """
    return {**(metadata or {}), REPLAY_METADATA_KEY: Replay.SAFE.value}


def current_tool_run() -> ToolRun:
    """The journaled call of the tool that is running: ``.call.key`` is its
    idempotency key (the same on every delivery and attempt; pass it to
    systems that deduplicate), and ``await .report(text)`` records partial
    output, which a successor hands to the model if the call is interrupted.

    Raises:
        LookupError: no journaled tool call is running in this task.
    """
    run = _tool_run.get()
    if run is None:
        raise LookupError("current_tool_run() is only available inside a journaled tool call")
    return run


def dump_response(response: ModelResponse) -> Any:
    """A model response as the JSON the journal records."""
    return ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]


def load_response(data: Any) -> ModelResponse:
    """The model response a journal record holds.

    Raises:
        TypeError: the record is not a model response.
    """
    (message,) = ModelMessagesTypeAdapter.validate_python([data])
    if not isinstance(message, ModelResponse):
        raise TypeError(f"the journal's model record is a {message.kind}, not a model response")
    return message


def replay_of(tool: ToolsetTool[Any], declared: Mapping[str, Replay]) -> Replay:
    """A tool's declaration: the handler's mapping, else the tool's metadata,
    else ``Replay.UNSAFE``."""
    name = tool.tool_def.name
    if name in declared:
        return declared[name]
    metadata = tool.tool_def.metadata or {}
    return (
        Replay(metadata[REPLAY_METADATA_KEY]) if REPLAY_METADATA_KEY in metadata else Replay.UNSAFE
    )


class JournaledModel(WrapperModel):
    """A model whose every request is the journal's model call at the next
    position: a response recorded by an earlier holder is returned without a
    request. With ``stream``, the request streams and its text deltas go to
    the step's live stream while it runs."""

    def __init__(
        self, wrapped: Model, journal: Journal, *, stream: bool, calls: _ResponseCalls | None = None
    ) -> None:
        super().__init__(wrapped)
        self._journal = journal
        self._stream = stream
        self._calls = calls or _ResponseCalls()

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        if not self._stream:

            async def ask() -> Any:
                response = await self.wrapped.request(
                    messages, model_settings, model_request_parameters
                )
                return dump_response(response)

            return self._calls.of(load_response(await self._journal.model(ask)))

        async def streamed(live: TokenStream) -> Any:
            async with self.wrapped.request_stream(
                messages, model_settings, model_request_parameters
            ) as response:
                async for event in response:
                    if (text := _text_of(event)) is not None:
                        live.put(text)
                return dump_response(response.get())

        return self._calls.of(load_response(await self._journal.streamed_model(streamed)))

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        # A streaming caller gets the journaled response replayed as events:
        # the live tokens went to the step's stream while it was requested.
        response = await self.request(messages, model_settings, model_request_parameters)
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )


def _text_of(event: Any) -> str | None:
    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
        return event.part.content or None
    if isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
        return event.delta.content_delta or None
    return None


@dataclass
class _ResponseCalls:
    """The tool calls of the newest model response, in its order (id, name)."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    def of(self, response: ModelResponse) -> ModelResponse:
        self.calls = [(part.tool_call_id, part.tool_name) for part in response.tool_calls]
        return response


# Turns of the event loop a gathering group waits for a call of its segment
# that has not arrived, once no call arrives: pydantic-ai starts a segment's
# calls together, but one that never reaches the toolset (its arguments
# invalid, a hook that asks for a retry or defers it) must not hold the rest.
IDLE_TURNS = 3


@dataclass
class _Gathered:
    """Tool calls pydantic-ai started together, waiting to run as one group."""

    expected: frozenset[str]
    members: dict[str, tuple[int, ToolCall, Replay, ToolFn, asyncio.Future[ToolResult]]] = field(
        default_factory=dict
    )
    task: asyncio.Task[None] | None = None
    stopped: bool = False  # a call was cancelled before the group started


@dataclass
class _Gatherer:
    """Turns the tool calls pydantic-ai starts at once into parallel groups.

    pydantic-ai starts the calls of one response as tasks created together,
    one segment at a time (a tool declared ``sequential`` runs alone, between
    segments). A group waits for every call of its segment that is a function
    tool of this toolset, in the response's order; when a call of the segment
    does not arrive and ``IDLE_TURNS`` turns of the event loop pass without a
    new arrival, the group runs with those that came, and a later one runs
    after it. Groups run one after another (``Journal.tools``; a lone call
    with ``Journal.tool``). A call cancelled while it waits or runs stops its
    group, as pydantic-ai cancels the siblings of a call that raised."""

    journal: Journal
    calls: _ResponseCalls
    tools: Mapping[str, ToolsetTool[Any]] = field(default_factory=dict)
    _open: _Gathered | None = None
    _turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def call(
        self, tool_call_id: str, call: ToolCall, replay: Replay, fn: ToolFn
    ) -> ToolResult:
        loop = asyncio.get_running_loop()
        gathered = self._open
        if gathered is None or tool_call_id in gathered.members:
            gathered = self._open = _Gathered(expected=self._segment(tool_call_id))
            loop.call_soon(self._settle, gathered, 0, 0)
        answer: asyncio.Future[ToolResult] = loop.create_future()
        order = self._order(tool_call_id, len(gathered.members))
        gathered.members[tool_call_id] = (order, call, replay, fn, answer)
        try:
            return await answer
        except asyncio.CancelledError:
            gathered.stopped = True
            if gathered.task is not None:
                gathered.task.cancel()
                await asyncio.wait((gathered.task,))  # each call answers its intent, if it may
            raise

    def _order(self, tool_call_id: str, arrived: int) -> int:
        ids = [i for i, _ in self.calls.calls]
        return ids.index(tool_call_id) if tool_call_id in ids else len(ids) + arrived

    def _segment(self, tool_call_id: str) -> frozenset[str]:
        """The calls of the response pydantic-ai starts with ``tool_call_id``
        that reach this toolset: its run of calls between ``sequential`` tools."""
        segments: list[list[tuple[str, str]]] = [[]]
        for call_id, name in self.calls.calls:
            tool = self.tools.get(name)
            if tool is not None and tool.tool_def.sequential:
                segments += [[(call_id, name)], []]
            else:
                segments[-1].append((call_id, name))
        for segment in segments:
            if any(call_id == tool_call_id for call_id, _ in segment):
                return frozenset(
                    call_id
                    for call_id, name in segment
                    if name in self.tools and self.tools[name].tool_def.kind == "function"
                )
        return frozenset({tool_call_id})

    def _settle(self, gathered: _Gathered, seen: int, idle: int) -> None:
        arrived = len(gathered.members)
        waiting = not gathered.expected <= gathered.members.keys()
        if not gathered.stopped and waiting and (arrived != seen or idle < IDLE_TURNS):
            idle = 0 if arrived != seen else idle + 1
            asyncio.get_running_loop().call_soon(self._settle, gathered, arrived, idle)
            return
        if self._open is gathered:
            self._open = None
        if gathered.stopped:
            for *_, answer in gathered.members.values():
                answer.cancel()
            return
        gathered.task = asyncio.ensure_future(self._run(gathered))

    async def _run(self, gathered: _Gathered) -> None:
        members = sorted(gathered.members.values(), key=lambda m: m[0])
        answers = [m[4] for m in members]
        try:
            async with self._turn:  # a group gathered meanwhile runs after this one
                if len(members) == 1:
                    _, call, replay, fn, _ = members[0]
                    results = [await self.journal.tool(call, replay, fn)]
                else:
                    results = await self.journal.tools([(c, r, f) for _, c, r, f, _ in members])
        except asyncio.CancelledError:
            for answer in answers:
                answer.cancel()
            raise
        except BaseException as err:  # a journal signal, or an error: every call raises it
            for answer in answers:
                if not answer.done():
                    answer.set_exception(err)
            return
        for answer, result in zip(answers, results, strict=True):
            if not answer.done():
                answer.set_result(result)


@dataclass
class JournaledToolset(WrapperToolset[Any]):
    """The run's toolset, each call journaled with its declared replay; with
    ``gatherer``, the calls started together run as a parallel group."""

    journal: Journal = field(kw_only=True)
    declared: Mapping[str, Replay] = field(kw_only=True)
    gatherer: _Gatherer | None = field(default=None, kw_only=True)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await super().get_tools(ctx)
        if self.gatherer is not None:
            self.gatherer.tools = tools  # which calls of a response reach this toolset
        return tools

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        async def run(journaled: ToolRun) -> Any:
            token = _tool_run.set(journaled)
            try:
                value = await self.wrapped.call_tool(name, tool_args, ctx, tool)
            except ModelRetry as retry:
                return {"retry": retry.message}
            finally:
                _tool_run.reset(token)
            return {"return": to_jsonable_python(value)}

        call = ToolCall(name=name, input=to_jsonable_python(tool_args))
        replay = replay_of(tool, self.declared)
        if self.gatherer is not None:
            result = await self.gatherer.call(ctx.tool_call_id or "", call, replay, run)
        else:
            result = await self.journal.tool(call, replay, run)
        return _answer(name, result)


def _answer(name: str, result: ToolResult) -> Any:
    """What pydantic-ai gets for a journaled call's result."""
    if result.interrupted:
        partial = f" Its output so far: {result.partial}" if result.partial else ""
        raise ToolFailed(
            f"The call to {name} was started earlier and did not finish (the worker running it "
            "stopped); it was not started again, so its effect may or may not have happened. "
            f"Check before calling it again.{partial}"
        )
    if result.error:
        raise ToolFailed(f"The call to {name} failed: {result.error}")
    match result.output:
        case {"retry": str(message)}:
            raise ModelRetry(message)
        case {"return": value}:
            return value
    raise TypeError(f"the journal's record of {name} is not a pydantic-ai tool result")


@dataclass
class Journaled(AbstractCapability[Any]):
    """The capability that puts one dispatch's journal under an agent run."""

    journal: Journal
    declared: Mapping[str, Replay]
    stream: bool = False
    parallel: bool = True
    _calls: _ResponseCalls = field(default_factory=_ResponseCalls)

    def get_wrapper_model(self, model: Model) -> Model | None:
        return JournaledModel(model, self.journal, stream=self.stream, calls=self._calls)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        gatherer = _Gatherer(self.journal, self._calls) if self.parallel else None
        return JournaledToolset(
            toolset, journal=self.journal, declared=self.declared, gatherer=gatherer
        )
