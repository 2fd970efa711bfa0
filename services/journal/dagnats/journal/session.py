"""The Session stream: one dispatch's journal calls over one gRPC stream.

A unary call costs a new HTTP/2 stream with its headers and trailers; a message
on an open stream costs a fraction of that, and a journaled turn makes several
calls in a row. Each request runs the servicer's own method for its call (the
same checks, replay rules and fenced writes as the unary RPC) inside a SERVER
span whose parent is the trace context the request carries, so a fenced write
is an event in the worker's trace. Requests are answered one at a time, in
order. A domain error answers its request and the stream goes on, and so does
a failure the unary call would turn into a retriable status (NATS that did not
answer in time, a stream electing its leader: ``grpcutil.as_domain_error``),
with the same status, code and field; any other exception ends the stream with
UNKNOWN, as it would end a unary call. A call on the stream has no deadline of
its own, so the stores retry transient errors for their own budget (see
``dagnats.core.deadline``).

The local transport (``dagnats.engine.local_transport``) answers the same
calls off gRPC, on the local socket and in the services' process, through
:func:`answered` and :func:`session_error` here.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from dagnats.core import deadline, errors, tracing
from dagnats.core.grpcutil import (
    Context,
    WireError,
    as_domain_error,
    status_of,
    wire_details,
    wire_status,
)
from dagnats.core.session_calls import CALLS, SERVICE
from dagnats.journal.v1 import journal_pb2 as pb

Behaviour = Callable[[Any, Any, Context | None], Awaitable[Any]]
log = logging.getLogger(__name__)
T = TypeVar("T")


def behaviours(servicer_class: type) -> dict[str, Behaviour]:
    """Each call's method of ``servicer_class``, without the decorator that
    turns its domain errors into a status (here they answer the request)."""
    return {kind: inspect.unwrap(getattr(servicer_class, rpc)) for kind, rpc in CALLS.items()}


async def serve(
    servicer: object,
    methods: dict[str, Behaviour],
    requests: AsyncIterator[pb.SessionRequest],
    context: Context,
) -> AsyncIterator[pb.SessionResponse]:
    async for request in requests:
        yield await _answer(servicer, methods, request, context)


async def _answer(
    servicer: object,
    methods: dict[str, Behaviour],
    request: pb.SessionRequest,
    context: Context | None,
) -> pb.SessionResponse:
    kind = request.WhichOneof("call")
    if kind is None:
        missing = errors.InvalidArgument("the request names no call", field="call")
        return failed(request.id, missing)
    call = methods[kind](servicer, getattr(request, kind), context)
    answer = await answered(SERVICE + CALLS[kind], request.trace_context, call)
    if isinstance(answer, WireError):
        return failed(request.id, answer)
    response = pb.SessionResponse(id=request.id)
    getattr(response, kind).CopyFrom(answer)
    return response


async def answered(
    method: str, trace_context: Mapping[str, str], call: Awaitable[T]
) -> T | WireError:
    """``call``'s answer, awaited inside a SERVER span of ``method`` whose
    parent is ``trace_context``, with no deadline of its own; a domain error
    (or a retriable failure, ``as_domain_error``) is returned, not raised.

    Raises:
        Exception: any other failure, a server error.
    """
    parent = tracing.extract(trace_context)
    with tracing.server_span(method, parent) as span:
        try:
            with deadline.serving(None):
                return await call
        except (Exception, errors.Fenced, errors.RunCancelled) as err:
            if (domain := as_domain_error(err)) is None:
                raise
            tracing.set_status(span, status_of(domain), domain.message, server=True)
            return domain


def failed(request_id: int, err: WireError) -> pb.SessionResponse:
    """The answer of a request that ended with ``err``."""
    return pb.SessionResponse(id=request_id, error=session_error(err))


def session_error(err: WireError) -> pb.SessionError:
    """``err`` as the status its own RPC would have ended with."""
    status, message, field = wire_status(err)
    return pb.SessionError(
        status=status.value[0],
        message=message,
        code=err.code,
        field=field,
        details=wire_details(err),
    )
