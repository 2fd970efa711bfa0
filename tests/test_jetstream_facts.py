"""The JetStream facts the design depends on, shown on the pinned nats-server.

Raw nats-py against a real server, one server (R1) and a 3-node loopback
cluster (R3), no product code: each test is the experiment behind one fact of
``docs/architecture.md`` ("What JetStream guarantees, and what it does not").
If a nats-server upgrade changes one, its test fails here before the code that
relies on it misbehaves. The fsync counts need ``strace`` and are measured by
``python -m bench.jetstream_fsyncs`` instead.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import nats
import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    KeyValueConfig,
    RetentionPolicy,
    StreamConfig,
)

from dagnats.core.natsserver import NatsServer
from tests.helpers import created, wait_for

WRONG_LAST_SEQUENCE = 10071


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nc(topology: tuple[str, str, int]) -> AsyncIterator[NATS]:
    conn = await nats.connect(topology[1].split(",")[0])
    try:
        yield conn
    finally:
        await conn.close()


async def stream(
    js: JetStreamContext, replicas: int, *, work_queue: bool = False
) -> tuple[str, str]:
    """A fresh stream of its own subjects; its name and subject prefix."""
    name = f"FACTS_{secrets.token_hex(4).upper()}"
    prefix = name.lower()
    retention = RetentionPolicy.WORK_QUEUE if work_queue else RetentionPolicy.LIMITS
    config = StreamConfig(
        name=name,
        subjects=[f"{prefix}.>"],
        num_replicas=replicas,
        retention=retention,
        duplicate_window=120,
    )
    await created(lambda: js.add_stream(config), name)
    if replicas > 1:
        await takes_writes(js, name, f"{prefix}.probe")
    return name, prefix


async def takes_writes(js: JetStreamContext, name: str, subject: str) -> None:
    """Wait until a new R3 stream answers a publish to ``subject`` on the
    server this client is connected to: its replicas have elected a leader,
    and its interest in the subject has reached this server. Until then a
    publish finds no responder. The probe is refused by the stream (its
    expected last sequence is wrong), so it stores nothing."""

    async def answered() -> bool:
        try:
            info = await js.stream_info(name)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.js.errors.APIError):
            return False
        if not (info.cluster and info.cluster.leader):
            return False
        refused = {"Nats-Expected-Last-Subject-Sequence": str(2**40)}
        try:
            await js.publish(subject, b"", headers=refused, timeout=2)
        except nats.js.errors.APIError:
            return True  # the stream answered, and stored nothing
        except (
            nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError,
            nats.errors.TimeoutError,
        ):
            return False
        raise AssertionError(f"the probe of {name} was stored")

    await wait_for(answered, timeout=30, message=f"{name} takes writes")


async def pulled(sub: JetStreamContext.PullSubscription, wait: float) -> Msg | None:
    """One message fetched by ``sub``, or None when none came in ``wait`` seconds.
    A new R3 consumer answers pulls once it has a leader and its interest has
    reached this client's server; until then a pull finds no responder (503)
    and delivers nothing, so it is asked again."""
    try:
        [msg] = await sub.fetch(1, timeout=wait)
        return msg
    except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
        return None


async def append(js: JetStreamContext, subject: str, expect: int, msg_id: str) -> int | str:
    """A publish fenced on ``subject``'s last sequence: the sequence it got,
    ``duplicate <seq>`` when the server took it for a repeat, or the error code."""
    headers = {"Nats-Msg-Id": msg_id, "Nats-Expected-Last-Subject-Sequence": str(expect)}
    try:
        ack = await js.publish(subject, msg_id.encode(), headers=headers)
    except nats.js.errors.APIError as err:
        return f"error {err.err_code}"
    return f"duplicate {ack.seq}" if ack.duplicate else int(ack.seq)


async def test_an_append_lands_only_on_the_subject_sequence_it_expects(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    js = nc.jetstream()
    _, prefix = await stream(js, topology[2])
    subject = f"{prefix}.run.step"
    first = await append(js, subject, 0, "a")
    assert isinstance(first, int)
    # Another writer that read the subject before the first landed is refused.
    assert await append(js, subject, 0, "b") == f"error {WRONG_LAST_SEQUENCE}"
    # Another subject of the stream does not move this subject's sequence.
    assert isinstance(await append(js, f"{prefix}.run.other", 0, "c"), int)
    second = await append(js, subject, first, "d")
    assert isinstance(second, int) and second > first
    assert await append(js, subject, first, "e") == f"error {WRONG_LAST_SEQUENCE}"

    # Writers racing from one tail: exactly one lands.
    tail = second
    raced = await asyncio.gather(*(append(js, subject, tail, f"race-{i}") for i in range(10)))
    assert sum(isinstance(r, int) for r in raced) == 1, raced


async def test_a_retried_append_that_landed_is_a_duplicate_on_r3_and_refused_on_r1(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    """R3 checks the Msg-Id before the expected sequence, R1 after it."""
    js = nc.jetstream()
    name, prefix = await stream(js, topology[2])
    subject = f"{prefix}.run.step"
    seq = await append(js, subject, 0, "mine")
    again = await append(js, subject, 0, "mine")  # the ack of the first was lost
    if topology[0] == "r3":
        assert again == f"duplicate {seq}"
    else:
        assert again == f"error {WRONG_LAST_SEQUENCE}"
        # What R1 leaves to the writer: read what follows its expected tail.
        landed = await js.get_msg(name, seq=1, subject=subject, next=True)
        assert (landed.seq, (landed.headers or {}).get("Nats-Msg-Id")) == (seq, "mine")


async def test_a_msg_id_shared_with_a_successor_passes_the_fence_on_r3(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    """A zombie and its successor got the same task; a Msg-Id made of the task
    alone lets the zombie's stale write through on R3 as a "duplicate"."""
    js = nc.jetstream()
    _, prefix = await stream(js, topology[2])
    subject = f"{prefix}.run.step"
    tail = await append(js, subject, 0, "commit-0")
    assert isinstance(tail, int)
    claim = await append(js, subject, tail, "run.step.claim.1")  # the successor
    assert isinstance(claim, int)
    assert isinstance(await append(js, subject, claim, "run.step.intent.1"), int)
    zombie = await append(js, subject, tail, "run.step.claim.1")  # same id, stale tail
    if topology[0] == "r3":
        assert zombie == f"duplicate {claim}", "the zombie believes it holds the claim"
    else:
        assert zombie == f"error {WRONG_LAST_SEQUENCE}"
    # A Msg-Id with the writer's own nonce is checked against the tail everywhere.
    assert await append(js, subject, tail, "run.step.claim.1.zombie-nonce") == (
        f"error {WRONG_LAST_SEQUENCE}"
    )


async def test_a_purge_resets_the_fence_of_a_subject(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    js = nc.jetstream()
    name, prefix = await stream(js, topology[2])
    subject = f"{prefix}.run.step"
    assert isinstance(await append(js, subject, 0, "first"), int)
    assert await append(js, subject, 0, "late") == f"error {WRONG_LAST_SEQUENCE}"
    await js.purge_stream(name, subject=subject)
    # With the subject's messages gone, a writer that expects nothing lands.
    assert isinstance(await append(js, subject, 0, "late-again"), int)


async def test_a_late_ack_completes_a_task_delivered_again_and_takes_it_off_a_work_queue(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    js = nc.jetstream()
    name, prefix = await stream(js, topology[2], work_queue=True)
    config = ConsumerConfig(
        durable_name="workers", ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0, max_deliver=-1
    )
    await created(lambda: js.add_consumer(name, config), "the consumer")
    await js.publish(f"{prefix}.tasks.run.step", b"task")
    zombie = await js.pull_subscribe_bind("workers", stream=name)
    successor = await js.pull_subscribe_bind("workers", stream=name)
    stalled = await wait_for(lambda: pulled(zombie, 1), timeout=30, message="the task delivered")
    # The first holder stalls past its ack wait; the task comes back.
    current = await wait_for(
        lambda: pulled(successor, 0.5), timeout=15, message="the task is delivered again"
    )
    assert current.metadata.num_delivered == 2
    await stalled.ack_sync()  # the zombie's late ack, for the first delivery
    info = await js.consumer_info(name, "workers")
    assert info.num_ack_pending == 0, "the successor's delivery was completed by the zombie"

    async def removed() -> bool:  # on R3 the removal is applied through the stream's log
        return (await js.stream_info(name)).state.messages == 0

    await wait_for(removed, timeout=10, message="the zombie's ack takes the task off the queue")
    await current.nak()  # the successor's attempt fails: nothing comes back
    with pytest.raises(nats.errors.TimeoutError):
        await successor.fetch(1, timeout=1.5)


async def test_a_kv_create_repeated_after_a_lost_ack_looks_like_losing_the_race(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    """``create`` has no Msg-Id: the caller's own landed create, sent again,
    is refused exactly as another caller's would be."""
    js = nc.jetstream()
    bucket = f"facts_{secrets.token_hex(4)}"
    kv = await created(
        lambda: js.create_key_value(KeyValueConfig(bucket=bucket, replicas=topology[2])), bucket
    )
    if topology[2] > 1:
        await takes_writes(js, f"KV_{bucket}", f"$KV.{bucket}.probe")
    await kv.create("input", b"mine")
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await kv.create("input", b"mine")  # the same call, its first ack lost
    assert (await kv.get("input")).value == b"mine"  # what tells it apart: the value


async def test_a_rewritten_key_always_has_a_write_and_stored_times_follow_the_sequence(
    nc: NATS, topology: tuple[str, str, int]
) -> None:
    """In a bucket that keeps one value a key, a rewrite stores the new write
    before it removes the old one: asked for the key's first write at or
    after sequence 1 while it is rewritten, the stream always has one. The
    time a delivery carries is when its message was stored, and it follows
    the sequence."""
    js = nc.jetstream()
    bucket = f"facts_{secrets.token_hex(4)}"
    kv = await created(
        lambda: js.create_key_value(KeyValueConfig(bucket=bucket, history=1, replicas=topology[2])),
        bucket,
    )
    name, subject = f"KV_{bucket}", f"$KV.{bucket}.key"
    if topology[2] > 1:
        await takes_writes(js, name, f"$KV.{bucket}.probe")
    await kv.put("key", b"0")
    rewrites = 0
    rewriting = True

    async def rewrite() -> None:
        nonlocal rewrites
        while rewriting:
            await kv.put("key", str(rewrites).encode())
            rewrites += 1

    writer = asyncio.create_task(rewrite())
    try:
        for _ in range(300):
            await js.get_msg(name, seq=1, subject=subject, next=True)  # never NotFound
    finally:
        rewriting = False
        await writer
    assert rewrites > 30  # the reads overlapped many rewrites

    for n in range(20):
        await kv.put(f"other.{n}", b"")
    arrived: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await js.subscribe(f"$KV.{bucket}.>", stream=name, cb=arrived.put, ordered_consumer=True)
    try:
        delivered = [await asyncio.wait_for(arrived.get(), 10) for _ in range(21)]
    finally:
        await sub.unsubscribe()
    seqs = [m.metadata.sequence.stream for m in delivered]
    times = [m.metadata.timestamp for m in delivered]
    assert seqs == sorted(seqs) and times == sorted(times)
    for seq, at in zip(seqs, times, strict=True):
        stored = (await js.get_msg(name, seq)).time
        assert stored is not None and abs((at - stored).total_seconds()) < 1e-3


async def test_a_core_subscriber_hears_a_stored_publish_before_what_follows_its_ack(
    nats_server: NatsServer,
) -> None:
    """On one server, nats-server hands a publish to the core subscribers of
    its subject as it takes the publish in, before the stream stores it and
    acknowledges it, and writes to one connection in the order it handed
    messages to it. So a connection subscribed to a stream's subjects hears
    each write before any message that its writer, or a third party told by
    the writer, sends it after the write's ack."""
    hearer = await nats.connect(nats_server.url)
    writer = await nats.connect(nats_server.url)
    relay = await nats.connect(nats_server.url)
    try:
        js = writer.jetstream()
        _, prefix = await stream(js, 1)
        inbox = f"facts.after.{secrets.token_hex(4)}"
        heard: list[str] = []
        done = asyncio.Event()
        writes = 400

        async def hear(msg: Msg) -> None:
            if msg.subject.startswith(prefix):
                heard.append(f"write {msg.data.decode()}")
            elif msg.subject == inbox:
                heard.append(msg.data.decode())
                if msg.data == f"relayed {writes - 1}".encode():
                    done.set()

        # One subscription hears both, so ``heard`` is the connection's own
        # order: each subscription's callbacks run in a task of their own,
        # and two subscriptions' tasks may take their messages in either order.
        await hearer.subscribe(">", cb=hear)

        async def pass_on(msg: Msg) -> None:
            await relay.publish(inbox, msg.data)

        await relay.subscribe(f"{inbox}.relay", cb=pass_on)
        await hearer.flush()
        await relay.flush()
        for n in range(writes):
            await js.publish(f"{prefix}.run", f"{n}".encode())
            await writer.publish(inbox, f"after {n}".encode())  # the writer itself
            await writer.publish(f"{inbox}.relay", f"relayed {n}".encode())  # another process
        await asyncio.wait_for(done.wait(), 30)
    finally:
        for conn in (hearer, writer, relay):
            await conn.close()
    position = {what: at for at, what in enumerate(heard)}
    late = [
        n
        for n in range(writes)
        if not position[f"write {n}"] < min(position[f"after {n}"], position[f"relayed {n}"])
    ]
    assert len(position) == 3 * writes
    assert late == [], f"{len(late)} writes heard after what followed them: {late[:5]}"
