"""Trace context crosses a real grpc.aio call and a NATS-style header dict."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from dagnats.core import tracing

SERVICE = "dagnats.test.v1.Echo"


async def echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    if request == b"missing":
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
    if request == b"crash":
        raise RuntimeError("handler bug")
    span = trace.get_current_span().get_span_context()
    return f"{span.trace_id:032x}/{span.span_id:016x}".encode()


async def count(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    if request == b"fail":
        yield b"partial"
        await context.abort(grpc.StatusCode.UNAVAILABLE, "backend gone")
    for i in range(int(request)):
        yield str(i).encode()


async def write(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    # The other streaming style: a coroutine that writes instead of yielding.
    span = trace.get_current_span().get_span_context()
    await context.write(f"{span.span_id:016x}".encode())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Write": grpc.unary_stream_rpc_method_handler(write),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    chan = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", interceptors=tracing.client_interceptors()
    )
    try:
        yield chan
    finally:
        await chan.close(grace=None)
        await server.stop(grace=None)


# Bytes in, bytes out: no serializers (the stubs want them spelled out).
def unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
    return channel.unary_unary(f"/{SERVICE}/{method}", None, None)


def stream(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryStreamMultiCallable[Any, Any]:
    return channel.unary_stream(f"/{SERVICE}/{method}", None, None)


def one(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> ReadableSpan:
    found = [s for s in spans if s.kind == kind]
    assert len(found) == 1, spans
    return found[0]


def test_inject_extract_round_trip(span_exporter: InMemorySpanExporter) -> None:
    with tracing.tracer.start_as_current_span("publish") as span:
        headers: dict[str, str] = {}
        tracing.inject(headers)
    assert set(headers) >= {"traceparent"}
    remote = trace.get_current_span(tracing.extract(headers)).get_span_context()
    local = span.get_span_context()
    assert (remote.trace_id, remote.span_id, remote.is_remote) == (
        local.trace_id,
        local.span_id,
        True,
    )


def test_extract_of_an_empty_carrier_has_no_span() -> None:
    headers: dict[str, str] = {}
    tracing.inject(headers)
    assert headers == {}
    assert not trace.get_current_span(tracing.extract({})).get_span_context().is_valid


async def test_server_span_is_a_child_of_the_client_span(
    channel: grpc.aio.Channel, span_exporter: InMemorySpanExporter
) -> None:
    with tracing.tracer.start_as_current_span("caller") as caller:
        reply = await unary(channel, "Echo")(b"hi")
    spans = span_exporter.get_finished_spans()
    client, server = one(spans, SpanKind.CLIENT), one(spans, SpanKind.SERVER)
    assert client.name == server.name == f"{SERVICE}/Echo"
    assert client.context is not None and server.context is not None
    assert client.parent is not None and server.parent is not None
    assert client.parent.span_id == caller.get_span_context().span_id
    assert server.context.trace_id == client.context.trace_id
    assert server.parent.span_id == client.context.span_id
    # The handler ran with the server span as the current span.
    assert reply == f"{server.context.trace_id:032x}/{server.context.span_id:016x}".encode()
    assert server.attributes is not None and server.attributes["rpc.grpc.status_code"] == 0


async def test_stream_spans_cover_the_whole_stream(
    channel: grpc.aio.Channel, span_exporter: InMemorySpanExporter
) -> None:
    replies = [r async for r in stream(channel, "Count")(b"3")]
    assert replies == [b"0", b"1", b"2"]
    spans = span_exporter.get_finished_spans()
    client, server = one(spans, SpanKind.CLIENT), one(spans, SpanKind.SERVER)
    assert client.context is not None and server.context is not None
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.context.trace_id == client.context.trace_id
    assert client.end_time is not None and server.end_time is not None
    assert server.end_time <= client.end_time


async def test_a_client_error_marks_only_the_client_span(
    channel: grpc.aio.Channel, span_exporter: InMemorySpanExporter
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await unary(channel, "Echo")(b"missing")
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    spans = span_exporter.get_finished_spans()
    client, server = one(spans, SpanKind.CLIENT), one(spans, SpanKind.SERVER)
    assert client.status.status_code == StatusCode.ERROR
    assert server.status.status_code == StatusCode.UNSET
    for span in (client, server):
        assert span.attributes is not None
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_a_handler_exception_marks_the_server_span(
    channel: grpc.aio.Channel, span_exporter: InMemorySpanExporter
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await unary(channel, "Echo")(b"crash")
    assert failure.value.code() == grpc.StatusCode.UNKNOWN
    server = one(span_exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.status.status_code == StatusCode.ERROR
    assert [e.name for e in server.events] == ["exception"]


async def test_a_stream_failure_marks_both_spans(
    channel: grpc.aio.Channel, span_exporter: InMemorySpanExporter
) -> None:
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for reply in stream(channel, "Count")(b"fail"):
            received.append(reply)
    assert (received, failure.value.code()) == ([b"partial"], grpc.StatusCode.UNAVAILABLE)
    spans = span_exporter.get_finished_spans()
    for span in (one(spans, SpanKind.CLIENT), one(spans, SpanKind.SERVER)):
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]


async def test_a_writing_stream_handler_runs_in_the_server_span(
    channel: grpc.aio.Channel, span_exporter: InMemorySpanExporter
) -> None:
    replies = [r async for r in stream(channel, "Write")(b"")]
    server = one(span_exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.context is not None
    assert replies == [f"{server.context.span_id:016x}".encode()]
