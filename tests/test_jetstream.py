"""The JetStream adapter's per-message paths against a real nats-server: its
reads give what nats-py's give, a call's first try runs outside the retry loop
and a failed one is retried by the same rule, pulls keep their inbox, and
tracing without a provider still passes an incoming context on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig

from dagnats.core import jetstream as jsx
from dagnats.core.errors import Unavailable
from dagnats.core.natsserver import NatsServer
from tests.helpers import wait_for
from tests.stack import unique

STREAM = "ADAPTER"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    conn = await jsx.connect(nats_server.url, name="test-jetstream")
    js = conn.jetstream()
    await js.add_stream(name=STREAM, subjects=["adapter.>"])
    try:
        yield conn
    finally:
        await conn.close()


async def test_a_message_read_is_what_nats_py_reads(nc: NATS) -> None:
    js = nc.jetstream()
    subject = f"adapter.{unique('read')}"
    headers = {"Nats-Msg-Id": unique("id"), "Dagnats-Kind": "commit", "Note": "a: b  c"}
    first = await js.publish(subject, b"one", headers=headers)
    await js.publish(subject, b"two")
    # Not ASCII: the email parser behind js.get_msg gives an email Header object.
    accented = await js.publish(f"{subject}.x", b"", headers={"Note": "naïve"})
    await js.publish(f"{subject}.other", b"three")
    for where in (
        {"seq": first.seq},
        {"subject": subject},
        {"seq": first.seq + 1, "subject": subject, "next": True},
    ):
        ours = await jsx.get_msg(js, STREAM, **where)
        theirs = await js.get_msg(STREAM, **where)
        assert (ours.subject, ours.seq, ours.data) == (theirs.subject, theirs.seq, theirs.data)
        assert ours.headers == theirs.headers
    assert (await jsx.get_msg(js, STREAM, seq=first.seq)).headers == headers
    assert (await jsx.get_msg(js, STREAM, seq=accented.seq)).headers == {"Note": "naïve"}
    assert (await jsx.get_msg(js, STREAM, subject=subject)).headers is None
    with pytest.raises(nats.js.errors.NotFoundError):
        await jsx.get_msg(js, STREAM, subject=f"{subject}.none")
    with pytest.raises(nats.js.errors.NotFoundError) as missing:
        await jsx.get_msg(js, "NO_SUCH_STREAM", seq=1)
    assert missing.value.err_code == 10059


async def test_a_key_read_is_what_the_bucket_reads(nc: NATS) -> None:
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="ADAPTER_KV"))
    revision = await kv.put("run.one", b"state")
    entry = await jsx.kv_get(js, "ADAPTER_KV", "run.one")
    assert (entry.value, entry.revision) == (b"state", revision)
    assert entry.revision == (await kv.get("run.one")).revision
    await kv.delete("run.one")
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await jsx.kv_get(js, "ADAPTER_KV", "run.one")
    await kv.put("run.two", b"x")
    await kv.purge("run.two")
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await jsx.kv_get(js, "ADAPTER_KV", "run.two")
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await jsx.kv_get(js, "ADAPTER_KV", "never")
    for bad in ("run.*", "run.>", ".run", "run."):
        with pytest.raises(nats.js.errors.InvalidKeyError):
            await jsx.kv_get(js, "ADAPTER_KV", bad)


async def test_a_followed_key_starts_at_its_value_while_it_is_written(nc: NATS) -> None:
    # nats-py's watch says "the current value was given" before giving it in
    # about one start in 600 while the key is written (its consumer's first
    # message and the reply to its info request cross); read that way, the
    # inputs service answered a long-polled input as not found.
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="ADAPTER_FOLLOW"))
    await kv.put("k", b"0")
    stop = asyncio.Event()

    async def write() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await kv.put("k", str(n).encode())
            await asyncio.sleep(0.001)

    writer = asyncio.create_task(write())
    try:
        for _ in range(600):
            follow = jsx.follow_key(kv, "k")
            first = await anext(follow)
            assert first is not None and first.value
            later = await anext(follow)  # the writer's next put, once
            assert later is not None and int(later.revision or 0) > int(first.revision or 0)
            await follow.aclose()
    finally:
        stop.set()
        await writer
    # A key with no value starts at None, and its first put follows.
    follow = jsx.follow_key(kv, "none")
    assert await anext(follow) is None
    revision = await kv.put("none", b"now")
    got = await anext(follow)
    assert got is not None and (got.value, got.revision) == (b"now", revision)
    await kv.delete("none")
    assert await anext(follow) is None
    # A value purged before its watch delivered it is gone from the stream, so
    # it may never be given; what is given ends at the purge, and the key is
    # at no value.
    again = await kv.put("none", b"again")
    await kv.purge("none")
    given = await anext(follow)
    if given is not None:
        assert (given.value, given.revision) == (b"again", again)
        given = await anext(follow)
    assert given is None
    await follow.aclose()


async def test_a_call_that_fails_at_first_is_retried_until_it_succeeds(nc: NATS) -> None:
    subject = unique("adapter-service")
    tries = 0

    async def call() -> bytes:
        nonlocal tries
        tries += 1
        return (await nc.request(subject, b"ping", timeout=0.5)).data

    async def answer(msg: Any) -> None:
        await msg.respond(b"pong")

    async def serve_later() -> None:
        await asyncio.sleep(0.2)  # the service comes up after the first try failed
        await nc.subscribe(subject, cb=answer)

    serving = asyncio.create_task(serve_later())
    assert await jsx.retry_transient(call, "ask the service", deadline=10.0) == b"pong"
    await serving
    assert tries >= 2  # no responders at first: transient, tried again


async def test_a_call_that_keeps_failing_is_unavailable_after_its_deadline(nc: NATS) -> None:
    tries = 0

    async def call() -> bytes:
        nonlocal tries
        tries += 1
        return (await nc.request(unique("nobody"), b"", timeout=0.5)).data

    with pytest.raises(Unavailable, match="could not ask nobody") as failed:
        await jsx.retry_transient(call, "ask nobody", deadline=0.5)
    assert isinstance(failed.value.__cause__, nats.errors.NoRespondersError)
    assert tries >= 2


async def test_a_call_that_fails_for_good_is_tried_once(nc: NATS) -> None:
    tries = 0

    async def call() -> object:
        nonlocal tries
        tries += 1
        return await jsx.get_msg(nc.jetstream(), STREAM, subject="adapter.nothing.here")

    with pytest.raises(nats.js.errors.NotFoundError):
        await jsx.retry_transient(call, "read", deadline=5.0)
    assert tries == 1


class StoredInProcess:
    """A JetStream context whose first publish is stored but answered as a
    replicated stream answers while a message of its Msg-Id is still being
    stored (10158); the fault is injected as the chaos soak injects lost acks."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self.tries = 0

    async def publish(self, subject: str, payload: bytes, **kwargs: Any) -> Any:
        self.tries += 1
        ack = await self._js.publish(subject, payload, **kwargs)
        if self.tries == 1:
            raise nats.js.errors.APIError(
                code=409,
                err_code=jsx.MSG_ID_IN_PROCESS,
                description="duplicate message id is in process",
            )
        return ack


async def test_a_publish_answered_in_process_is_tried_again_and_stored_once(nc: NATS) -> None:
    js = nc.jetstream()
    subject, msg_id = f"adapter.{unique('inprocess')}", unique("id")
    lossy = StoredInProcess(js)
    seq = await jsx.publish(lossy, subject, b"once", msg_id=msg_id)  # type: ignore[arg-type]
    assert lossy.tries == 2
    stored = await jsx.get_msg(js, STREAM, subject=subject)
    assert (stored.seq, stored.data) == (seq, b"once")  # the retry found the first as a duplicate
    with pytest.raises(nats.js.errors.NotFoundError):
        await jsx.get_msg(js, STREAM, seq=seq + 1, subject=subject, next=True)


async def test_pulls_of_one_consumer_subscribe_once_and_take_all_pending(
    nc: NATS, nats_server: NatsServer
) -> None:
    js = nc.jetstream()
    durable = unique("pulls")
    topic = f"adapter.{durable}"
    await js.add_consumer(
        STREAM,
        ConsumerConfig(durable_name=durable, filter_subject=topic, ack_policy=AckPolicy.EXPLICIT),
    )

    def subscribed() -> int:
        """How many subscriptions the server has seen made, ever."""
        with urllib.request.urlopen(f"{nats_server.monitor_url}/subsz", timeout=5) as answer:
            return int(json.loads(answer.read())["num_inserts"])

    taken: list[bytes] = []
    for i in range(10):
        for j in range(i % 3 + 1):  # one message, then two, then three
            await js.publish(topic, f"{i}.{j}".encode())
        msgs = await jsx.pull_now(nc, STREAM, durable, 8, 1.0)
        for msg in msgs:
            await msg.ack()
        taken += [m.data for m in msgs]
        if i == 0:
            made = await asyncio.to_thread(subscribed)
    assert taken == [f"{i}.{j}".encode() for i in range(10) for j in range(i % 3 + 1)]
    assert await jsx.pull_now(nc, STREAM, durable, 8, 0.2) == []  # expired: nothing left
    assert await asyncio.to_thread(subscribed) == made  # the first pull's inbox, kept


async def test_a_cancelled_pull_withdraws_its_request(nc: NATS) -> None:
    js = nc.jetstream()
    durable = unique("withdrawn")
    topic = f"adapter.{durable}"
    await js.add_consumer(
        STREAM,
        ConsumerConfig(durable_name=durable, filter_subject=topic, ack_policy=AckPolicy.EXPLICIT),
    )

    async def waiting(pulls: int) -> bool:
        return (await js.consumer_info(STREAM, durable)).num_waiting >= pulls

    first = asyncio.create_task(jsx.pull_now(nc, STREAM, durable, 1, 30.0))
    await wait_for(lambda: waiting(1), timeout=10)
    second = asyncio.create_task(jsx.pull_now(nc, STREAM, durable, 1, 30.0))
    await wait_for(lambda: waiting(2), timeout=10)
    first.cancel()
    await asyncio.wait([first])
    await js.publish(topic, b"next")
    # The server serves the oldest pull first: the message skips the
    # withdrawn one and reaches the second on its first delivery.
    (msg,) = await second
    assert (msg.data, msg.metadata.num_delivered) == (b"next", 1)
    await msg.ack()


UNTRACED = textwrap.dedent(
    """
    import asyncio, json
    import grpc, grpc.aio
    from opentelemetry import context
    from dagnats.core import tracing

    async def handler(request, ctx):
        carrier = {}
        tracing.inject(carrier)
        with tracing.server_span("/t.T/Inner", tracing.extract(carrier)):
            inner = {}
            tracing.inject(inner)
        return json.dumps([carrier, inner]).encode()

    async def main():
        server = grpc.aio.server(interceptors=tracing.server_interceptors())
        methods = {"Echo": grpc.unary_unary_rpc_method_handler(handler)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", methods),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=tracing.client_interceptors()
        )
        echo = channel.unary_unary("/t.T/Echo")
        seen = [json.loads(await echo(b""))]
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        token = context.attach(tracing.extract({"traceparent": parent}))
        seen.append(json.loads(await echo(b"")))
        carrier = {}
        with tracing.client_span("/t.T/Session", carrier):
            seen.append(carrier)
        context.detach(token)
        seen.append(tracing.quiet())
        print(json.dumps(seen))
        await channel.close()
        await server.stop(None)

    asyncio.run(main())
    """
)


def test_without_a_tracer_provider_an_incoming_context_is_still_passed_on() -> None:
    done = subprocess.run(
        [sys.executable, "-c", UNTRACED], capture_output=True, text=True, timeout=60, check=True
    )
    untraced, traced, session, quiet = json.loads(done.stdout)
    assert untraced == [{}, {}]  # nothing came in: nothing goes out
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    for carrier in (*traced, session):
        assert carrier["traceparent"].split("-")[1] == trace_id
    assert quiet is True


async def test_a_connection_reads_on_after_a_flush_gave_up_on_its_pong(
    nats_server: NatsServer,
) -> None:
    # A flush that times out (or is cancelled) leaves its PING's answer to
    # come: the PONG must not stop the connection from reading.
    conn = await jsx.connect(nats_server.url, name="test-jetstream-pong")
    try:
        os.kill(nats_server.pid, signal.SIGSTOP)  # no PONG until it goes on
        try:
            await wait_for(lambda: _stopped(nats_server.pid), message="nats-server never stopped")
            with pytest.raises(nats.errors.TimeoutError):
                await conn.flush(timeout=0.2)  # type: ignore[arg-type]
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        await conn.flush(timeout=5)

        async def echo(msg: Any) -> None:
            await msg.respond(b"again: " + msg.data)

        await conn.subscribe("adapter-echo", cb=echo)
        answer = await conn.request("adapter-echo", b"hello", timeout=5)
        assert answer.data == b"again: hello"
        assert conn.is_connected
    finally:
        await conn.close()


async def test_a_connection_whose_reading_failed_reconnects(nats_server: NatsServer) -> None:
    # An error nats-py does not expect while it parses what it read ends its
    # read loop with a log line; the connection must not stay up unread.
    conn = await jsx.connect(nats_server.url, name="test-jetstream-read-error")
    try:

        async def echo(msg: Any) -> None:
            await msg.respond(b"again: " + msg.data)

        await conn.subscribe("adapter-echo-2", cb=echo)
        parse, failed = conn._ps.parse, list[bytes]()

        async def fails_once(data: bytes) -> None:
            if not failed:
                failed.append(data)
                raise RuntimeError("a parser error nats-py only logs")
            await parse(data)

        conn._ps.parse = fails_once  # type: ignore[method-assign,assignment]
        with contextlib.suppress(nats.errors.TimeoutError):
            await conn.flush(timeout=1)  # its PONG is what fails to parse

        async def answered() -> bool:
            with contextlib.suppress(nats.errors.TimeoutError, nats.errors.NoRespondersError):
                reply = await conn.request("adapter-echo-2", b"hello", timeout=0.5)
                return reply.data == b"again: hello"
            return False

        await wait_for(answered, timeout=20, message="the connection never read again")
        assert failed and conn.stats["reconnects"] >= 1
    finally:
        await conn.close()


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP reaches
    each thread when it is next scheduled)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)
