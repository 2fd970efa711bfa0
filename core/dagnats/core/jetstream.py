"""Connecting to NATS and provisioning every stream and bucket the product uses.

One place holds the stream configurations so that ``dagnats dev``, the
services and the tests create the same thing. Settings follow the JetStream
facts of docs/architecture.md:
dedupe windows cover the whole retry horizon, task and timer consumers never
drop a message after a delivery limit, and no stream uses async persistence.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import re
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RawStreamMsg,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from dagnats.core import deadline
from dagnats.core.errors import InvalidArgument, Unavailable
from dagnats.core.natsauth import NatsSettings, is_refusal
from dagnats.core.settings import env_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")

DAY = 24 * 3600.0
DEDUPE_WINDOW = 120.0

TASKS = "TASKS"
HISTORY = "HISTORY"
TIMERS = "SLEEP_TIMERS"
DEAD_LETTERS = "DEAD_LETTERS"
JOURNAL = "AGENT_JOURNAL"
RUNS_CREATED = "RUNS_CREATED"
KV_WORKFLOWS = "WORKFLOWS"
KV_RUNS = "RUNS"
KV_RUN_KEYS = "RUN_KEYS"
KV_CHECKPOINTS = "CHECKPOINTS"
KV_INPUTS = "INPUTS"
KV_ACTIVE_RUNS = "ACTIVE_RUNS"
KV_PARTITIONS = "PARTITIONS"

# Errors after which the same publish (same Msg-Id) may simply be sent again.
TRANSIENT_NATS_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)
# JetStream API errors that pass while a stream elects a leader: 10008, "JetStream
# system temporarily unavailable" (a 503, also in the tuple above).
_ELECTING = frozenset({10008})
# "duplicate message id is in process": a replicated stream is storing a
# message of the same Msg-Id (nats-server's JSStreamDuplicateMessageConflict).
MSG_ID_IN_PROCESS = 10158
# Longest a service retries one transient error before it answers Unavailable,
# when the request it serves does not ask for an answer sooner (see
# ``dagnats.core.deadline``). A stream-leader election takes a few seconds.
RETRY_BUDGET = env_seconds("DAGNATS_NATS_RETRY", 30.0)
_BACKOFF = wait_random_exponential(multiplier=0.05, max=1.0)


def is_transient(err: BaseException) -> bool:
    """Whether the same request, sent again, may well succeed: NATS did not
    answer, found no responder, or the stream is electing its leader."""
    if isinstance(err, TRANSIENT_NATS_ERRORS):
        return True
    return _api_code(err) in _ELECTING


def _api_code(err: BaseException) -> int | None:
    """A JetStream API error's code; None for any other error."""
    # Not every APIError subclass (KeyNotFoundError, ...) sets err_code.
    return getattr(err, "err_code", None) if isinstance(err, nats.js.errors.APIError) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """How streams are replicated; 1 for one server, 3 for a production cluster."""

    replicas: int = 1


async def connect(url: str, *, name: str, settings: NatsSettings | None = None) -> NATS:
    """Connect with unlimited reconnects: a service outlives any server restart.

    This is the one place the product connects to NATS, so credentials and TLS
    (``settings``, by default the ``DAGNATS_NATS_*`` environment) apply to
    every service alike.

    Args:
        url: one or more comma-separated NATS URLs.
        name: the connection's name, as the server's monitoring shows it.
        settings: credentials and TLS; ``NatsSettings.from_env()`` when None.

    Raises:
        InvalidArgument: a setting is malformed, or the server refused the
            credential or the TLS handshake at the first connection (a
            server down is waited for; a refusal would repeat forever). The
            message and ``field`` name the setting, never its value.
    """
    settings = NatsSettings.from_env() if settings is None else settings
    options: dict[str, Any] = {
        "servers": url.split(","),
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
        **settings.connect_options(),
    }
    if "tls" in options:
        logging.getLogger("asyncio").addFilter(_quiet_tls_eof)
    nc = _Client()
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def on_error(err: Exception) -> None:
        # Only the first connection's refusal ends the start; later ones (a
        # credential revoked while running) are logged while reconnecting.
        if is_refusal(err) and not refused.done():
            refused.set_result(err)  # raised from connect, which says more
            return
        # Until the first connection stands, a socket error is most often the
        # server closing on a refusal reported next, or a server not up yet.
        level = logging.WARNING if connecting.done() else logging.INFO
        log.log(level, "NATS connection %s: %s", name, err)

    connecting = asyncio.ensure_future(nc.connect(error_cb=on_error, **options))
    waiting: list[asyncio.Future[Any]] = [connecting, refused]
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            raise settings.refused(url, refused.result())
        connecting.result()
    except BaseException:
        await _abandon(nc, connecting)
        raise
    finally:
        refused.cancel()
    return nc


class _Client(NATS):
    """nats-py's client, never left up with its reading stopped.

    nats-py's read loop ends on an error it does not expect with only a log
    line, while the connection still counts as up: every later request
    times out, and nothing reconnects (nats-py 2.16.0). Here such an end
    reconnects, as a socket error does.

    The one such error seen: each PING waits in ``_pongs`` for its PONG, in
    order. A flush that timed out or was cancelled leaves its future there,
    cancelled, and nats-py sets the result of the next PONG's future
    regardless (``InvalidStateError``). Such a PONG answers the PING it
    belongs to, and is taken as that."""

    async def _read_loop(self) -> None:
        await super()._read_loop()
        reading = asyncio.current_task()
        cancelled = reading is not None and reading.cancelling() > 0  # swallowed by nats-py
        if self._status == NATS.CONNECTED and not cancelled:  # an error nats-py only logged
            await self._process_op_err(nats.errors.UnexpectedEOF())

    async def _process_pong(self) -> None:
        if self._pongs and self._pongs[0].done():
            self._pongs.pop(0)
            self._pongs_received += 1
            self._pings_outstanding = 0
            return
        await super()._process_pong()


def _quiet_tls_eof(record: logging.LogRecord) -> bool:
    # nats-py's protocol answers a closed connection's EOF with True, which
    # asyncio ignores under TLS, and logs a warning for at every disconnect.
    return "eof_received() has no effect when using ssl" not in record.getMessage()


async def _abandon(nc: NATS, connecting: asyncio.Future[None]) -> None:
    connecting.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await connecting
    with contextlib.suppress(Exception):
        await nc.close()


def _streams(topology: Topology) -> list[StreamConfig]:
    common: dict[str, Any] = {
        "storage": StorageType.FILE,
        "num_replicas": topology.replicas,
        "duplicate_window": DEDUPE_WINDOW,
    }
    return [
        StreamConfig(
            name=TASKS,
            subjects=["tasks.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            **common,
        ),
        # No MaxAge here nor on the journal: nothing of a live run expires,
        # however long it waits. The engine purges a run's subjects once its
        # retention after its end is over (a purge timer on SLEEP_TIMERS).
        StreamConfig(
            name=HISTORY,
            subjects=["history.>"],
            retention=RetentionPolicy.LIMITS,
            **common,
        ),
        StreamConfig(
            name=TIMERS,
            subjects=["timers.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            **common,
        ),
        # The fence of a step is the last record on its subject, so nothing may
        # remove records early: no MaxAge, no TTL, no deletes, no discard
        # (docs/architecture.md, F4). Purged only with its ended run.
        StreamConfig(
            name=JOURNAL,
            subjects=["journal.>"],
            retention=RetentionPolicy.LIMITS,
            deny_delete=True,
            discard=DiscardPolicy.NEW,
            **common,
        ),
        # The runs in creation order: one message a run, written with its
        # create (its first outbox) and purged with it. ``ListRuns`` reads its
        # newest entries instead of the runs bucket, whose newest writes are
        # the runs written last, not created last.
        StreamConfig(
            name=RUNS_CREATED,
            subjects=["created.>"],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,
            **common,
        ),
        StreamConfig(
            name=DEAD_LETTERS,
            subjects=["dead.>"],
            retention=RetentionPolicy.LIMITS,
            max_age=30 * DAY,
            discard=DiscardPolicy.OLD,
            **common,
        ),
    ]


def _buckets(topology: Topology) -> list[KeyValueConfig]:
    r = topology.replicas
    return [
        KeyValueConfig(bucket=KV_WORKFLOWS, history=5, replicas=r, storage=StorageType.FILE),
        KeyValueConfig(bucket=KV_RUNS, history=1, replicas=r, storage=StorageType.FILE),
        # No TTL on any bucket that holds a run's state: a key of a live run
        # never expires; the engine deletes a run's keys with the run.
        KeyValueConfig(bucket=KV_RUN_KEYS, history=1, replicas=r, storage=StorageType.FILE),
        KeyValueConfig(bucket=KV_CHECKPOINTS, history=1, replicas=r, storage=StorageType.FILE),
        # The runs the reconciler looks at: running, or with an outbox not cleared yet.
        KeyValueConfig(bucket=KV_ACTIVE_RUNS, history=1, replicas=r, storage=StorageType.FILE),
        # An input is kept as long as its run (a queued one past the dedupe
        # window ends expired, never vanishes); the journal's input.placed
        # record, not this bucket, is the truth about placement.
        KeyValueConfig(bucket=KV_INPUTS, history=1, replicas=r, storage=StorageType.FILE),
        # The number of partitions (``count``) and each partition's owner
        # (``owner.<k>``), changed by compare-and-swap only.
        KeyValueConfig(bucket=KV_PARTITIONS, history=1, replicas=r, storage=StorageType.FILE),
    ]


# What a cluster answers while its peers are still joining: placement found no
# peer (10005), or JetStream is not available yet (10008).
_CLUSTER_FORMING = frozenset({10005, 10008})


def cluster_forming(err: BaseException) -> bool:
    """Whether a stream's create may succeed if sent again: the cluster is
    still forming, a peer is offline for placement, or NATS did not answer."""
    if isinstance(err, nats.js.errors.APIError):
        return err.err_code in _CLUSTER_FORMING
    return isinstance(err, TRANSIENT_NATS_ERRORS)


async def provision(
    js: JetStreamContext, topology: Topology | None = None, *, deadline: float = 60.0
) -> None:
    """Create or update every stream and bucket of the engine, waiting up to
    ``deadline`` seconds for a cluster that is still forming."""
    topology = topology or Topology()
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(cluster_forming),
        wait=wait_random_exponential(multiplier=0.1, max=2.0),
        stop=stop_after_delay(deadline),
        reraise=True,
    ):
        with attempt:
            await _provision_once(js, topology)


async def _provision_once(js: JetStreamContext, topology: Topology) -> None:
    for config in _streams(topology):
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as err:
            if cluster_forming(err):
                raise
            await js.update_stream(config)  # it exists: bring it to this config
    for bucket in _buckets(topology):
        try:
            await js.create_key_value(bucket)
        except nats.js.errors.BadRequestError as err:
            if cluster_forming(err):
                raise
            await _update_bucket(js, bucket)  # it exists: bring it to this config


async def _update_bucket(js: JetStreamContext, bucket: KeyValueConfig) -> None:
    """Bring an existing bucket's stream to ``bucket``'s TTL and history: a
    deployment made by an earlier release had a TTL on buckets that now keep
    their keys for a run's whole life."""
    info = await js.stream_info(f"KV_{bucket.bucket}")
    config = info.config
    config.max_age = bucket.ttl or 0.0
    config.max_msgs_per_subject = bucket.history
    config.duplicate_window = DEDUPE_WINDOW
    await js.update_stream(config)


async def open_bucket(js: JetStreamContext, bucket: str) -> KeyValue:
    """A provisioned bucket, opened again while JetStream does not answer (a
    stream electing its leader as a service starts)."""
    return await retry_transient(lambda: js.key_value(bucket), f"open the {bucket} bucket")


async def record_partitions(js: JetStreamContext, asked: int | None) -> int:
    """The deployment's number of partitions: recorded by the first process
    to provision (``asked``, or 1 when None), read by every later one.

    Raises:
        InvalidArgument: ``asked`` was given and differs from the recorded number.
    """
    kv = await open_bucket(js, KV_PARTITIONS)
    wanted = 1 if asked is None else asked
    try:
        await retry_transient(lambda: kv.create("count", str(wanted).encode()), "record partitions")
        return wanted
    except nats.js.errors.KeyWrongLastSequenceError:
        pass  # recorded before
    recorded = int((await kv_get(js, KV_PARTITIONS, "count")).value or b"0")
    if asked is not None and asked != recorded:
        raise InvalidArgument(
            f"DAGNATS_PARTITIONS is {asked} but this deployment has {recorded} partitions, "
            "fixed when it was provisioned",
            field="DAGNATS_PARTITIONS",
        )
    return recorded


async def add_prioritized_consumer(
    js: JetStreamContext, stream: str, config: ConsumerConfig, group: str
) -> None:
    """Create (or keep) a durable pull consumer of a priority group with the
    ``prioritized`` policy: a pull names the group and a priority, and a
    message goes to a waiting pull of the lowest priority number. nats-py's
    ``ConsumerConfig`` has no priority groups, so the create request is sent
    with them added."""
    body = {
        "stream_name": stream,
        "config": {
            **config.as_dict(),
            "priority_groups": [group],
            "priority_policy": "prioritized",
        },
    }
    subject = f"{js._prefix}.CONSUMER.CREATE.{stream}.{config.durable_name}"
    await js._api_request(subject, json.dumps(body).encode(), timeout=js._timeout)


async def retry_transient(
    call: Callable[[], Awaitable[T]], what: str, *, deadline: float = RETRY_BUDGET
) -> T:
    """Run ``call`` again on transient NATS errors (:func:`is_transient`), with
    jittered backoff, for up to ``deadline`` seconds or what is left of the
    request being served if that is less; then raise ``Unavailable``. Always
    tried once. Only for calls that are safe to repeat.

    This is the one rule for transient JetStream errors: the stores of every
    service wrap their calls in it, and ``publish`` and the journal's fenced
    append follow the same budget.
    """
    try:
        return await _tried(call, retry_budget(deadline))
    except Exception as err:
        if is_transient(err):
            raise Unavailable(f"could not {what}: {err!r}") from err
        raise


async def _tried(
    call: Callable[[], Awaitable[T]],
    budget: float,
    transient: Callable[[BaseException], bool] = is_transient,
) -> T:
    """``await call()``; after a transient failure, tried again for ``budget``
    seconds from the first try, with ``_BACKOFF`` between tries; the last
    error is raised as is.

    The first try runs without the retry machinery around it: it is every
    call's cost, and nearly every call succeeds at once. A first try that
    fails is handed to tenacity as its first attempt, with the budget that is
    left, so the tries, their backoff and their end are the loop's from the
    first try on.
    """
    started = time.monotonic()
    try:
        return await call()
    except Exception as err:
        if not transient(err):
            raise
        first = err
    tries = 0
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(transient),
        wait=_BACKOFF,
        stop=stop_after_delay(budget - (time.monotonic() - started)),
        reraise=True,
    ):
        with attempt:
            tries += 1
            if tries == 1:
                raise first  # the first try's failure, as the loop's first attempt
            return await call()
    raise AssertionError("unreachable")


def retry_budget(longest: float = RETRY_BUDGET) -> float:
    """Seconds a transient error may be retried now: ``longest``, or less when
    the request being served must be answered sooner."""
    return deadline.budget(longest)


async def walk_kv(
    js: JetStreamContext, bucket: str, keys: str = ">"
) -> AsyncIterator[tuple[str, bytes, int]]:
    """The live keys of a bucket matching ``keys`` (a subject filter under the
    bucket), each with its newest value and revision, in the order first seen.

    Read message by message (the next message on the matching subjects), not
    with a watcher: no consumer is created, and no key that existed when the
    walk began is missed. A watcher can report its initial values complete
    early while keys change (nats-io/nats.py#995). A key changed during the
    walk is read again further on, and its newest value wins.
    """
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    latest: dict[str, tuple[bytes, int]] = {}
    seq = 1
    while True:
        try:
            get = functools.partial(get_msg, js, stream, seq=seq, subject=prefix + keys, next=True)
            msg = await retry_transient(get, f"read {bucket}")
        except nats.js.errors.NotFoundError:
            break
        seq = int(msg.seq or 0) + 1
        key = (msg.subject or "").removeprefix(prefix)
        if msg.data and (msg.headers or {}).get("KV-Operation") not in ("DEL", "PURGE"):
            latest[key] = (msg.data, int(msg.seq or 0))
        else:
            latest.pop(key, None)
    for key, (value, revision) in latest.items():
        yield key, value, revision


async def get_msg(
    js: JetStreamContext,
    stream: str,
    *,
    seq: int | None = None,
    subject: str | None = None,
    next: bool = False,
) -> RawStreamMsg:
    """One message of ``stream``, as ``js.get_msg`` reads it: at ``seq``, the
    last one on ``subject``, or with ``next`` the first one on ``subject`` at
    or after ``seq``.

    Read from the stream's leader (its message-get API), never with a direct
    get: with ``allow_direct`` any replica answers, and one that lags gives an
    older message, which the reads that fence writers (a journal's tail, the
    run a lease is checked against) must not see. The headers are read by
    :func:`parse_headers`, not by the standard library's email parser that
    ``js.get_msg`` uses.

    Raises:
        NotFoundError: no such message (``err_code`` 10059: no such stream).
        APIError: any other error JetStream answered.
    """
    if next:
        request: dict[str, Any] = {"seq": seq, "next_by_subj": subject}
    elif subject:
        request = {"last_by_subj": subject}
    else:
        request = {"seq": seq}
    try:
        answer = await js._nc.request(
            f"{js._prefix}.STREAM.MSG.GET.{stream}",
            json.dumps(request).encode(),
            timeout=js._timeout,
        )
    except nats.errors.NoRespondersError:
        raise nats.js.errors.ServiceUnavailableError from None
    reply = json.loads(answer.data)
    if "error" in reply:
        raise nats.js.errors.APIError.from_error(reply["error"])  # raises the error's class
    message = reply["message"]
    data, hdrs = message.get("data"), message.get("hdrs")
    return RawStreamMsg(
        subject=message.get("subject"),
        seq=message.get("seq"),
        data=base64.b64decode(data) if data else None,
        headers=parse_headers(base64.b64decode(hdrs)) if hdrs else None,
    )


def parse_headers(block: bytes) -> dict[str, str] | None:
    """The headers of a stored message (``NATS/1.0`` then ``Name: value``
    lines); None when there are none. A name given twice keeps its last
    value, as ``js.get_msg`` does."""
    headers: dict[str, str] = {}
    for line in block.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name:
            headers[name.decode(errors="replace")] = value.strip().decode(errors="replace")
    return headers or None


_KEY = re.compile(r"^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$")


async def kv_get(js: JetStreamContext, bucket: str, key: str) -> KeyValue.Entry:
    """The value of ``key`` in ``bucket``, as ``KeyValue.get`` gives it, read
    by :func:`get_msg` (from the bucket's leader).

    Raises:
        KeyNotFoundError: no such key (or bucket), or the key was deleted or purged.
        InvalidKeyError: ``key`` is not a valid key.
    """
    if not _KEY.match(key):
        raise nats.js.errors.InvalidKeyError
    try:
        msg = await get_msg(js, f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except nats.js.errors.NotFoundError:
        raise nats.js.errors.KeyNotFoundError from None
    if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
        raise nats.js.errors.KeyNotFoundError
    return KeyValue.Entry(
        bucket=bucket,
        key=key,
        value=msg.data,
        revision=msg.seq,
        delta=None,
        created=None,
        operation=None,
    )


async def follow_key(kv: KeyValue, key: str) -> AsyncGenerator[KeyValue.Entry | None, None]:
    """The entry of ``key`` now, then every later entry of the key in order;
    None whenever the key has no value (never written, deleted or purged).
    A value purged before the watch delivered it is gone from the stream and
    is not given: the purge's None follows the value before it.

    The watch starts first and the key is read after it, so no change is
    missed; what the watch delivers at or below the read's revision is
    skipped. The watch's own marker for "the current value was given" is not
    used: nats-py sends it before the current value when the consumer's
    first message and the reply to its info request cross (about one start
    in 600 while the key is written), and a key that has a value would read
    as having none."""
    watcher = await retry_transient(lambda: kv.watch(key), f"watch {key}")
    try:
        try:
            current: KeyValue.Entry | None = await retry_transient(
                lambda: kv.get(key), f"read {key}"
            )
        except nats.js.errors.KeyNotFoundError:  # deleted and purged ones too
            current = None
        seen = int(current.revision or 0) if current is not None else 0
        yield current
        async for entry in watcher:
            if entry is None or int(entry.revision or 0) <= seen:
                continue
            seen = int(entry.revision or 0)
            yield None if entry.operation in ("DEL", "PURGE") else entry
    finally:
        with contextlib.suppress(Exception):  # gone with the connection already
            await watcher.stop()  # type: ignore[no-untyped-call]


async def publish(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    *,
    msg_id: str,
    headers: dict[str, str] | None = None,
    deadline: float = RETRY_BUDGET,
    attempt_timeout: float = 5.0,
) -> int:
    """Publish to a stream, retrying transient failures with the same Msg-Id so
    that a retry whose first attempt landed is answered as a duplicate; by the
    budget of :func:`retry_transient`. The last transient error is raised as is.
    So is a replicated stream's answer that a message of the same Msg-Id is
    still being stored (a first attempt whose ack was lost): tried again, it
    is answered as a duplicate once stored.

    Returns:
        The stream sequence of the message.
    """
    all_headers = {"Nats-Msg-Id": msg_id, **(headers or {})}

    async def once() -> int:
        timeout = min(attempt_timeout, max(retry_budget(deadline), 0.5))
        ack = await js.publish(subject, data, timeout=timeout, headers=all_headers)
        return int(ack.seq)

    return await _tried(once, retry_budget(deadline), _retried_publish)


def _retried_publish(err: BaseException) -> bool:
    """Whether a publish with a Msg-Id is tried again after ``err``."""
    return _api_code(err) == MSG_ID_IN_PROCESS or is_transient(err)


@dataclass(slots=True)
class _Inbox:
    """A subscription that pull requests are answered on, with what reached it."""

    sub: Subscription
    arrived: asyncio.Queue[Msg]


# Inboxes that pulls left clean (every request read to its end, nothing left in
# them), per connection, for the next pull: a consumer read in a loop
# subscribes once, not once a pull.
_IDLE: weakref.WeakKeyDictionary[NATS, list[_Inbox]] = weakref.WeakKeyDictionary()
MAX_IDLE_INBOXES = 64


async def pull_now(
    nc: NATS,
    stream: str,
    durable: str,
    batch: int,
    wait: float,
    *,
    priority: tuple[str, int] | None = None,
) -> list[Msg]:
    """Wait up to ``wait`` seconds for a message of a pull consumer, then take
    whatever else is ready, up to ``batch``, and return.

    Every pull request is read to its end (a message count reached or the
    server's closing status), so no message delivered to this call is left
    unread when it returns: a message dropped on the floor would stay
    invisible until its ack wait ran out. The request for more is sent only
    when the first message says more are pending. The inbox it was answered
    on is kept for the next pull when both requests ended so (nothing can
    still arrive in it), and unsubscribed otherwise.

    Cancelled, it withdraws its interest, which makes the server drop the
    pull instead of delivering to it, and gives back every message that had
    reached it (see :func:`give_back`): its caller is gone and would leave
    them invisible for an ack wait.
    """
    idle = _IDLE.setdefault(nc, [])
    inbox = idle.pop() if idle else await _open_inbox(nc)
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
    msgs: list[Msg] = []
    ended = False
    try:
        # A consumer of a priority group (``priority``: the group and this
        # pull's priority) takes pulls that name them.
        group = {"group": priority[0], "priority": priority[1]} if priority else {}
        first = {"batch": 1, "expires": max(int(wait * 1e9) - 1_000_000, 1_000_000), **group}
        ended = await _read_pull(nc, inbox, subject, first, msgs, 1, wait + 2.0)
        if ended and msgs and batch > 1 and msgs[0].metadata.num_pending > 0:
            more = {"batch": batch - 1, "no_wait": True, **group}
            ended = await _read_pull(nc, inbox, subject, more, msgs, batch, 2.0)
        return msgs
    except asyncio.CancelledError:
        ended = False
        with contextlib.suppress(nats.errors.Error):
            # Unsubscribes, then waits for every message sent to it before that.
            await inbox.sub.drain()  # type: ignore[no-untyped-call]
        await give_back([*msgs, *_left_in(inbox)])
        raise
    finally:
        if ended and inbox.arrived.empty() and len(idle) < MAX_IDLE_INBOXES:
            idle.append(inbox)
        else:
            with contextlib.suppress(nats.errors.Error):
                await inbox.sub.unsubscribe()
            # A request that had not ended by its deadline may have been
            # answered since: what reached the inbox goes back, not nowhere.
            await give_back(_left_in(inbox))


def _left_in(inbox: _Inbox) -> list[Msg]:
    """The messages (not the status lines) still queued in ``inbox``, taken out."""
    left = []
    while not inbox.arrived.empty():
        msg = inbox.arrived.get_nowait()
        if not JetStreamContext.is_status_msg(msg):
            left.append(msg)
    return left


async def _open_inbox(nc: NATS) -> _Inbox:
    arrived: asyncio.Queue[Msg] = asyncio.Queue()
    return _Inbox(await nc.subscribe(nc.new_inbox(), cb=arrived.put), arrived)


async def give_back(msgs: list[Msg]) -> None:
    """Nak ``msgs`` without a delay, so each is delivered again at once instead
    of after its ack wait. A message settled already is left alone."""
    for msg in msgs:
        with contextlib.suppress(nats.errors.Error):
            await msg.nak()


async def _read_pull(
    nc: NATS,
    inbox: _Inbox,
    subject: str,
    request: dict[str, Any],
    into: list[Msg],
    limit: int,
    deadline: float,
) -> bool:
    """Send one pull request and read its answers into ``into``; whether the
    request ended (``limit`` messages, or a closing status) before ``deadline``."""
    await nc.publish(subject, json.dumps(request).encode(), reply=inbox.sub.subject)
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while len(into) < limit:
        remaining = end - loop.time()
        if remaining <= 0:
            return False
        try:
            msg = await asyncio.wait_for(inbox.arrived.get(), timeout=remaining)
        except TimeoutError:
            return False
        if JetStreamContext.is_status_msg(msg):
            if msg.headers and msg.headers.get("Status") == "100":
                continue  # an idle heartbeat
            return True  # 404 no messages, 408 expired, 409 ...: the request is over
        into.append(msg)
    return True
