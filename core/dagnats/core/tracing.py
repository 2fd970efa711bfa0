"""OpenTelemetry trace context across gRPC calls and NATS messages.

A trace crosses three kinds of hop: gRPC calls (metadata), NATS messages
(headers) and protobuf messages stored in JetStream (their ``trace_context`` map).
All three carry the W3C ``traceparent``/``tracestate`` pair through the globally
configured propagator (``opentelemetry.propagate``), so :func:`inject` and
:func:`extract` are the only two calls the rest of the code needs.

This module never installs a TracerProvider: that is the application's choice.
Without one, spans are no-ops but the incoming context is still passed on.
When there is no provider and no context to pass on (none came in and none is
current), no span is made at all: a no-op span of an empty context records
nothing and writes nothing into a carrier, and making one is most of what a
message costs the tracing (see :func:`quiet`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from dagnats.core.grpcutil import with_metadata

__all__ = [
    "client_interceptors",
    "client_span",
    "extract",
    "inject",
    "quiet",
    "server_interceptors",
    "server_span",
    "set_status",
    "span",
    "tracer",
]

tracer = trace.get_tracer("dagnats")

# Server-side codes that mean the server failed, not the caller (OpenTelemetry
# semantic conventions for RPC spans); any other non-OK code is the client's fault
# and only marks the client span.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

if TYPE_CHECKING:
    _UnaryUnaryClient = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamClient = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _Server = grpc.aio.ServerInterceptor[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the runtime classes are not generic
    _UnaryUnaryClient = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStreamClient = grpc.aio.UnaryStreamClientInterceptor
    _Server = grpc.aio.ServerInterceptor
    _Handler = grpc.RpcMethodHandler


def inject(carrier: dict[str, str]) -> None:
    """Write the current trace context into ``carrier`` (NATS headers, a proto map)."""
    if otel_context.get_current():  # an empty context has nothing to write
        propagate.inject(carrier)


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The trace context carried by ``carrier``; use it as a span's parent."""
    if not carrier:
        return otel_context.Context()  # what every propagator makes of nothing
    return propagate.extract(carrier)


_installed = False  # a TracerProvider was installed; it is never taken back
# A provider named in the environment is installed by the first span.
_FROM_ENV = OTEL_PYTHON_TRACER_PROVIDER in os.environ
_UNKNOWN = object()


def quiet(parent: otel_context.Context | None = None) -> bool:
    """Whether a span would do nothing: no TracerProvider is installed, and
    neither ``parent`` nor the current context holds anything to pass on.

    Such a span is a no-op that records nothing and gives a carrier nothing,
    so the callers below make none. A provider, once installed, stays: the
    global one is set once.
    """
    global _installed
    if parent or otel_context.get_current():
        return False
    if not _installed:
        _installed = _provider_set()
    return not _installed


def _provider_set() -> bool:
    # trace.get_tracer_provider() looks in os.environ on every call until a
    # provider is set: microseconds, on every message. The API module's global
    # says the same at once; asked only where it has none (another version).
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:
        found = trace.get_tracer_provider()
        return not isinstance(found, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
    return _FROM_ENV or provider is not None


# What the callers get instead of a span when tracing is quiet.
_NO_SPAN: AbstractContextManager[Span] = contextlib.nullcontext(trace.INVALID_SPAN)


def span(
    name: str,
    parent: otel_context.Context,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, str | int] | None = None,
) -> AbstractContextManager[Span]:
    """The current span ``name``, a child of ``parent``; none when
    :func:`quiet` (the span given is then the invalid no-op span)."""
    if quiet(parent):
        return _NO_SPAN
    return tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(target, interceptors=...)``.

    Each unary-unary and unary-stream call gets a CLIENT span named after the
    method, and the span's context travels in the call metadata.
    """
    # Two objects, not one implementing both interfaces: grpc.aio.Channel files each
    # interceptor under the first kind it matches only (grpc/grpc#31442, #43512).
    return [
        cast("grpc.aio.ClientInterceptor", _UnaryUnaryTracing()),
        cast("grpc.aio.ClientInterceptor", _UnaryStreamTracing()),
    ]


def server_interceptors() -> list[grpc.aio.ServerInterceptor[Any, Any]]:
    """Interceptors for ``grpc.aio.server(interceptors=...)``.

    Each async unary-unary and unary-stream handler runs inside a SERVER span
    whose parent is the context found in the invocation metadata.
    """
    return [_ServerInterceptor()]


class _UnaryUnaryTracing(_UnaryUnaryClient):
    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        if quiet():
            return await continuation(client_call_details, request)
        span = _start_client_span(client_call_details.method)
        call: grpc.aio.UnaryUnaryCall[Any, Any] | None = None
        try:
            call = await continuation(_with_trace_metadata(client_call_details, span), request)
            code = await call.code()
            _set_grpc_status(span, code, await call.details(), error_codes=None)
        except BaseException as exc:
            # The caller's cancel() only reaches this task while it runs, not the call.
            if call is not None:
                call.cancel()
            _record_exception(span, exc)
            raise
        finally:
            span.end()
        return call


class _UnaryStreamTracing(_UnaryStreamClient):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> AsyncIterator[Any]:
        if quiet():
            return await continuation(client_call_details, request)  # type: ignore[no-any-return]
        span = _start_client_span(client_call_details.method)
        try:
            call = await continuation(_with_trace_metadata(client_call_details, span), request)
        except BaseException as exc:
            _record_exception(span, exc)
            span.end()
            raise
        return _traced_responses(call, span)


async def _traced_responses(call: AsyncIterator[Any], span: Span) -> AsyncIterator[Any]:
    # The span ends when the stream does, not when the call was started.
    try:
        async for response in call:
            yield response
        _set_grpc_status(span, grpc.StatusCode.OK, "", error_codes=None)
    except grpc.aio.AioRpcError as exc:
        _set_grpc_status(span, exc.code(), exc.details() or "", error_codes=None)
        raise
    except BaseException as exc:
        _record_exception(span, exc)
        raise
    finally:
        span.end()


class _ServerInterceptor(_Server):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler
        method = handler_call_details.method
        fields = propagate.get_global_textmap().fields
        carrier = {
            k: v
            for k, v in handler_call_details.invocation_metadata or ()
            if k in fields and isinstance(v, str)
        }
        parent = extract(carrier)
        if quiet(parent):
            return handler  # nothing to trace: the call runs as it is
        serde = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        # Only async behaviours are wrapped: a sync one runs in grpc's thread pool,
        # and wrapping it in a coroutine would move it onto the event loop.
        if inspect.iscoroutinefunction(handler.unary_unary):
            behaviour = _traced_call(handler.unary_unary, method, parent)
            return grpc.unary_unary_rpc_method_handler(behaviour, **serde)
        stream = handler.unary_stream
        if inspect.isasyncgenfunction(stream):
            return grpc.unary_stream_rpc_method_handler(
                _traced_generator(stream, method, parent), **serde
            )
        if inspect.iscoroutinefunction(stream):  # writes through context.write()
            return grpc.unary_stream_rpc_method_handler(
                _traced_call(stream, method, parent), **serde
            )
        return handler


def server_span(method: str, parent: otel_context.Context) -> AbstractContextManager[Span]:
    """The current SERVER span of one call of ``method`` ("/pkg.Service/Name");
    none when :func:`quiet`."""
    if quiet(parent):
        return _NO_SPAN
    return tracer.start_as_current_span(
        _span_name(method),
        context=parent,
        kind=SpanKind.SERVER,
        attributes=_rpc_attributes(method),
        record_exception=False,
        set_status_on_exception=False,
    )


def client_span(method: str, carrier: dict[str, str]) -> AbstractContextManager[Span]:
    """A CLIENT span of one call of ``method``, its context written to ``carrier``
    (for calls that carry trace context in the message, not in metadata); none
    when :func:`quiet`, and ``carrier`` stays empty."""
    if quiet():
        return _NO_SPAN
    span = _start_client_span(method)
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    )


def set_status(span: Span, code: grpc.StatusCode, details: str, *, server: bool) -> None:
    """Record the status a call ended with: any non-OK code fails a client span,
    only a server-side failure (UNKNOWN, INTERNAL, ...) a server span."""
    if not span.is_recording():
        return
    _set_grpc_status(span, code, details, error_codes=_SERVER_ERROR_CODES if server else None)


def _traced_call(
    behaviour: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
    method: str,
    parent: otel_context.Context,
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def traced(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        with server_span(method, parent) as span:
            try:
                response = await behaviour(request, context)
            except BaseException as exc:
                _record_server_failure(span, context, exc)
                raise
            _set_server_status(span, context)
            return response

    return traced


def _traced_generator(
    behaviour: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]],
    method: str,
    parent: otel_context.Context,
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
    async def traced(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        span = tracer.start_span(
            _span_name(method),
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_rpc_attributes(method),
        )
        span_context = trace.set_span_in_context(span, parent)
        responses = behaviour(request, context)
        try:
            while True:
                # Attach only around each step: a context attached across a yield
                # would be detached wherever the generator happens to be closed.
                token = otel_context.attach(span_context)
                try:
                    response = await anext(responses)
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                yield response
            _set_server_status(span, context)
        except BaseException as exc:
            _record_server_failure(span, context, exc)
            raise
        finally:
            await cast("Any", responses).aclose()
            span.end()

    return traced


def _start_client_span(method: str | bytes) -> Span:
    name = method.decode() if isinstance(method, bytes) else method
    return tracer.start_span(
        _span_name(name), kind=SpanKind.CLIENT, attributes=_rpc_attributes(name)
    )


def _with_trace_metadata(
    details: grpc.aio.ClientCallDetails, span: Span
) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return with_metadata(details, carrier.items())


def _span_name(method: str) -> str:
    # "/dagnats.engine.v1.Engine/Start" -> "dagnats.engine.v1.Engine/Start"
    return method.lstrip("/")


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _set_grpc_status(
    span: Span,
    code: grpc.StatusCode,
    details: str,
    *,
    error_codes: frozenset[grpc.StatusCode] | None,
) -> None:
    """Record ``code``; it is an error when in ``error_codes`` (None: any non-OK code)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    failed = code != grpc.StatusCode.OK if error_codes is None else code in error_codes
    if failed:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))


def _set_server_status(span: Span, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    code = context.code() or grpc.StatusCode.OK
    _set_grpc_status(span, code, context.details() or "", error_codes=_SERVER_ERROR_CODES)


def _record_server_failure(
    span: Span, context: grpc.aio.ServicerContext[Any, Any], exc: BaseException
) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        # context.abort() raises this after setting the status it sends.
        _set_server_status(span, context)
    else:
        _record_exception(span, exc)  # the client sees UNKNOWN


def _record_exception(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
