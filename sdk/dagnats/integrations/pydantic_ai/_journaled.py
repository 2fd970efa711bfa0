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
- A tool that needs approval (``requires_approval=True``, or one that raises
  ``ApprovalRequired`` while the call is not approved) is the journal's call
  with ``approval=True``: it asks, and the round stops with
  ``ApprovalPending``; the round's :class:`Resume` keeps the model's response
  and the results its calls already had, so the iteration the approval wakes
  replays the response (no model request) and runs none of those calls again.
  An approved call runs with ``ctx.tool_call_approved``; a denial reaches the
  model as the tool's return, ``{"denied": true, "reason": ...}``. In a
  parallel group such a call waits while the group's others run; their
  results are kept in the :class:`Resume` before the round stops.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import (
    ApprovalRequired,
    ModelMessagesTypeAdapter,
    ModelRetry,
    RunContext,
    ToolFailed,
)
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

from dagnats.sdk import (
    ApprovalPending,
    Journal,
    Replay,
    TokenStream,
    ToolCall,
    ToolResult,
    ToolRun,
    Usage,
    WithUsage,
)

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


@dataclass
class Resume:
    """What a round stopped for an approval hands to the iteration the
    approval wakes: the model's response that asked (JSON, replayed instead
    of a request), and the results its calls had already, by tool call id
    (the journal's output of each, reused without running the tool)."""

    response: Any = None  # JSON, or the ModelResponse itself until dumped
    results: dict[str, Any] = field(default_factory=dict)

    def dump(self) -> dict[str, Any]:
        response = self.response
        if isinstance(response, ModelResponse):
            response = dump_response(response)
        return {"response": response, "results": self.results}

    @classmethod
    def load(cls, data: Any) -> Resume:
        return cls(response=data["response"], results=dict(data["results"]))


class JournaledModel(WrapperModel):
    """A model whose every request is the journal's model call at the next
    position: a response recorded by an earlier holder is returned without a
    request. With ``stream``, the request streams and its text deltas go to
    the step's live stream while it runs. ``resume``: the first request
    answers with its response (the round a tool's approval stopped, replayed);
    every response is kept there, as the one the round would resume."""

    def __init__(
        self,
        wrapped: Model,
        journal: Journal,
        *,
        stream: bool,
        resume: Resume | None = None,
        calls: _ResponseCalls | None = None,
    ) -> None:
        super().__init__(wrapped)
        self._journal = journal
        self._stream = stream
        self._resume = resume if resume is not None else Resume()
        self._replay = self._resume.response
        self._calls = calls or _ResponseCalls()

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        response = self._calls.of(
            await self._request(messages, model_settings, model_request_parameters)
        )
        if self._resume.response is None or self._replay is None:
            self._resume.response, self._resume.results = response, {}
        self._replay = None
        return response

    async def _request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        if self._replay is not None:
            saved = self._replay

            async def again() -> Any:
                return saved  # the response that asked for an approval, replayed

            return load_response(await self._journal.model(again))
        if not self._stream:

            async def ask() -> Any:
                response = await self.wrapped.request(
                    messages, model_settings, model_request_parameters
                )
                return with_usage(dump_response(response), response)

            return load_response(await self._journal.model(ask))

        async def streamed(live: TokenStream) -> Any:
            async with self.wrapped.request_stream(
                messages, model_settings, model_request_parameters
            ) as response:
                async for event in response:
                    if (text := _text_of(event)) is not None:
                        live.put(text)
                whole = response.get()
                return with_usage(dump_response(whole), whole)

        return load_response(await self._journal.streamed_model(streamed))

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


def with_usage(dumped: Any, response: ModelResponse) -> Any:
    """The record of a response: with its usage, when the model counted any."""
    usage = spent(response)
    return WithUsage(dumped, usage) if usage.tokens else dumped


def spent(response: ModelResponse) -> Usage:
    """What a pydantic-ai response's request spent, for the usage ledger:
    its input tokens (those read from the prompt cache among them) and
    output tokens, under the model that answered."""
    usage = response.usage
    return Usage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_tokens=min(usage.cache_read_tokens, usage.input_tokens),
        model=response.model_name or "",
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


@dataclass(frozen=True, slots=True)
class _Member:
    """A call waiting in a gathering group: its place in the response, the
    journal's call, whether it needs approval, and where its result goes."""

    order: int
    tool_call_id: str
    call: ToolCall
    replay: Replay
    fn: ToolFn
    approval: bool
    answer: asyncio.Future[ToolResult]


@dataclass
class _Gathered:
    """Tool calls pydantic-ai started together, waiting to run as one group."""

    expected: frozenset[str]
    members: dict[str, _Member] = field(default_factory=dict)
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
    resume: Resume = field(default_factory=Resume)
    tools: Mapping[str, ToolsetTool[Any]] = field(default_factory=dict)
    _open: _Gathered | None = None
    _turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def call(
        self,
        tool_call_id: str,
        call: ToolCall,
        replay: Replay,
        fn: ToolFn,
        *,
        approval: bool = False,
    ) -> ToolResult:
        loop = asyncio.get_running_loop()
        gathered = self._open
        if gathered is None or tool_call_id in gathered.members:
            gathered = self._open = _Gathered(expected=self._segment(tool_call_id))
            loop.call_soon(self._settle, gathered, 0, 0)
        answer: asyncio.Future[ToolResult] = loop.create_future()
        order = self._order(tool_call_id, len(gathered.members))
        gathered.members[tool_call_id] = _Member(
            order, tool_call_id, call, replay, fn, approval, answer
        )
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
                    if name in self.tools
                    and self.tools[name].tool_def.kind == "function"
                    and call_id not in self.resume.results  # answered before an approval
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
            for member in gathered.members.values():
                member.answer.cancel()
            return
        gathered.task = asyncio.ensure_future(self._run(gathered))

    async def _run(self, gathered: _Gathered) -> None:
        members = sorted(gathered.members.values(), key=lambda m: m.order)
        answers = [m.answer for m in members]
        try:
            async with self._turn:  # a group gathered meanwhile runs after this one
                if len(members) == 1:
                    m = members[0]
                    results = [await self.journal.tool(m.call, m.replay, m.fn, approval=m.approval)]
                else:
                    results = await self.journal.tools(
                        [(m.call, m.replay, m.fn, m.approval) for m in members]
                    )
        except asyncio.CancelledError:
            for answer in answers:
                answer.cancel()
            raise
        except ApprovalPending as waiting:
            # The group's other calls ran, their results stored: they answer
            # (and are kept for the round the approval wakes); the waiting
            # calls raise it.
            for m, result in zip(members, waiting.results, strict=False):
                if not result.awaiting_approval:
                    _keep(self.resume, m.tool_call_id, result)
                    m.answer.set_result(result)
            for answer in answers:
                if not answer.done():
                    answer.set_exception(waiting)
            return
        except BaseException as err:  # a journal signal, or an error: every call raises it
            for answer in answers:
                if not answer.done():
                    answer.set_exception(err)
            return
        for answer, result in zip(answers, results, strict=True):
            if not answer.done():
                answer.set_result(result)


def _keep(resume: Resume, tool_call_id: str | None, result: ToolResult) -> None:
    """Keep a call's result for the round an approval stops: the iteration the
    approval wakes hands it to pydantic-ai without running the call again."""
    if tool_call_id:
        resume.results[tool_call_id] = {
            "output": result.output,
            "error": result.error,
            "interrupted": result.interrupted,
            "partial": result.partial,
        }


@dataclass
class JournaledToolset(WrapperToolset[Any]):
    """The run's toolset, each call journaled with its declared replay; with
    ``gatherer``, the calls started together run as a parallel group."""

    journal: Journal = field(kw_only=True)
    declared: Mapping[str, Replay] = field(kw_only=True)
    gatherer: _Gatherer | None = field(default=None, kw_only=True)
    resume: Resume = field(kw_only=True, default_factory=Resume)
    _approved: set[str] = field(init=False, default_factory=set)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        """The tools, those that need approval (``requires_approval``) turned
        into calls the journal asks approval for, rather than pydantic-ai's
        deferred calls."""
        tools = await super().get_tools(ctx)
        for name, tool in tools.items():
            if tool.tool_def.kind == "unapproved":
                self._approved.add(name)
                tools[name] = dataclasses.replace(
                    tool, tool_def=dataclasses.replace(tool.tool_def, kind="function")
                )
        if self.gatherer is not None:
            self.gatherer.tools = tools  # which calls of a response reach this toolset
        return tools

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        carried = self.resume.results.get(ctx.tool_call_id or "")
        if carried is not None:  # ran before the round stopped for an approval
            return _answer(name, ToolResult(**carried))
        call = ToolCall(name=name, input=to_jsonable_python(tool_args))
        if name in self._approved:
            result = await self._with_approval(call, ctx, tool, tool_args)
        else:
            replay = replay_of(tool, self.declared)
            result = await self._call(ctx, call, replay, self._run(ctx, tool, tool_args))
            if result.output == {"approval_required": True}:
                result = await self._with_approval(call, ctx, tool, tool_args)
        _keep(self.resume, ctx.tool_call_id, result)
        return _answer(name, result)

    async def _call(
        self,
        ctx: RunContext[Any],
        call: ToolCall,
        replay: Replay,
        fn: ToolFn,
        *,
        approval: bool = False,
    ) -> ToolResult:
        """The journal's call: with the gatherer, in the parallel group of the
        calls pydantic-ai started with it; else alone."""
        if self.gatherer is not None:
            return await self.gatherer.call(
                ctx.tool_call_id or "", call, replay, fn, approval=approval
            )
        return await self.journal.tool(call, replay, fn, approval=approval)

    async def _with_approval(
        self,
        call: ToolCall,
        ctx: RunContext[Any],
        tool: ToolsetTool[Any],
        tool_args: dict[str, Any],
    ) -> ToolResult:
        approved = dataclasses.replace(ctx, tool_call_approved=True)
        run = self._run(approved, tool, tool_args)
        return await self._call(ctx, call, Replay.UNSAFE, run, approval=True)

    def _run(
        self, ctx: RunContext[Any], tool: ToolsetTool[Any], tool_args: dict[str, Any]
    ) -> Callable[[ToolRun], Awaitable[Any]]:
        name = tool.tool_def.name

        async def run(journaled: ToolRun) -> Any:
            args = tool_args
            if journaled.call.input != to_jsonable_python(tool_args):  # the approver's edit
                args = tool.args_validator.validate_python(journaled.call.input)
            token = _tool_run.set(journaled)
            try:
                value = await self.wrapped.call_tool(name, args, ctx, tool)
            except ModelRetry as retry:
                return {"retry": retry.message}
            except ApprovalRequired:
                return {"approval_required": True}  # asked for below, as its own call
            finally:
                _tool_run.reset(token)
            return {"return": to_jsonable_python(value)}

        return run


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
        case {"denied": True, "reason": str()} as denial:
            return denial  # the approver's denial, for the model to read
    raise TypeError(f"the journal's record of {name} is not a pydantic-ai tool result")


@dataclass
class Journaled(AbstractCapability[Any]):
    """The capability that puts one dispatch's journal under an agent run."""

    journal: Journal
    declared: Mapping[str, Replay]
    stream: bool = False
    parallel: bool = True
    resume: Resume = field(default_factory=Resume)
    _calls: _ResponseCalls = field(default_factory=_ResponseCalls)

    def get_wrapper_model(self, model: Model) -> Model | None:
        return JournaledModel(
            model, self.journal, stream=self.stream, resume=self.resume, calls=self._calls
        )

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        gatherer = _Gatherer(self.journal, self._calls, self.resume) if self.parallel else None
        return JournaledToolset(
            toolset,
            journal=self.journal,
            declared=self.declared,
            resume=self.resume,
            gatherer=gatherer,
        )
