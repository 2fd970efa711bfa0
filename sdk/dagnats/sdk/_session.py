"""One dispatch's journal calls over one ``JournalService.Session`` stream.

A journaled turn makes a call per record (claim, model, tool intent and result,
commit); on an open stream each costs a message each way instead of a new
call, which is most of the journal's overhead over the raw appends.

Invariants:

- One call at a time: the journal handle sends one call at a time, and the
  claim comes before the handle exists. Answers come in order, so the next
  answer on the session is always the pending call's.
- A session is a gRPC ``Session`` stream (:class:`GrpcSession`), a
  connection to the local socket (``LocalConnection``), or, for the handlers
  the services run, their method table called in the process
  (``dagnats.engine.local_transport.LocalSession``): each takes a call by its
  gRPC method's name (:class:`Session`).
- A call whose answer did not arrive (cancelled, timed out, the stream broke)
  drops the stream: its answer would be taken for the next call's. The next
  call opens a new stream.
- A stream with no call pending goes back to ``EngineRpc`` when the dispatch
  ends, for the next dispatch to use: opening one costs about as much as a
  unary call.
- The rules of the unary calls apply unchanged: the same deadline per attempt,
  the same retries (``EngineRpc.retrying``: for as long as the dispatch's lease
  lasts), and the same domain errors, which answer their call and leave the
  stream open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from dagnats.core import tracing
from dagnats.core.frames import TransportError
from dagnats.core.grpcutil import status_of
from dagnats.core.session_calls import CALLS, SERVICE
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._errors import ANSWERED, answered_error

if TYPE_CHECKING:
    from dagnats.sdk._rpc import EngineRpc, Lease

Resp = TypeVar("Resp", bound=Message)
# The journal call of each gRPC method a Session stream carries.
_KINDS = {SERVICE + rpc: kind for kind, rpc in CALLS.items()}


class Session(Protocol):
    """Where one dispatch's journal calls go, one at a time."""

    async def call(
        self, method: str, request: Message, answer: type[Resp], trace_context: Mapping[str, str]
    ) -> Resp:
        """``method``'s answer; its domain error raised as its RPC raises it,
        ``TransportError`` or ``AioRpcError`` when the way there failed."""
        ...

    def done(self) -> bool: ...
    def cancel(self) -> bool: ...


class JournalCalls(Protocol):
    """The journal calls a journal handle makes: ``EngineRpc`` makes each its
    own RPC, ``JournalSession`` sends them on one stream."""

    async def begin_model(self, request: jpb.BeginModelRequest) -> jpb.BeginModelResponse: ...
    async def record_model(self, request: jpb.RecordModelRequest) -> jpb.RecordModelResponse: ...
    async def record_spent(self, request: jpb.RecordSpentRequest) -> jpb.RecordSpentResponse: ...
    async def begin_tool(self, request: jpb.BeginToolRequest) -> jpb.BeginToolResponse: ...
    async def begin_tools(self, request: jpb.BeginToolsRequest) -> jpb.BeginToolsResponse: ...
    async def tool_output(self, request: jpb.ToolOutputRequest) -> jpb.ToolOutputResponse: ...
    async def finish_tool(self, request: jpb.FinishToolRequest) -> jpb.FinishToolResponse: ...
    async def check_tail(self, request: jpb.CheckTailRequest) -> jpb.CheckTailResponse: ...
    async def place_inputs(self, request: jpb.PlaceInputsRequest) -> jpb.PlaceInputsResponse: ...
    async def commit(self, request: jpb.CommitRequest) -> jpb.CommitResponse: ...
    async def put_stream(
        self, requests: AsyncIterator[jpb.PutStreamRequest]
    ) -> jpb.PutStreamResponse: ...


class JournalSession:
    """The journal calls of one dispatch, on a session opened by the first call.

    With ``lease`` (the dispatch's), a call whose transport fails is tried again
    for as long as the lease lasts; without, for the RPC policy's budget.
    """

    def __init__(self, rpc: EngineRpc, *, lease: Lease | None = None) -> None:
        self._rpc = rpc
        self._lease = lease
        self._session: Session | None = None

    def close(self) -> None:
        """Give the session back for the next dispatch; a later call takes one again."""
        session, self._session = self._session, None
        if session is not None:  # no call is pending on it: a call that failed dropped it
            self._rpc.release_session(session)

    async def put_stream(
        self, requests: AsyncIterator[jpb.PutStreamRequest]
    ) -> jpb.PutStreamResponse:
        return await self._rpc.put_stream(requests)

    async def claim(self, request: jpb.ClaimRequest) -> jpb.ClaimResponse:
        # A claim whose answer was lost may have landed: claiming again fences it,
        # and the restart limit counts it, which costs less than the attempt.
        return await self._call("Claim", request, jpb.ClaimResponse)

    async def begin_model(self, request: jpb.BeginModelRequest) -> jpb.BeginModelResponse:
        return await self._call("BeginModel", request, jpb.BeginModelResponse)

    async def record_model(self, request: jpb.RecordModelRequest) -> jpb.RecordModelResponse:
        return await self._call("RecordModel", request, jpb.RecordModelResponse)

    async def record_spent(self, request: jpb.RecordSpentRequest) -> jpb.RecordSpentResponse:
        return await self._call("RecordSpent", request, jpb.RecordSpentResponse)

    async def begin_tool(self, request: jpb.BeginToolRequest) -> jpb.BeginToolResponse:
        return await self._call("BeginTool", request, jpb.BeginToolResponse)

    async def begin_tools(self, request: jpb.BeginToolsRequest) -> jpb.BeginToolsResponse:
        return await self._call("BeginTools", request, jpb.BeginToolsResponse)

    async def tool_output(self, request: jpb.ToolOutputRequest) -> jpb.ToolOutputResponse:
        return await self._call("ToolOutput", request, jpb.ToolOutputResponse)

    async def finish_tool(self, request: jpb.FinishToolRequest) -> jpb.FinishToolResponse:
        return await self._call("FinishTool", request, jpb.FinishToolResponse)

    async def check_tail(self, request: jpb.CheckTailRequest) -> jpb.CheckTailResponse:
        return await self._call("CheckTail", request, jpb.CheckTailResponse)

    async def place_inputs(self, request: jpb.PlaceInputsRequest) -> jpb.PlaceInputsResponse:
        return await self._call("PlaceInputs", request, jpb.PlaceInputsResponse)

    async def commit(self, request: jpb.CommitRequest) -> jpb.CommitResponse:
        return await self._call("Commit", request, jpb.CommitResponse)

    async def _call(self, name: str, request: Message, answer: type[Resp]) -> Resp:
        """Call the journal's RPC ``name`` on the session. Every journal call
        is safe to repeat (see ``_rpc``)."""

        async def attempt() -> Resp:
            return await self._exchange(name, request, answer)

        return await self._rpc.retrying(name, attempt, idempotent=True, lease=self._lease)

    async def _exchange(self, name: str, request: Message, answer: type[Resp]) -> Resp:
        """Send one call and read its answer; ``TransportError`` (or
        ``AioRpcError`` UNIMPLEMENTED) if the session failed."""
        if self._session is None or self._session.done():  # a session that ended is dropped
            self._session = self._rpc.open_session()
        session = self._session
        carrier: dict[str, str] = {}
        with tracing.client_span(SERVICE + name, carrier) as span:
            try:
                async with asyncio.timeout(self._rpc.timeout):
                    found = await session.call(SERVICE + name, request, answer, carrier)
            except ANSWERED as err:  # answers its call: the session goes on
                tracing.set_status(span, status_of(err), err.message, server=False)
                raise
            except TimeoutError:
                self._drop(session)
                raise TransportError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: no answer"
                ) from None
            except (grpc.aio.AioRpcError, TransportError) as err:
                self._drop(session)
                code = err.code() if isinstance(err, grpc.aio.AioRpcError) else err.code
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    raise  # no journal service there: no retry gets past it
                # Domain errors answer their call; a status ends the session
                # itself (a server shutting down, a stream idle too long in a
                # proxy), and the call is tried again on a new one.
                details = err.details() if isinstance(err, grpc.aio.AioRpcError) else err.message
                raise TransportError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{name}: the session failed: {code.name}: {details}",
                ) from None
            except BaseException:  # cancelled: the answer, if any, is for nobody
                self._drop(session)
                raise
            tracing.set_status(span, grpc.StatusCode.OK, "", server=False)
            return found

    def _drop(self, session: Session) -> None:
        session.cancel()
        if self._session is session:
            self._session = None


class GrpcSession:
    """A journal ``Session`` stream on gRPC, as a :class:`Session`: each call
    a ``SessionRequest`` whose field names it, answered in order."""

    def __init__(
        self, stream: grpc.aio.StreamStreamCall[jpb.SessionRequest, jpb.SessionResponse]
    ) -> None:
        self._stream = stream
        self._sent = 0

    async def call(
        self, method: str, request: Message, answer: type[Resp], trace_context: Mapping[str, str]
    ) -> Resp:
        kind = _KINDS[method]
        self._sent += 1
        message = jpb.SessionRequest(id=self._sent, trace_context=trace_context)
        getattr(message, kind).CopyFrom(request)
        try:
            await self._stream.write(message)
        except asyncio.InvalidStateError:  # it ended before the request went out
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "the stream ended") from None
        found = await self._stream.read()
        if not isinstance(found, jpb.SessionResponse) or found.id != message.id:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "the session stream ended")
        result = found.WhichOneof("result")
        if result == "error":
            raise answered_error(found.error)
        value = getattr(found, kind) if result == kind else None
        if not isinstance(value, answer):
            raise TransportError(grpc.StatusCode.INTERNAL, f"{method} was answered with {result}")
        return value

    def done(self) -> bool:
        return self._stream.done()

    def cancel(self) -> bool:
        return self._stream.cancel()
