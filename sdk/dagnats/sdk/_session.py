"""One dispatch's journal calls over one ``JournalService.Session`` stream.

A journaled turn makes a call per record (claim, model, tool intent and result,
commit); on an open stream each costs a message each way instead of a new
call, which is most of the journal's overhead over the raw appends.

Invariants:

- One call at a time: the journal handle sends one call at a time, and the
  claim comes before the handle exists. Answers come in order, so the next
  answer on the stream is always the pending call's.
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
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from opentelemetry.trace import Span

from dagnats.core import tracing
from dagnats.core.grpcutil import WireError, error_from_status, status_code
from dagnats.core.session_calls import CALLS, SERVICE
from dagnats.journal.v1 import journal_pb2 as jpb

if TYPE_CHECKING:
    from dagnats.sdk._rpc import EngineRpc, Lease, SessionStream

Resp = TypeVar("Resp", bound=Message)


class JournalCalls(Protocol):
    """The journal calls a journal handle makes: ``EngineRpc`` makes each its
    own RPC, ``JournalSession`` sends them on one stream."""

    async def begin_model(self, request: jpb.BeginModelRequest) -> jpb.BeginModelResponse: ...
    async def record_model(self, request: jpb.RecordModelRequest) -> jpb.RecordModelResponse: ...
    async def begin_tool(self, request: jpb.BeginToolRequest) -> jpb.BeginToolResponse: ...
    async def tool_output(self, request: jpb.ToolOutputRequest) -> jpb.ToolOutputResponse: ...
    async def finish_tool(self, request: jpb.FinishToolRequest) -> jpb.FinishToolResponse: ...
    async def hold(self, request: jpb.HoldRequest) -> jpb.HoldResponse: ...
    async def place_inputs(self, request: jpb.PlaceInputsRequest) -> jpb.PlaceInputsResponse: ...
    async def commit(self, request: jpb.CommitRequest) -> jpb.CommitResponse: ...
    async def put_stream(
        self, requests: AsyncIterator[jpb.PutStreamRequest]
    ) -> jpb.PutStreamResponse: ...


class JournalSession:
    """The journal calls of one dispatch, on a stream opened by the first call.

    With ``lease`` (the dispatch's), a call whose transport fails is tried again
    for as long as the lease lasts; without, for the RPC policy's budget.
    """

    def __init__(self, rpc: EngineRpc, *, lease: Lease | None = None) -> None:
        self._rpc = rpc
        self._lease = lease
        self._stream: SessionStream | None = None
        self._sent = 0

    def close(self) -> None:
        """Give the stream back for the next dispatch; a later call takes one again."""
        stream, self._stream = self._stream, None
        if stream is not None:  # no call is pending on it: a call that failed dropped it
            self._rpc.release_session(stream)

    async def put_stream(
        self, requests: AsyncIterator[jpb.PutStreamRequest]
    ) -> jpb.PutStreamResponse:
        return await self._rpc.put_stream(requests)

    async def claim(self, request: jpb.ClaimRequest) -> jpb.ClaimResponse:
        # A claim whose answer was lost may have landed: claiming again fences it,
        # and the restart limit counts it, which costs less than the attempt.
        return await self._call("claim", request, jpb.ClaimResponse)

    async def begin_model(self, request: jpb.BeginModelRequest) -> jpb.BeginModelResponse:
        return await self._call("begin_model", request, jpb.BeginModelResponse)

    async def record_model(self, request: jpb.RecordModelRequest) -> jpb.RecordModelResponse:
        return await self._call("record_model", request, jpb.RecordModelResponse)

    async def begin_tool(self, request: jpb.BeginToolRequest) -> jpb.BeginToolResponse:
        return await self._call("begin_tool", request, jpb.BeginToolResponse)

    async def tool_output(self, request: jpb.ToolOutputRequest) -> jpb.ToolOutputResponse:
        return await self._call("tool_output", request, jpb.ToolOutputResponse)

    async def finish_tool(self, request: jpb.FinishToolRequest) -> jpb.FinishToolResponse:
        return await self._call("finish_tool", request, jpb.FinishToolResponse)

    async def hold(self, request: jpb.HoldRequest) -> jpb.HoldResponse:
        return await self._call("hold", request, jpb.HoldResponse)

    async def place_inputs(self, request: jpb.PlaceInputsRequest) -> jpb.PlaceInputsResponse:
        return await self._call("place_inputs", request, jpb.PlaceInputsResponse)

    async def commit(self, request: jpb.CommitRequest) -> jpb.CommitResponse:
        return await self._call("commit", request, jpb.CommitResponse)

    async def _call(self, kind: str, request: Message, answer_type: type[Resp]) -> Resp:
        """Call ``kind`` (the request's field in ``SessionRequest``) on the stream.
        Every journal call is safe to repeat (see ``_rpc``)."""
        name = CALLS[kind]

        async def attempt() -> Resp:
            return await self._exchange(kind, name, request, answer_type)

        return await self._rpc.retrying(name, attempt, idempotent=True, lease=self._lease)

    async def _exchange(
        self, kind: str, name: str, request: Message, answer_type: type[Resp]
    ) -> Resp:
        """Send one request and read its answer; ``AioRpcError`` if the stream failed."""
        if self._stream is None or self._stream.done():  # a stream that ended is dropped
            self._stream = self._rpc.open_session()
        stream = self._stream
        self._sent += 1
        carrier: dict[str, str] = {}
        with tracing.client_span(SERVICE + name, carrier) as span:
            message = jpb.SessionRequest(id=self._sent, trace_context=carrier)
            getattr(message, kind).CopyFrom(request)
            try:
                async with asyncio.timeout(self._rpc.timeout):
                    await stream.write(message)
                    answer = await stream.read()
            except TimeoutError:
                self._drop(stream)
                raise _failure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: no answer") from None
            except grpc.aio.AioRpcError as err:
                self._drop(stream)
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise  # no journal service there: no retry gets past it
                # Domain errors answer their request; a status ends the stream
                # itself (a server shutting down, a stream idle too long in a
                # proxy), and the call is tried again on a new one.
                raise _failure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{name}: the session stream failed: {err.code().name}: {err.details()}",
                ) from None
            except asyncio.InvalidStateError:  # it ended before the request went out
                self._drop(stream)
                raise _failure(grpc.StatusCode.UNAVAILABLE, f"{name}: the stream ended") from None
            except BaseException:  # cancelled: the answer, if any, is for nobody
                self._drop(stream)
                raise
            if not isinstance(answer, jpb.SessionResponse) or answer.id != message.id:
                self._drop(stream)
                raise _failure(grpc.StatusCode.UNAVAILABLE, f"{name}: the session stream ended")
            result = answer.WhichOneof("result")
            if result == "error":
                raise answered_error(span, answer.error)
            tracing.set_status(span, grpc.StatusCode.OK, "", server=False)
            found = getattr(answer, kind) if result == kind else None
            if not isinstance(found, answer_type):
                self._drop(stream)
                raise _failure(grpc.StatusCode.INTERNAL, f"{name} was answered with {result}")
            return found

    def _drop(self, stream: SessionStream) -> None:
        stream.cancel()
        if self._stream is stream:
            self._stream = None


def answered_error(span: Span, error: jpb.SessionError) -> WireError:
    """The domain error a call on a session (or a poll on the socket) was
    answered with, as its own RPC would have raised it; its span says so."""
    status = status_code(error.status)
    tracing.set_status(span, status, error.message, server=False)
    return error_from_status(status, error.message, error.code, error.field, dict(error.details))


def _failure(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A stream failure in the form the retry rules read."""
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, empty, empty, details=details, debug_error_string="")
