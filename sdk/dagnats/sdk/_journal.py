"""The journal handle a handler gets from ``await tc.journal()``.

Every decision (reuse a recorded response, run a tool, honour an earlier
attempt's unsafe intent, record ``interrupted``) is made by the journal
service's replay rules; this module only carries calls and results, counts
positions, and turns the service's answers into values and signals.

Invariants:

- Positions count every journaled call of the dispatch from 0, model and tool
  calls alike, in the order the handler makes them.
- One asyncio task at a time: calls are matched by position, so concurrent use
  raises ``ConcurrentJournalUse`` instead of recording a race. The calls of
  one model response run at once as one call, ``tools`` (a parallel group):
  one position each, in the response's order, every intent stored before any
  starts, each result stored as its call finishes, never held back as the
  pending entry.
- One RPC at a time, each with the newest token: the worker's keep-alive
  (``hold``) and a tool's ``report`` run beside the handler's calls, and a call
  made with the token a write in flight is about to replace would find that
  write's record on the tail and fence its own holder. A call cancelled on
  this side is still waited for, since its write may land anyway.
- After ``Fenced`` the handle writes nothing more; after its commit, ``hold``
  has nothing left to check.
- A tool stopped because its run was cancelled is answered ``interrupted``
  (the journal takes a result of an intent written before the cancel), so
  every intent the handle wrote has a result. Once the run is known cancelled
  no call starts (``RunCancelled``); the journal refuses the rest itself.
- A model call reads the step's tail first (``BeginModel``), so a fenced
  holder does not spend it, unless the handle's last write was stored from a
  call sent at most ``FRESH_TAIL`` before and nothing is recorded at the
  position (``WriterToken.replay_positions``): that write was fenced on the
  tail, and a read would tell no more: a fresh write is the tail check (ADR 35).
  Not when the run has a budget: then every new model call sends
  ``BeginModel`` with it, and the journal refuses the call once the run spent
  it (``BudgetExceeded``).
- A model call's usage (``WithUsage``) is recorded with its response. A
  handle the fence stops reports the usage of its calls to the step's spent
  subject (``RecordSpent``), since the fence refused the records that would
  have held it; the ledger charges a call it also finds stored once.
- A model response or a tool result is not sent at once: it rides the next
  journal call in that call's record when that call can carry it (a tool
  call's intent after a response, the commit after either), and is stored on
  its own first when the next call cannot, or as soon as the handler gives
  the event loop a turn before its next call (the pending entry). So it is stored before
  anything that depends on it starts -- a tool, the next model call, the
  commit -- and a crash before it is stored loses only what a crash inside
  the model call or the tool would have lost. A response or result over
  ``PENDING_BYTES`` is stored at once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, assert_never, cast

from dagnats.core import approvals
from dagnats.core.errors import DagnatsError, InvalidArgument, RecordTooLarge, ReplayMismatch
from dagnats.core.payload import decode, encode
from dagnats.core.seam import seam
from dagnats.core.timestamps import timestamp
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._errors import ApprovalPending, ConcurrentJournalUse, Fenced, RunCancelled
from dagnats.sdk._stream import TokenStream
from dagnats.sdk._usage import WithUsage, usage_to_proto

if TYPE_CHECKING:
    from dagnats.sdk._session import JournalCalls


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
    APPROVAL = 50
    """Approves or denies a tool call that waits for approval (placed by
    :meth:`Journal.tool` for a call declared ``approval=True``)."""
    BUDGET = 100
    """Raises the run's budget by its content, ``{"tokens": N, "cost": X}``
    (placed by the budget's check of the step's next model call)."""


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
    awaiting_approval: bool = False


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

GroupCall = tuple[ToolCall, Replay, ToolFn] | tuple[ToolCall, Replay, ToolFn, bool]
"""One call of :meth:`Journal.tools`: ``(call, replay, fn)``, or
``(call, replay, fn, True)`` for a call that needs approval."""
ModelFn = Callable[[], Awaitable[Any]]
StreamedModelFn = Callable[[TokenStream], Awaitable[Any]]

log = logging.getLogger("dagnats.sdk")

# A response or result at most this large (serialized) waits to ride the next
# call; a larger one is stored at once, on its own. Kept far below the
# smallest record limit, so that a pending entry always fits a record alone.
PENDING_BYTES = 64 * 1024

# Seconds for which a write stored fenced on the step's tail stands for the
# tail read before a model call: counted from when the write's call was sent,
# so the write landed inside it. A successor's claim in that window costs at
# most one model call whose response is refused, as a claim made while the
# model answers does.
FRESH_TAIL = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pending:
    """An entry the handle has not stored yet: a model response or a tool
    result. ``alone``: a call that carried it failed with its outcome unknown,
    so only the same record may be sent again under that call's identity."""

    model: jpb.ModelCall | None = None
    result: jpb.ToolResult | None = None
    alone: bool = False


class _Written(Protocol):
    """The answer to a call that may append: it carries the next token."""

    @property
    def token(self) -> jpb.WriterToken: ...


R = TypeVar("R")
W = TypeVar("W", bound=_Written)


class Journal:
    """Durable model and tool calls for one dispatch of a step."""

    def __init__(
        self,
        rpc: JournalCalls,
        token: jpb.WriterToken,
        *,
        cancellation: asyncio.Event | None = None,
        checked_at: float | None = None,
        budget: jpb.Budget | None = None,
    ) -> None:
        """``checked_at``: event-loop time at which the call that stored
        ``token.last_seq`` for this writer was sent (its claim, or the commit
        that handed it over); None when unknown. ``budget``: the run's, from
        its task: every new model call asks the journal to check it."""
        self._rpc = rpc
        self._token = token
        self._checked_at = checked_at
        self._position = 0
        self._busy = False
        self._fenced = False
        self._committed = False
        self._sending = asyncio.Lock()
        self._cancellation = cancellation or asyncio.Event()
        self._loose: TokenStream | None = None  # put_stream outside a model call
        self._pending: _Pending | None = None
        self._storing: asyncio.Task[None] | None = None  # the pending entry, on its own
        self._approvals: list[PlacedInput] | None = None  # placed by the first approval call
        self._used_approvals: set[str] = set()
        self._budget = budget
        # What this handle's model calls spent, by position: reported to the
        # spent subject if the fence stops the handle (the usage ledger).
        self._spent: dict[int, jpb.Usage] = {}

    @property
    def token(self) -> jpb.WriterToken:
        return self._token

    @property
    def fenced(self) -> bool:
        return self._fenced

    @property
    def checked_at(self) -> float | None:
        """Event-loop time at which the call that stored this handle's last
        write was sent: the tail was the handle's at some moment since."""
        return self._checked_at

    @property
    def in_flight(self) -> bool:
        """True while a call of this handle awaits its answer."""
        return self._sending.locked()

    async def model(self, fn: ModelFn) -> Any:
        """The response recorded at this position, or ``await fn()`` recorded.

        ``fn`` may return :class:`WithUsage` (the response and what the call
        spent): the journal records the usage with the response, and the
        call returns the response alone.

        The new response is stored with the handle's next call when that is the
        tool call it asks for or the commit, else on its own before that call,
        or as soon as the handler awaits anything else (see the module's
        invariants). A failed ``fn`` records nothing (the exception propagates).

        Raises:
            ReplayMismatch: a tool call was recorded at this position.
            Fenced: a successor holds the step.
            BudgetExceeded: the run spent its budget; nothing was called.
        """
        return await self._model(lambda _stream: fn(), streamed=False)

    async def streamed_model(self, fn: StreamedModelFn) -> Any:
        """As :meth:`model`, with a live preview: ``fn`` gets a
        :class:`TokenStream` to put its tokens on while it runs. Readers of the
        step's stream see them, then ``committed`` with the record's sequence
        once the response is stored, or ``abandoned`` when ``fn`` fails. A
        response already recorded is returned without calling ``fn``.
        """
        return await self._model(lambda live: fn(cast(TokenStream, live)), streamed=True)

    async def _model(
        self, fn: Callable[[TokenStream | None], Awaitable[Any]], *, streamed: bool
    ) -> Any:
        await self._end_loose()
        with self._turn() as position:
            begin = await self._begin_model(position)
            if begin.recorded:
                return decode(begin.response, field="response")
            live = TokenStream(self._rpc.put_stream, self._token, position) if streamed else None
            try:
                response = await fn(live)
            except BaseException:
                if live is not None:
                    await live.close(abandon=True)
                raise
            response, usage = _unwrapped(response)
            data = encode(response, field="response")
            if live is not None:
                await live.close()  # every chunk is published before the record's marker
            model = jpb.ModelCall(position=position, response=data)
            if usage is not None:
                model.usage.CopyFrom(usage)
                self._spent[position] = usage
            if model.ByteSize() <= PENDING_BYTES:
                await seam("model_pending")  # answered, and stored nowhere yet
                self._hold_back(_Pending(model=model))
            else:
                await self._send(self._record_model(model), self._advance)
                await seam("after_model")
            return response

    async def _begin_model(self, position: int) -> jpb.BeginModelResponse:
        """``BeginModel`` at ``position``, or its answer without the call when
        nothing can be recorded there and the tail is fresh (see the module's
        invariants); decided once a pending entry is stored, as every call is."""

        async def cleared() -> jpb.BeginModelResponse:
            return jpb.BeginModelResponse(recorded=False)

        def begin(token: jpb.WriterToken) -> Awaitable[jpb.BeginModelResponse]:
            if self._budget is not None:  # the budget's check is never skipped
                request = jpb.BeginModelRequest(token=token, position=position, budget=self._budget)
                return self._rpc.begin_model(request)
            if position >= token.replay_positions and self._tail_is_fresh():
                return cleared()  # the holder's last write was the check
            return self._rpc.begin_model(jpb.BeginModelRequest(token=token, position=position))

        def placed(answer: jpb.BeginModelResponse) -> None:
            if answer.HasField("token"):  # the check placed budget raises
                self._token = answer.token

        if self._budget is not None:
            return await self._send(begin, placed)
        return await self._send(begin, writes=False)

    def _tail_is_fresh(self) -> bool:
        checked = self._checked_at
        return checked is not None and asyncio.get_running_loop().time() - checked <= FRESH_TAIL

    def _record_model(
        self, model: jpb.ModelCall
    ) -> Callable[[jpb.WriterToken], Awaitable[jpb.RecordModelResponse]]:
        usage = model.usage if model.HasField("usage") else None
        return lambda t: self._rpc.record_model(
            jpb.RecordModelRequest(
                token=t, position=model.position, response=model.response, usage=usage
            )
        )

    def put_stream(self, chunk: Any) -> None:
        """Put a chunk on the live preview of the next call position (the
        spec's PutStream): text for a ``str``, JSON otherwise. Never waits."""
        if self._loose is None:
            self._loose = TokenStream(self._rpc.put_stream, self._token, self._position)
        self._loose.put(chunk)

    async def _end_loose(self) -> None:
        loose, self._loose = self._loose, None
        if loose is not None:
            await loose.close()

    async def tool(
        self, call: ToolCall, replay: Replay, fn: ToolFn, *, approval: bool = False
    ) -> ToolResult:
        """Run a tool call durably: intent before, result after (the result
        stored with the commit when that comes next, as :meth:`model`'s
        response is with its intent).

        ``fn`` gets a :class:`ToolRun` and returns the tool's output, which
        must be JSON. An exception from ``fn`` is the tool's own error and part
        of the result; it does not stop the step.

        ``approval``: the call runs only once an approver approved exactly
        these arguments (the approval bound to its arguments). Without an
        approval its intent is stored with the digest of its name and input,
        and :class:`ApprovalPending` is raised: the worker ends the iteration
        and the step waits, holding no worker, for the approval input. When
        the next iteration makes the same call, the approval placed for its
        digest decides: approved, the tool runs once (an unsafe call, whatever
        ``replay`` says); approved with edited arguments, it runs with those;
        denied, it does not run and the result's output is
        ``{"denied": true, "reason": ...}`` for the model to read.

        Raises:
            ApprovalPending: ``approval`` and no approval of these arguments
                was placed: the call waits (see above).
            InvalidArgument: the input or the output is not JSON.
            RecordTooLarge: the output is larger than a journal record holds;
                the call's intent is answered with that error. Unless the
                handler catches it, the step fails for good with its message.
            ReplayMismatch: a different call was recorded at this position.
            Fenced: a successor holds the step.
        """
        if approval:
            return await self._tool_with_approval(call, fn)
        return await self._tool(call, replay, fn)

    async def _tool_with_approval(self, call: ToolCall, fn: ToolFn) -> ToolResult:
        """:meth:`tool` for a call that needs approval: the approval placed for
        its digest decides, else it asks and waits (``ApprovalPending``)."""
        call, fn, digest, mark = await self._under_approval(call, fn)
        if mark is None:
            t, position = self._token, self._position
            key = f"{t.run_id}.{t.step_id}.{t.iteration}.{position}"
            await self._tool(call, Replay.UNSAFE, fn, digest=digest)
            raise ApprovalPending(key=key, digest=digest, name=call.name, input=call.input)
        return await self._tool(call, Replay.UNSAFE, fn, digest=digest, approval=mark)

    async def _under_approval(
        self, call: ToolCall, fn: ToolFn
    ) -> tuple[ToolCall, ToolFn, str, jpb.Approval | None]:
        """How a call that needs approval is made: the call (the approver's
        arguments, if edited), what runs (a denial's only returns it), its
        digest, and the approval it runs under; no approval placed for its
        digest: the call itself, which asks (no approval)."""
        data = encode(call.input, field="input")
        digest = approvals.call_digest(call.name, data)
        decision, request_id = await self._approval_for(call.name, data, digest)
        match decision:
            case None | approvals.ApprovalRefused():
                return call, fn, digest, None
            case approvals.Approved() | approvals.Edited():
                edited = isinstance(decision, approvals.Edited)
                runs = replace(call, input=decode(decision.input, field="args"))

                async def approved(run: ToolRun) -> Any:
                    output = await fn(run)
                    await seam("approved_tool_returned")  # ran once; its result unstored
                    return output

                mark = self._mark(decision, request_id, approved=True, edited=edited)
                return runs, approved, decision.digest, mark
            case approvals.Denied(reason=reason):

                async def denied(_run: ToolRun) -> Any:
                    return approvals.denial_output(reason)  # the tool does not run

                mark = self._mark(decision, request_id, approved=False, edited=False)
                return call, denied, digest, mark
            case _:
                assert_never(decision)

    async def _approval_for(
        self, name: str, data: bytes, digest: str
    ) -> tuple[approvals.ApprovalDecision | None, str]:
        """The decision of the first approval placed for ``digest`` not used yet
        in this dispatch, and its request id; the approvals queued for the step
        are placed by the dispatch's first call that needs one (a position of
        its own, replayed as any placement)."""
        if self._approvals is None:
            self._approvals = await self.place_inputs(InputMode.APPROVAL)
            await seam("after_approval_placed")
        for placed in self._approvals:
            act = approvals.act_of(placed.content)
            if act is None or act.digest != digest or placed.request_id in self._used_approvals:
                continue
            edited = approvals.call_digest(name, act.input) if act.input is not None else ""
            waiting = approvals.WaitingCall(key=act.key, name=name, input=data, digest=digest)
            decision = approvals.decide_approval(waiting, act, edited_digest=edited)
            if isinstance(decision, approvals.ApprovalRefused):
                log.warning("approval %s refused: %s", placed.request_id, decision.message)
                continue
            self._used_approvals.add(placed.request_id)
            return decision, placed.request_id
        return None, ""

    def _mark(
        self,
        decision: approvals.Approved | approvals.Edited | approvals.Denied,
        request_id: str,
        *,
        approved: bool,
        edited: bool,
    ) -> jpb.Approval:
        """The journal's record of ``decision``: who, when, the call and digest seen."""
        act = next(
            approvals.act_of(p.content) for p in self._approvals or () if p.request_id == request_id
        )
        assert act is not None
        return jpb.Approval(
            call=act.key,
            digest=act.digest,
            approved=approved,
            approver=act.approver,
            reason=act.reason,
            decided_at=timestamp(act.decided_at),
            request_id=request_id,
            edited=edited,
        )

    async def _tool(
        self,
        call: ToolCall,
        replay: Replay,
        fn: ToolFn,
        *,
        digest: str = "",
        approval: jpb.Approval | None = None,
    ) -> ToolResult:
        """:meth:`tool`; ``digest`` without ``approval``: the call asks for an
        approval, and its intent is answered ``awaiting_approval``, nothing run."""
        with self._turn() as position:
            t = self._token
            call = replace(call, key=f"{t.run_id}.{t.step_id}.{t.iteration}.{position}")
            data = encode(call.input, field="input")

            def begin_tool(
                token: jpb.WriterToken, pending: _Pending | None
            ) -> Awaitable[jpb.BeginToolResponse]:
                request = jpb.BeginToolRequest(
                    token=token,
                    position=position,
                    name=call.name,
                    input=data,
                    replay=jpb.REPLAY_SAFE if replay is Replay.SAFE else jpb.REPLAY_UNSAFE,
                    digest=digest,
                )
                if approval is not None:
                    request.approval.CopyFrom(approval)
                if pending is not None and pending.model is not None:
                    request.model.CopyFrom(pending.model)  # one record: response, then intent
                return self._rpc.begin_tool(request)

            def carries(pending: _Pending) -> bool:  # the response that asked for this call
                return pending.model is not None and pending.model.position == position - 1

            begin = await self._carrying(begin_tool, carries, self._advance)
            if not begin.run:
                return _result(begin.result, replayed=True)
            await seam("after_intent")
            if digest and approval is None:
                return await self._awaiting(begin.intent_seq)
            return await self._run(call, begin.intent_seq, fn)

    async def _awaiting(self, intent_seq: int, intent_index: int = 0) -> ToolResult:
        """Answer the intent of a call that asked for approval: it waits, nothing ran."""
        await seam("after_approval_intent")  # asked; not yet answered awaiting
        await self._write(
            lambda t: self._rpc.finish_tool(
                jpb.FinishToolRequest(
                    token=t,
                    intent_seq=intent_seq,
                    intent_index=intent_index,
                    awaiting_approval=True,
                )
            )
        )
        return ToolResult(awaiting_approval=True)

    async def tools(self, calls: Sequence[GroupCall]) -> list[ToolResult]:
        """Run the tool calls of one model response concurrently, durably: a
        parallel group. Give them in the response's order, each as
        ``(call, replay, fn)``, or ``(call, replay, fn, True)`` for a call that
        needs approval (as :meth:`tool` with ``approval=True``); they take
        that many positions, in that order, whatever order they finish in.

        Every call's intent is stored before any call starts (in one record
        when they fit, with the response that asked for them when that is
        pending); each call gets its own ``key``; each result is stored as it
        finishes; the results come back in the order of ``calls``. On a replay
        each call follows the rules of :meth:`tool` alone: a recorded result
        is reused, a safe call without one runs again, an unsafe one comes
        back ``interrupted``; a different group at this position (another
        count, name or input) is ``ReplayMismatch``.

        A call that needs approval and has none placed for its digest asks:
        its intent carries the digest, it is answered ``awaiting_approval``,
        and the group's other calls run; once their results are stored,
        :class:`ApprovalPending` is raised, naming every waiting call
        (``waiting``) and carrying the group's results (``results``). The
        next iteration makes the group again, and each such call finds its
        approval (or denial) by its digest.

        A call's exception is its own result: the others still run. A signal
        (``Fenced``, ``RunCancelled``) or an unrecordable output stops the
        group: its running calls are cancelled, and it raises that.

        Raises:
            InvalidArgument: an input or an output is not JSON.
            RecordTooLarge: an output is larger than a journal record holds.
            ReplayMismatch: another group, or another call, is recorded here.
            ApprovalPending: a call needs approval and has none.
            Fenced: a successor holds the step.
            RunCancelled: the run was cancelled.
        """
        if not calls:
            return []
        made: list[_GroupMember] = []
        for member in calls:
            call, replay, fn = member[0], member[1], member[2]
            if len(member) == 4 and member[-1] is True:  # the call needs approval
                call, fn, digest, mark = await self._under_approval(call, fn)
                made.append(_GroupMember(call, Replay.UNSAFE, fn, digest, mark))
            else:
                made.append(_GroupMember(call, replay, fn))
        with self._turn() as first:
            self._position += len(calls) - 1  # one position per call
            specs = [m.spec(field=f"calls[{i}].input") for i, m in enumerate(made)]

            def begin_tools(
                token: jpb.WriterToken, pending: _Pending | None
            ) -> Awaitable[jpb.BeginToolsResponse]:
                request = jpb.BeginToolsRequest(token=token, position=first, calls=specs)
                if pending is not None and pending.model is not None:
                    request.model.CopyFrom(pending.model)  # one record: response, then intents
                return self._rpc.begin_tools(request)

            def carries(pending: _Pending) -> bool:  # the response that asked for the group
                return pending.model is not None and pending.model.position == first - 1

            begun = await self._carrying(begin_tools, carries, self._advance)
            await seam("after_group_intents")
            results = await self._run_group(made, begun)
        waiting = [
            ApprovalPending(key=answer.key, digest=m.digest, name=m.call.name, input=m.call.input)
            for m, answer in zip(made, begun.calls, strict=True)
            if m.asks
        ]
        if waiting:
            first_waiting, *others = waiting
            # A call that asks waits, whatever its replayed ask was answered
            # (interrupted, when the holder that asked stopped before answering
            # it awaiting): it never ran, and waits for its approval as a call
            # alone does.
            waits = ToolResult(awaiting_approval=True)
            raise ApprovalPending(
                key=first_waiting.key,
                digest=first_waiting.digest,
                name=first_waiting.name,
                input=first_waiting.input,
                others=others,
                results=[waits if m.asks else r for m, r in zip(made, results, strict=True)],
            )
        return results

    async def _run_group(
        self, made: Sequence[_GroupMember], begun: jpb.BeginToolsResponse
    ) -> list[ToolResult]:
        """Run the calls ``begun`` says to run, at once; the results in order.
        A call that asks for approval is answered ``awaiting_approval``."""
        results: list[ToolResult | None] = [None] * len(made)
        running: dict[asyncio.Task[ToolResult], int] = {}
        stop = _GroupStop()
        for i, (m, answer) in enumerate(zip(made, begun.calls, strict=True)):
            if not answer.run:
                results[i] = _result(answer.result, replayed=True)
                continue
            if m.asks:
                member = self._awaiting(answer.intent_seq, answer.intent_index)
            else:
                keyed = replace(m.call, key=answer.key)
                member = self._run(
                    keyed, answer.intent_seq, m.fn, intent_index=answer.intent_index, stop=stop
                )
            running[asyncio.ensure_future(member)] = i
        try:
            pending = set(running)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if (err := task.exception()) is not None:
                        stop.signal = err
                        raise err
                    results[running[task]] = task.result()
        except BaseException:
            for task in running:
                task.cancel()
            await asyncio.wait(running)  # each answers its intent, if it may
            raise
        return [r for r in results if r is not None]

    async def _run(
        self,
        call: ToolCall,
        intent_seq: int,
        fn: ToolFn,
        *,
        intent_index: int = 0,
        stop: _GroupStop | None = None,
    ) -> ToolResult:
        """Run a begun call; ``stop``: it is one of a parallel group, whose
        result is stored at once (a pending entry is one call's)."""
        reported: list[str] = []

        async def report(chunk: str) -> None:
            await self._write(
                lambda t: self._rpc.tool_output(
                    jpb.ToolOutputRequest(
                        token=t, intent_seq=intent_seq, chunk=chunk, intent_index=intent_index
                    )
                ),
                lambda _: reported.append(chunk),  # stored, even if the caller was cancelled
            )

        error, data, raised = "", b"", None
        try:
            output = await fn(ToolRun(call=call, _report=report))
        except Exception as err:  # the tool's own error is part of its result
            error = f"{type(err).__name__}: {err}"
        except (asyncio.CancelledError, RunCancelled) as halt:
            # Stopped by its run's cancel (heard, or the journal's refusal of
            # its output or of a call of its group), not by a worker that
            # gives up: answer the intent.
            cancelled = stop is not None and isinstance(stop.signal, RunCancelled)
            if self._cancellation.is_set() or isinstance(halt, RunCancelled) or cancelled:
                await self._interrupted(intent_seq, "".join(reported), intent_index)
            raise
        else:
            try:
                data = encode(output, field="output")
            except InvalidArgument as err:
                error, raised = f"tool output is not JSON: {err.message}", err
        result = jpb.ToolResult(
            intent_seq=intent_seq, output=data, error=error, intent_index=intent_index
        )
        if stop is None and raised is None and result.ByteSize() <= PENDING_BYTES:
            await seam("result_pending")  # the tool returned; its intent is unanswered
            self._hold_back(_Pending(result=result))
        else:
            async with self._sending:
                await self._store_pending()
                result = await self._store_result(result, self._advance)
            await seam("after_result" if stop is None else "after_group_result")
        if raised is not None:
            raise raised
        data, error = result.output, result.error
        return ToolResult(output=decode(data, field="output") if data else None, error=error)

    async def _store_result(
        self, result: jpb.ToolResult, then: Callable[[jpb.FinishToolResponse], None]
    ) -> jpb.ToolResult:
        """FinishTool with ``result`` (the lock held); returns what was stored."""

        def finish(
            r: jpb.ToolResult,
        ) -> Callable[[jpb.WriterToken], Awaitable[jpb.FinishToolResponse]]:
            request = jpb.FinishToolRequest(
                intent_seq=r.intent_seq,
                intent_index=r.intent_index,
                output=r.output,
                error=r.error,
            )

            def send(t: jpb.WriterToken) -> Awaitable[jpb.FinishToolResponse]:
                request.token.CopyFrom(t)
                return self._rpc.finish_tool(request)

            return send

        try:
            await self._locked(finish(result), then)
        except RecordTooLarge as err:
            # The tool ran and its result cannot be stored: record that as the
            # tool's error, so that its intent has a result (a retry honours it
            # rather than run an unsafe tool again), then raise: another
            # delivery or attempt would be refused the same way.
            error = f"tool result not recorded: {err.message}"
            stored = jpb.ToolResult(
                intent_seq=result.intent_seq, intent_index=result.intent_index, error=error
            )
            await self._locked(finish(stored), then)
            raise
        return result

    async def _interrupted(self, intent_seq: int, partial: str, intent_index: int = 0) -> None:
        """Answer the intent of a tool its run's cancellation stopped: the run
        ends with a commit, and nothing answers an intent after that."""
        if self._fenced:
            return  # the successor answers it
        try:
            await self._write(
                lambda t: self._rpc.finish_tool(
                    jpb.FinishToolRequest(
                        token=t,
                        intent_seq=intent_seq,
                        intent_index=intent_index,
                        interrupted=True,
                        partial=partial,
                    )
                )
            )
        except (DagnatsError, Fenced, RunCancelled) as err:
            log.warning(
                "%s/%s: could not record the cancelled tool call at seq %d as interrupted: %s",
                self._token.run_id,
                self._token.step_id,
                intent_seq,
                err,
            )

    async def place_inputs(self, mode: InputMode) -> list[PlacedInput]:
        """Place the step's queued inputs of ``mode`` (see ``TaskContext.place_inputs``)."""
        with self._turn() as position:
            placed = await self._write(
                lambda t: self._rpc.place_inputs(
                    jpb.PlaceInputsRequest(token=t, position=position, mode=mode.value)
                )
            )
            await seam("after_inputs_placed")
            return [
                PlacedInput(
                    request_id=p.request_id,
                    mode=InputMode(p.mode),
                    content=decode(p.content, field="content") if p.content else None,
                )
                for p in placed.inputs
            ]

    async def check_tail(self) -> None:
        """Raise ``Fenced`` unless this holder still owns the step.

        Waits for a write in flight and checks with the token it returns.
        """
        await self._send(self._check_tail, writes=False, pending_first=False)

    async def _check_tail(self, token: jpb.WriterToken) -> jpb.CheckTailResponse:
        if self._committed:
            # The dispatch is over and only its report is left: no successor
            # claims a committed dispatch, and the commit moved the tail.
            return jpb.CheckTailResponse()
        return await self._rpc.check_tail(jpb.CheckTailRequest(token=token))

    async def commit(
        self, commit: jpb.Commit, *, lease: str, keep_task: bool = False
    ) -> jpb.NextDispatch | None:
        """Store the dispatch's commit and settle the task with ``lease``: once
        the commit is stored, the journal service answers, then publishes the
        commit's event and acknowledges the task. ``keep_task``: keep the
        task for the next iteration (the kept task); the dispatch it carries on to
        when the engine made it, else None."""

        def committed(done: jpb.CommitResponse) -> None:
            self._committed = True
            self._token = jpb.WriterToken()
            self._token.CopyFrom(request.token)
            self._token.last_seq = done.commit_seq  # the writer's last record

        await self._end_loose()
        request = jpb.CommitRequest(commit=commit, lease=lease, keep_task=keep_task)

        def send(token: jpb.WriterToken, pending: _Pending | None) -> Awaitable[jpb.CommitResponse]:
            request.token.CopyFrom(token)
            request.ClearField("leading")
            if pending is not None and pending.model is not None:
                request.model.CopyFrom(pending.model)  # one record: response, then commit
            elif pending is not None and pending.result is not None:
                request.tool_result.CopyFrom(pending.result)  # one record: result, then commit
            return self._rpc.commit(request)

        answer = await self._carrying(send, lambda _: True, committed)
        return answer.next if answer.HasField("next") else None

    async def close(self) -> None:
        """Stop storing a pending entry on its own, once the handler is done.

        A settled dispatch has nothing left here (its commit stored the entry or
        waited for it), nor has a fenced one anything it may write; a handler
        given up on leaves what a crash would. The worker calls this before it
        gives the dispatch's stream back. A write in flight is waited for.
        """
        if self._storing is not None:
            self._storing.cancel()
            await asyncio.wait((self._storing,))

    # ---- pending entries -------------------------------------------------------------

    def _hold_back(self, pending: _Pending) -> None:
        """Keep ``pending`` for the next call; store it on its own if the handler
        gives the event loop a turn first."""
        self._pending = pending
        asyncio.get_running_loop().call_soon(self._on_loop_turn, pending)

    def _on_loop_turn(self, pending: _Pending) -> None:
        if self._pending is pending and self._storing is None:
            self._storing = asyncio.ensure_future(self._store_apart())

    async def _store_apart(self) -> None:
        try:
            async with self._sending:
                if not self._fenced:
                    await self._store_pending()
        except (DagnatsError, Fenced, RunCancelled) as err:
            # Still pending (or fenced): the next call tries again and raises.
            log.debug(
                "%s/%s: a pending journal entry was not stored yet: %s",
                self._token.run_id,
                self._token.step_id,
                err,
            )
        finally:
            self._storing = None

    async def _store_pending(self) -> None:
        """Store the pending entry in a record of its own (the lock held)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        stored = False

        def advance(answer: _Written) -> None:
            nonlocal stored
            stored = True
            self._advance(answer)

        try:
            if pending.model is not None:
                await self._locked(self._record_model(pending.model), advance)
            else:
                assert pending.result is not None
                await self._store_result(pending.result, advance)
        except BaseException:
            if not stored and not self._fenced:
                self._pending = replace(pending, alone=True)
            raise
        await seam("after_model" if pending.model is not None else "after_result")

    async def _carrying(
        self,
        rpc: Callable[[jpb.WriterToken, _Pending | None], Awaitable[R]],
        carries: Callable[[_Pending], bool],
        then: Callable[[R], None],
    ) -> R:
        """A call whose record may carry the pending entry, if ``carries`` says
        it can; else the entry is stored on its own first. A call refused as a
        whole (an invalid argument, a record too large, a replay mismatch)
        stored nothing, and the two are sent apart, as separate calls would be."""
        async with self._sending:
            pending = self._pending
            if pending is not None and (pending.alone or not carries(pending)):
                await self._store_pending()
                pending = None
            if pending is None:
                return await self._locked(lambda t: rpc(t, None), then)
            self._pending = None
            answered = False

            def done(answer: R) -> None:
                nonlocal answered
                answered = True
                then(answer)

            try:
                return await self._locked(lambda t: rpc(t, pending), done)
            except (InvalidArgument, ReplayMismatch):
                self._pending = pending  # refused before anything was written
            except BaseException:
                if not answered and not self._fenced:
                    self._pending = replace(pending, alone=True)
                raise
            await self._store_pending()
            return await self._locked(lambda t: rpc(t, None), then)

    def _turn(self) -> _Turn:
        if self._cancellation.is_set():
            # Heard from the engine: no model call or tool starts, whatever
            # the freshness of this holder's last write.
            raise RunCancelled(self._token.run_id, step_id=self._token.step_id)
        if self._busy:
            raise ConcurrentJournalUse(
                "two asyncio tasks used one journal handle at once; make journaled calls "
                "one at a time"
            )
        if self._fenced:
            raise Fenced(self._token.run_id, self._token.step_id)
        return _Turn(self)

    async def _write(
        self,
        rpc: Callable[[jpb.WriterToken], Awaitable[W]],
        then: Callable[[W], None] | None = None,
    ) -> W:
        """A call that may append: the token it answers with is the next one."""

        def advance(answer: W) -> None:
            self._advance(answer)
            if then is not None:
                then(answer)

        return await self._send(rpc, advance)

    def _advance(self, answer: _Written) -> None:
        self._token = answer.token

    async def _send(
        self,
        rpc: Callable[[jpb.WriterToken], Awaitable[R]],
        then: Callable[[R], None] | None = None,
        *,
        writes: bool = True,
        pending_first: bool = True,
    ) -> R:
        """Call ``rpc`` with the newest token once no other call is in flight;
        ``then`` sees the answer before the next call goes out. A pending entry
        is stored on its own first, unless ``pending_first`` is false.
        """
        async with self._sending:
            if pending_first:
                await self._store_pending()
            return await self._locked(rpc, then, writes=writes)

    async def _locked(
        self,
        rpc: Callable[[jpb.WriterToken], Awaitable[R]],
        then: Callable[[R], None] | None = None,
        *,
        writes: bool = True,
    ) -> R:
        """:meth:`_send`'s call, the lock held.

        A call that ``writes``, cancelled here, is waited for before the
        cancellation goes on: its write may land all the same, and the next
        write (an interrupted result, the commit) must follow it rather than
        reuse its identity.
        """
        if self._fenced:
            raise Fenced(self._token.run_id, self._token.step_id)
        if not writes:
            return await self._exchange(rpc, then)
        # The call runs in a task of its own, which a cancellation here does
        # not reach. The task hands over its answer itself, not through a
        # done callback as asyncio.shield would: a loop turn less per write.
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(_answer(answer, self._exchange(rpc, then)))
        try:
            return await answer
        except asyncio.CancelledError:
            await asyncio.wait((call,))  # what it raised is for nobody now
            raise

    async def _exchange(
        self, rpc: Callable[[jpb.WriterToken], Awaitable[R]], then: Callable[[R], None] | None
    ) -> R:
        sent, last = asyncio.get_running_loop().time(), self._token.last_seq
        try:
            answer = await rpc(self._token)
        except Fenced:
            self._fenced = True
            await self._report_spent()
            raise
        if then is not None:
            then(answer)
        if self._token.last_seq != last:  # stored after the tail this handle held when sent
            self._checked_at = sent
        return answer

    async def _report_spent(self) -> None:
        """Report what this fenced handle's model calls spent to the step's
        spent subject: each one, since which of them the journal stored is not
        known here; the ledger charges a call stored in the step's journal and
        reported too once. Best effort: a failure is logged."""
        spent, self._spent = self._spent, {}
        for position, usage in spent.items():
            request = jpb.RecordSpentRequest(token=self._token, position=position, usage=usage)
            try:
                await self._rpc.record_spent(request)
            except (DagnatsError, Fenced, RunCancelled) as err:
                log.warning(
                    "%s/%s: the usage of a fenced model call was not recorded: %s",
                    self._token.run_id,
                    self._token.step_id,
                    err,
                )


def _unwrapped(response: Any) -> tuple[Any, jpb.Usage | None]:
    """A model function's answer and its usage, when it returned ``WithUsage``."""
    if isinstance(response, WithUsage):
        return response.value, usage_to_proto(response.usage)
    return response, None


async def _answer(answer: asyncio.Future[R], call: Awaitable[R]) -> None:
    """Settle ``answer`` with the outcome of ``call``, unless its waiter left."""
    try:
        result = await call
    except asyncio.CancelledError:
        answer.cancel()  # the task itself was cancelled: so is its waiter
        raise
    except BaseException as err:  # an error, or a journal signal such as Fenced
        if not answer.done():
            answer.set_exception(err)
    else:
        if not answer.done():
            answer.set_result(result)


@dataclass(frozen=True, slots=True)
class _GroupMember:
    """One call of a parallel group as it is made: with a ``digest`` and no
    ``approval``, it asks for approval (``asks``) and runs nothing."""

    call: ToolCall
    replay: Replay
    fn: ToolFn
    digest: str = ""
    approval: jpb.Approval | None = None

    @property
    def asks(self) -> bool:
        return bool(self.digest) and self.approval is None

    def spec(self, *, field: str) -> jpb.ToolCallSpec:
        spec = jpb.ToolCallSpec(
            name=self.call.name,
            input=encode(self.call.input, field=field),
            replay=jpb.REPLAY_SAFE if self.replay is Replay.SAFE else jpb.REPLAY_UNSAFE,
            digest=self.digest,
        )
        if self.approval is not None:
            spec.approval.CopyFrom(self.approval)
        return spec


class _GroupStop:
    """What stopped a parallel group: the signal one of its calls raised."""

    __slots__ = ("signal",)

    def __init__(self) -> None:
        self.signal: BaseException | None = None


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
        awaiting_approval=result.awaiting_approval,
    )
