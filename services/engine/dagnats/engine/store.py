"""The engine's one adapter to JetStream: buckets, streams and their errors.

Everything the engine reads from or writes to NATS goes through here; NATS
error types do not leave this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg, StreamInfo, StreamState
from nats.js.kv import KeyValue

from dagnats.core import jetstream as jsx
from dagnats.core.errors import NotFound, Unavailable
from dagnats.core.partitions import TASK_GROUP
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.core.subjects import (
    ALL_CANCELS,
    COMMIT_EVENTS,
    DIRECT_QUEUE,
    cancelled_run,
    commit_event_subject,
    created_subject,
    dead_letter,
    history_subject,
    kv_key,
    lane_prefix,
    partition_filters,
    task_consumer,
)
from dagnats.engine.heard import WRITER, Listening, RunWrites
from dagnats.engine.run_list import Created, created_entry
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb

if TYPE_CHECKING:
    from nats.js.api import DeliverPolicy

    from dagnats.engine import model as m

log = logging.getLogger(__name__)


# Every call to JetStream is retried while it is unavailable (a stream electing
# its leader, a server restarting), within the request's budget: the one rule
# of ``jsx.retry_transient``.
_retry = jsx.retry_transient


# How a compare-and-swap write of a key says which revision it replaces, and
# the API errors that say it does not (nats.js.kv does the same).
_EXPECTED_REVISION = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST_SEQUENCE = (10071, 10164)


class StaleRevision(Exception):
    """The run changed since it was read; read it again and retry."""


# Seconds a watcher may stay silent before a listing ends (see _values).
WATCH_IDLE = 2.0
# Seconds between the server's heartbeats on a run watch: two missed ones and
# the watch starts over after the last write it saw (a NATS restart).
WATCH_HEARTBEAT = 1.0
# Seconds the server keeps a run watch's consumer after its watcher left (or
# lost its connection: the watch then starts a new one).
WATCH_INACTIVE = 5.0
# The key in the active-run index that holds the runs bucket's sequence
# through which a reconciler pass read every write.
INDEX_THROUGH = "index-through"
# The key in the active-run index that says every run stored before the runs
# by creation time existed was given its entry there.
CREATED_COMPLETE = "created-complete"
# Keys of the index that name no run; the second was written before runs
# were stored without an index entry (ADR 48).
_INDEX_KEYS = frozenset({INDEX_THROUGH, "index-complete", CREATED_COMPLETE})


@dataclass(frozen=True, slots=True)
class StoredRun:
    record: ipb.RunRecord
    revision: int
    run: m.Run | None = field(default=None, compare=False)
    """``record``'s run as the engine that wrote it decided it, when it
    kept it: its next decision on the guess need not decode the record."""


@dataclass(frozen=True, slots=True)
class RecentRuns:
    """The runs :meth:`EngineStore.recent_runs` read: each as stored now, and
    when (nanoseconds, nats-server's clock) the oldest write read was stored,
    before which every run not read was last written; None when the read
    began at the bucket's first write and left no run out."""

    runs: list[StoredRun]
    unread_before: int | None


@dataclass(frozen=True, slots=True)
class CreatedRuns:
    """The entries :meth:`EngineStore.created_runs` read from the runs by
    creation time, and when (nanoseconds, nats-server's clock) the oldest
    entry read was stored, before which every entry not read was; None when
    the read began at the stream's first entry."""

    entries: list[Created]
    unread_before: int | None
    start: int  # the first sequence of the stretch read: a read further back ends before it
    newest: int  # when (nanoseconds) the newest entry read was stored; 0: none was


@dataclass(frozen=True, slots=True)
class _Read:
    """What :meth:`EngineStore._runs_from` read: each run at its last write,
    when (nanoseconds) the oldest write read was stored (None: none was), and
    the sequence of the last write read."""

    runs: dict[str, StoredRun]
    oldest: int | None
    last: int


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message a pull consumer delivered, and how to settle it: all the
    engine's other modules see of a NATS message."""

    _msg: Msg

    @property
    def data(self) -> bytes:
        return self._msg.data or b""

    @property
    def subject(self) -> str:
        return self._msg.subject

    @property
    def lease(self) -> str:
        """The ack subject: what a worker holds as its task's lease."""
        return self._msg.reply

    @property
    def delivered(self) -> int:
        """Which delivery of the message this is, from 1."""
        return self._msg.metadata.num_delivered or 1

    @property
    def stream_seq(self) -> int:
        return int(self._msg.metadata.sequence.stream)

    @property
    def stored_at(self) -> float:
        """When the message was stored, in seconds since the epoch (nats-server's clock)."""
        return self._msg.metadata.timestamp.timestamp()

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        """Deliver it again, after ``delay`` seconds (at once when None)."""
        await self._msg.nak(delay=delay)


def _stored(msg: Msg) -> StoredRun | None:
    """A write of the runs bucket as a watch delivers it; None for a delete or purge."""
    if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
        return None
    return StoredRun(ipb.RunRecord.FromString(msg.data), int(msg.metadata.sequence.stream))


def _run_key(workflow: str, key: str) -> str:
    """The key an idempotency key of a workflow is bound under."""
    return hashlib.sha256(f"{workflow}\0{key}".encode()).hexdigest()[:40]


class EngineStore:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        *,
        workflows: KeyValue,
        runs: KeyValue,
        run_keys: KeyValue,
        checkpoints: KeyValue,
        active_runs: KeyValue,
    ) -> None:
        self.nc = nc
        self.js = js
        self._workflows = workflows
        self._runs = runs
        self._run_keys = run_keys
        self._checkpoints = checkpoints
        self._active = active_runs
        self._notices: _Notices | None = None
        self._run_headers: dict[str, str] = {}

    @classmethod
    async def open(cls, nc: NATS) -> EngineStore:
        js = nc.jetstream()
        return cls(
            nc,
            js,
            workflows=await jsx.open_bucket(js, jsx.KV_WORKFLOWS),
            runs=await jsx.open_bucket(js, jsx.KV_RUNS),
            run_keys=await jsx.open_bucket(js, jsx.KV_RUN_KEYS),
            checkpoints=await jsx.open_bucket(js, jsx.KV_CHECKPOINTS),
            active_runs=await jsx.open_bucket(js, jsx.KV_ACTIVE_RUNS),
        )

    async def _get(self, bucket: str, key: str, what: str) -> KeyValue.Entry:
        """A key's value (``jsx.kv_get``), read again while JetStream is unavailable."""
        return await _retry(functools.partial(jsx.kv_get, self.js, bucket, key), what)

    async def _msg(self, stream: str, what: str, **where: Any) -> RawStreamMsg:
        """A stream's message (``jsx.get_msg``), read again while JetStream is unavailable."""
        return await _retry(functools.partial(jsx.get_msg, self.js, stream, **where), what)

    # ---- workflows ----------------------------------------------------------------

    async def put_workflow(self, workflow: pb.Workflow) -> None:
        data = workflow.SerializeToString()
        await _retry(lambda: self._workflows.put(workflow.name, data), "store the workflow")

    async def get_workflow(self, name: str) -> pb.Workflow:
        try:
            entry = await self._get(jsx.KV_WORKFLOWS, name, "read the workflow")
        except nats.js.errors.KeyNotFoundError:
            raise NotFound(f"workflow {name!r} is not registered", field="workflow") from None
        return pb.Workflow.FromString(entry.value or b"")

    async def list_workflows(self) -> list[pb.Workflow]:
        return [
            pb.Workflow.FromString(v) async for _, v, _ in jsx.walk_kv(self.js, jsx.KV_WORKFLOWS)
        ]

    # ---- runs ---------------------------------------------------------------------

    async def load_run(self, run_id: str) -> StoredRun | None:
        try:
            entry = await self._get(jsx.KV_RUNS, run_id, "read the run")
        except nats.js.errors.KeyNotFoundError:
            return None
        return StoredRun(ipb.RunRecord.FromString(entry.value or b""), int(entry.revision or 0))

    async def follow_run(self, run_id: str) -> AsyncGenerator[StoredRun | None, None]:
        """The run as stored now (None when there is none), then after every
        change (None once purged), as :class:`dagnats.engine.runs.Runs`
        follows it for the inputs service's waits (``jsx.follow_key``)."""
        async for entry in jsx.follow_key(self._runs, run_id):
            if entry and entry.value:
                yield StoredRun(ipb.RunRecord.FromString(entry.value), int(entry.revision or 0))
            else:
                yield None

    async def require_run(self, run_id: str) -> StoredRun:
        stored = await self.load_run(run_id)
        if stored is None:
            raise NotFound(f"run {run_id} does not exist", field="run_id")
        return stored

    async def create_run(self, record: ipb.RunRecord) -> int | None:
        """Store a new run; None when a run with that id exists already. It
        enters no index here: the reconciler's next pass finds it among the
        writes after the index's mark."""
        run_id, data = record.run.run_id, record.SerializeToString()
        try:
            # A retried create whose first try landed finds the key taken: the
            # caller then reads the run, and finds its own (the id is random).
            return await _retry(lambda: self._put_run(run_id, data, 0), "store the run")
        except StaleRevision:
            pass
        try:  # taken, or purged: nats.js.kv makes a purged key anew
            return int(await _retry(lambda: self._runs.create(run_id, data), "store the run"))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update_run(self, record: ipb.RunRecord, revision: int) -> int:
        """Store ``record`` if the run is still at ``revision`` (a
        compare-and-swap); its new revision. Signed by this engine's
        :class:`RunWrites` when it hears writes."""
        run_id, data = record.run.run_id, record.SerializeToString()
        # A retried update whose first try landed is a stale revision: the
        # caller reads the run again and decides on what it finds.
        return await _retry(lambda: self._put_run(run_id, data, revision), "update the run")

    async def _put_run(self, run_id: str, data: bytes, revision: int) -> int:
        """Store a run if its key is at ``revision`` (0: no such key), signed
        by this engine's :class:`RunWrites` when it hears writes."""
        headers = {_EXPECTED_REVISION: str(revision), **self._run_headers}
        try:
            ack = await self.js.publish(kv_key(jsx.KV_RUNS, run_id), data, headers=headers)
        except nats.js.errors.APIError as err:
            if err.err_code in _WRONG_LAST_SEQUENCE:
                raise StaleRevision(run_id) from None
            raise
        return int(ack.seq)

    async def hear_run_writes(self) -> tuple[RunWrites, Callable[[], Awaitable[None]]]:
        """Listen to every publish of a run (heard writes): what is heard, and the
        unsubscribe. This store's own writes of runs are signed from now on.
        On a cluster nothing is listened to, and nothing heard is trusted."""
        writes = RunWrites()
        self._run_headers = writes.headers()
        info = await self._runs_info()
        one_server = info.cluster is None or not info.cluster.name
        if not one_server:
            return writes, _nothing
        prefix = kv_key(jsx.KV_RUNS, "")

        async def heard(msg: Msg) -> None:
            # Awaits nothing: a publish is either in the queue or heard.
            writes.heard(msg.subject[len(prefix) :], (msg.headers or {}).get(WRITER))

        # No pending limits: a publish dropped here would go unheard.
        sub = await self.nc.subscribe(
            f"{prefix}>", cb=heard, pending_msgs_limit=0, pending_bytes_limit=0
        )
        writes.listen(
            lambda: Listening(sub.delivered, sub.pending_msgs, self.nc.stats["reconnects"])
        )

        async def stop() -> None:
            writes.listen(None)
            with contextlib.suppress(Exception):  # the connection may be closing
                await sub.unsubscribe()

        return writes, stop

    async def iter_runs(self) -> AsyncIterator[StoredRun]:
        async for _, value, revision in jsx.walk_kv(self.js, jsx.KV_RUNS):
            yield StoredRun(ipb.RunRecord.FromString(value), revision)

    async def latest_runs(self) -> list[StoredRun]:
        """Every stored run as it is now, pushed by one short-lived ordered
        consumer that delivers the last write of each key: one pass, where
        :meth:`iter_runs` asks for each message in turn (a few milliseconds
        against seconds for thousands of runs). It reads until the bucket's
        last write at the call, so no run stored before it is missed (a run
        stored since may be in it too, newer)."""
        from nats.js.api import DeliverPolicy

        info = await self._runs_info()
        last = int(info.state.last_seq or 0)
        if not info.state.messages:
            return []
        prefix = kv_key(jsx.KV_RUNS, "")
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def deliver(msg: Msg) -> None:
            queue.put_nowait(msg)

        sub = await self._watch_bucket(">", DeliverPolicy.LAST_PER_SUBJECT, deliver)
        found: dict[str, StoredRun] = {}
        try:
            while True:
                msg = await queue.get()
                key = (msg.subject or "").removeprefix(prefix)
                stored = _stored(msg)
                if stored is None:
                    found.pop(key, None)
                else:
                    found[key] = stored
                meta = msg.metadata
                if meta.sequence.stream >= last or meta.num_pending == 0:
                    return list(found.values())
        finally:
            await self._unwatch(sub)

    async def recent_runs(self, writes: int) -> RecentRuns:
        """The runs last written among about the bucket's ``writes`` newest
        writes, or later (see :meth:`_runs_from`)."""
        info = await self._runs_info()
        state = info.state
        if not state.messages:
            return RecentRuns([], None)
        start = _start_of(state, writes)
        read = await self._runs_from(start)
        return _recent(read.runs, not start, read.oldest)

    async def _runs_info(self) -> StreamInfo:
        """The runs bucket's stream: its state (first and last write, how many)."""
        return await _retry(
            lambda: self.js.stream_info(f"KV_{jsx.KV_RUNS}"), "read the runs bucket"
        )

    async def _runs_from(self, start: int) -> _Read:
        """The runs last written at sequence ``start`` of the bucket or later
        (0: from its first write), each as stored now: one ordered consumer
        from that point to the bucket's end. A write replaces a run's
        previous one (the bucket keeps one), so each run is read once, at its
        last write, and the deleted writes in between are skipped by the
        server.

        A run rewritten during the read may lose its place ahead of the
        consumer and take a new one behind the last write the consumer has
        seen. The read ends when the stream, asked directly, has no write
        after the last one read, as a walk of the bucket ends: a rewrite
        stores the new write before it removes the old one, so every run has
        a write at each instant, and then every run's is one the consumer
        passed while it was there (or is before ``start``)."""
        from nats.js.api import DeliverPolicy

        prefix = kv_key(jsx.KV_RUNS, "")
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def deliver(msg: Msg) -> None:
            queue.put_nowait(msg)

        policy = DeliverPolicy.BY_START_SEQUENCE if start else DeliverPolicy.ALL
        sub = await self._watch_bucket(">", policy, deliver, start=start)
        found: dict[str, StoredRun] = {}
        oldest: int | None = None
        last = max(start - 1, 0)
        try:
            async for msg in _to_end(queue, last, self._written_after):
                meta = msg.metadata
                if oldest is None:
                    oldest = int(meta.timestamp.timestamp() * 1e9)
                key = (msg.subject or "").removeprefix(prefix)
                stored = _stored(msg)
                if stored is None:
                    found.pop(key, None)
                else:
                    found[key] = stored
                last = int(meta.sequence.stream)
            return _Read(found, oldest, last)
        finally:
            await self._unwatch(sub)

    async def created_runs(self, entries: int, *, before: int = 0) -> CreatedRuns:
        """About ``entries`` entries of the runs by creation time
        (``RUNS_CREATED``): the newest, or the newest before sequence
        ``before`` (a read further back than one made already); all of them
        when that is half the stream or more. One ordered consumer over that
        stretch. An entry is written once, with its run's create (again only
        by a reconciler that publishes an outbox the create left), so the
        stream's newest entries are its newest runs, however many runs were
        rewritten since, and a stretch read once needs no reading again."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        stream = jsx.RUNS_CREATED
        info = await _retry(lambda: self.js.stream_info(stream), "read the runs by creation")
        state = info.state
        end = before - 1 if before else state.last_seq
        if not state.messages or end < state.first_seq:
            return CreatedRuns([], None, state.first_seq, 0)
        start = _start_of(state, entries, end=end)
        whole = not start
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def deliver(msg: Msg) -> None:
            queue.put_nowait(msg)

        sub = await _retry(
            lambda: self.js.subscribe(
                created_subject(">"),
                stream=stream,
                cb=deliver,
                config=None if whole else ConsumerConfig(opt_start_seq=start),
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL if whole else DeliverPolicy.BY_START_SEQUENCE,
                idle_heartbeat=WATCH_HEARTBEAT,
                inactive_threshold=WATCH_INACTIVE,
            ),
            "read the runs by creation",
        )
        found: list[Created] = []
        oldest: int | None = None
        newest = 0
        prefix = created_subject("")
        last = 0 if whole else start - 1

        async def written_after(seq: int) -> bool:
            return await self._created_after(seq, through=end if before else 0)

        try:
            async for msg in _to_end(queue, last, written_after):
                meta = msg.metadata
                newest = int(meta.timestamp.timestamp() * 1e9)
                if oldest is None:
                    oldest = newest
                entry = created_entry((msg.subject or "").removeprefix(prefix), msg.data)
                if entry is not None:
                    found.append(entry)
                if before and meta.sequence.stream >= end:
                    break
        finally:
            with contextlib.suppress(Exception):  # the connection may be gone: so is the consumer
                await sub.unsubscribe()
        first = state.first_seq if whole else start
        if whole:
            return CreatedRuns(found, None, first, newest)
        return CreatedRuns(found, oldest if oldest is not None else _NEVER, first, newest)

    async def enter_created(self, entry_of: Callable[[pb.Run], ipb.OutboxEntry]) -> int:
        """Give every stored run its entry in the runs by creation time
        (``entry_of``), once a deployment: a run stored before that stream
        existed has none. Done when the index holds ``CREATED_COMPLETE``,
        put after the last entry: an engine stopped before does it again
        (an entry published twice is one entry). How many runs it entered."""
        try:
            await self._get(jsx.KV_ACTIVE_RUNS, CREATED_COMPLETE, "read the index")
            return 0
        except nats.js.errors.KeyNotFoundError:
            pass
        runs = await self.latest_runs()
        for stored in runs:
            entry = entry_of(stored.record.run)
            # Its own Msg-Id: a create's entry purged within the duplicate
            # window would drop this one.
            entry.msg_id += ".entered"
            await self.publish(entry)
        await _retry(lambda: self._active.put(CREATED_COMPLETE, b"1"), "mark the index")
        return len(runs)

    async def _created_after(self, seq: int, *, through: int = 0) -> bool:
        """Whether the runs by creation time hold an entry after ``seq`` now
        (and at ``through`` or before, unless 0)."""
        where = {"seq": seq + 1, "subject": created_subject(">"), "next": True}
        try:
            found = await self._msg(jsx.RUNS_CREATED, "read the runs by creation", **where)
        except nats.js.errors.NotFoundError:
            return False
        return not through or int(found.seq or 0) <= through

    async def load_runs(self, run_ids: list[str]) -> dict[str, StoredRun | None]:
        """Each run as stored now (None: there is none), read at once."""
        loaded = await asyncio.gather(*(self.load_run(run_id) for run_id in run_ids))
        return dict(zip(run_ids, loaded, strict=True))

    async def _written_after(self, seq: int) -> bool:
        """Whether the runs bucket holds a write after ``seq`` now."""
        where = {"seq": seq + 1, "subject": kv_key(jsx.KV_RUNS, ">"), "next": True}
        try:
            await self._msg(f"KV_{jsx.KV_RUNS}", "read the runs bucket", **where)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def watch_run(self, run_id: str) -> AsyncIterator[StoredRun | None]:
        """The run as stored now, then after every write, in order; None once it
        is purged. One ordered push consumer on the run's key, with no acks:
        the server sends each write as it is stored, and after a NATS outage
        the client library starts a new consumer after the last write it saw,
        missing nothing (``WATCH_HEARTBEAT`` bounds how long it takes to notice)."""
        from nats.js.api import DeliverPolicy

        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def deliver(msg: Msg) -> None:
            queue.put_nowait(msg)

        sub = await self._watch_bucket(run_id, DeliverPolicy.LAST_PER_SUBJECT, deliver)
        try:
            while True:
                yield _stored(await queue.get())
        finally:
            with contextlib.suppress(Exception):  # gone with the connection already
                await sub.unsubscribe()

    async def watch_runs(
        self, deliver: Callable[[str, StoredRun | None], None]
    ) -> Callable[[], Awaitable[None]]:
        """Call ``deliver(run_id, state)`` with every write of any run from now
        on, in the order stored (``None`` for a purge); returns once the watch
        is in place, with the call that stops it. One ordered push consumer on
        the whole bucket, deliver-new, no acks, resumed by the client library
        after a NATS outage as :meth:`watch_run` is."""
        from nats.js.api import DeliverPolicy

        prefix = kv_key(jsx.KV_RUNS, "")

        async def on_msg(msg: Msg) -> None:
            deliver((msg.subject or "").removeprefix(prefix), _stored(msg))

        sub = await self._watch_bucket(">", DeliverPolicy.NEW, on_msg)
        return functools.partial(self._unwatch, sub)

    async def _watch_bucket(
        self,
        keys: str,
        policy: DeliverPolicy,
        cb: Callable[[Msg], Awaitable[None]],
        *,
        start: int = 0,
    ) -> JetStreamContext.PushSubscription:
        """An ordered push consumer on the runs bucket's ``keys``: no acks,
        heartbeats every ``WATCH_HEARTBEAT``, removed by the server
        ``WATCH_INACTIVE`` after its subscriber left. ``start``: the sequence
        a ``BY_START_SEQUENCE`` policy starts at."""
        from nats.js.api import ConsumerConfig

        return await _retry(
            lambda: self.js.subscribe(
                kv_key(jsx.KV_RUNS, keys),
                stream=f"KV_{jsx.KV_RUNS}",
                cb=cb,
                # A new one each try: the client library fills it in.
                config=ConsumerConfig(opt_start_seq=start) if start else None,
                ordered_consumer=True,
                deliver_policy=policy,
                idle_heartbeat=WATCH_HEARTBEAT,
                inactive_threshold=WATCH_INACTIVE,
            ),
            "watch the runs",
        )

    async def _unwatch(self, sub: JetStreamContext.PushSubscription) -> None:
        """Stop a watch of the runs bucket and remove its consumer at once,
        rather than after ``WATCH_INACTIVE``."""
        name = ""
        # Each may fail with the connection gone already: then so is the consumer.
        with contextlib.suppress(Exception):
            name = (await sub.consumer_info()).name
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if name:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(f"KV_{jsx.KV_RUNS}", name)

    async def delete_run(self, run_id: str) -> None:
        await _retry(lambda: self._runs.purge(run_id), "purge the run")
        # After the run: a purge stopped in between leaves an entry with no
        # run, which a page skips, never a run with no entry.
        await self.purge_subject(jsx.RUNS_CREATED, created_subject(run_id))
        await self.leave_active(run_id)

    # ---- the active-run index -----------------------------------------------------
    #
    # The reconciler reads the runs in this index instead of every stored run
    # (ADR 10). A run is stored without an entry: each reconciler
    # pass first reads the runs bucket's writes after the index's mark
    # (``INDEX_THROUGH``), enters every run among them that may need the
    # reconciler, then moves the mark to the last write it read. Only the
    # reconciler (and a purge) takes a run out: once it is finished with
    # nothing left to publish (a finished run never changes again), or once
    # it is parked (running, nothing in motion, no outbox), after a
    # write of the run flagged ``unindexed``, which a pass skips. So every run
    # that may need the reconciler is in the index or written after the mark,
    # and the index grows with the runs in motion only.

    @staticmethod
    def needs_reconciler(record: ipb.RunRecord) -> bool:
        """Whether a run belongs in the index: running, or with an outbox not cleared yet."""
        return record.run.status == pb.RUN_STATUS_RUNNING or bool(record.outbox)

    async def enter_active(self, run_id: str) -> int:
        """Enter a run in the index; the revision of its entry."""
        return int(await _retry(lambda: self._active.put(run_id, b"1"), "index the run"))

    async def active_run_ids(self) -> list[str]:
        """The runs in the index: running, or finished with an outbox not yet cleared.

        Read with a watcher, which may end early while keys change (see
        ``jsx.walk_kv``): a run left out is read on the next pass.
        """
        return list(await self.active_runs())

    async def active_runs(self) -> dict[str, int]:
        """The runs in the index, each with the revision of its entry (see
        :meth:`active_run_ids`)."""
        return {
            key: revision
            async for key, _, revision in _values(self._active)
            if key not in _INDEX_KEYS
        }

    async def leave_active(self, run_id: str, *, through: int = 0) -> None:
        """Take a run out of the index. A subject purge, not a KV delete: a
        delete leaves a marker that every later read of the index goes through.

        ``through``: only the entry of that revision (or an older one) is
        taken out, so an entry put again since stays (0: whatever entry
        there is)."""
        subject = kv_key(jsx.KV_ACTIVE_RUNS, run_id)
        stream = f"KV_{jsx.KV_ACTIVE_RUNS}"
        if not through:
            await self.purge_subject(stream, subject)
            return
        await _retry(
            lambda: self.js.purge_stream(stream, subject=subject, seq=through + 1),
            "leave the index",
        )

    async def indexed_runs(
        self, *, ended: Callable[[StoredRun], Awaitable[None]] | None = None
    ) -> dict[str, int]:
        """The runs of the index, each with the revision of its entry (see
        :meth:`active_runs`), after entering the runs written after the
        index's mark that may need the reconciler, but for those flagged
        ``unindexed``; the mark then moves to the last write read. The first
        call of a deployment (no mark yet) reads the whole bucket.

        A run the index holds is entered again when its write names a park
        (``parked_entry``) that purges that entry or a newer one: the park
        may purge it after this read (``Engine._park``). Any other purge of
        an entry is of a run that needs the reconciler no more.

        ``ended``: what to do, before the mark moves past its write, for a run
        read that has ended with an outbox: instead of entering it, for the
        later pass that would clear the outbox and take it out (three writes
        after the run's end), the caller publishes the outbox and nothing is
        written."""
        mark = await self.index_mark()
        last = int((await self._runs_info()).state.last_seq or 0)
        if last <= mark:
            return await self.active_runs()
        read = await self._runs_from(mark + 1 if mark else 0)
        indexed = await self.active_runs()
        for run_id, stored in read.runs.items():
            record = stored.record
            if ended is not None and record.outbox and record.run.status in FINAL_RUN_STATUSES:
                if run_id not in indexed:  # else the pass takes it out of the index
                    await ended(stored)
                continue
            if record.unindexed or not self.needs_reconciler(record):
                continue
            if indexed.get(run_id, 0) > record.parked_entry:
                continue
            indexed[run_id] = await self.enter_active(run_id)
        # Every write up to ``last`` was read, or is gone: the read ended
        # with no write after the last one it read.
        through = str(max(last, read.last)).encode()
        await _retry(lambda: self._active.put(INDEX_THROUGH, through), "mark the index")
        return indexed

    async def index_mark(self) -> int:
        """The runs bucket's sequence through which a reconciler pass read
        every write (``INDEX_THROUGH``); 0 when none did yet."""
        try:
            entry = await self._get(jsx.KV_ACTIVE_RUNS, INDEX_THROUGH, "read the index's mark")
            return int(entry.value or b"0")
        except (nats.js.errors.KeyNotFoundError, ValueError):
            return 0

    async def claim_run_key(self, workflow: str, key: str, run_id: str) -> str:
        """Bind an idempotency key to ``run_id``; returns the run it is bound to.

        The value holds the run id, so a retried create whose ack was lost
        reads back our own id and is recognised as ours.
        """
        name = _run_key(workflow, key)
        try:
            await _retry(lambda: self._run_keys.create(name, run_id.encode()), "bind the key")
            return run_id
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await self._get(jsx.KV_RUN_KEYS, name, "read the key")
            return (entry.value or b"").decode()

    async def release_run_key(self, workflow: str, key: str, run_id: str) -> None:
        """Unbind an idempotency key from ``run_id``, which is being purged; a
        key bound to another run, or to none, is left as it is."""
        name = _run_key(workflow, key)
        try:
            entry = await self._get(jsx.KV_RUN_KEYS, name, "read the key")
        except nats.js.errors.KeyNotFoundError:
            return
        if (entry.value or b"").decode() == run_id:
            await _retry(lambda: self._run_keys.purge(name), "release the key")

    # ---- checkpoints --------------------------------------------------------------

    async def save_checkpoint(self, run_id: str, step_id: str, state: bytes) -> None:
        key = f"{run_id}.{step_id}"
        await _retry(lambda: self._checkpoints.put(key, state), "save the checkpoint")

    async def load_checkpoint(self, run_id: str, step_id: str) -> bytes | None:
        try:
            key = f"{run_id}.{step_id}"
            entry = await self._get(jsx.KV_CHECKPOINTS, key, "load the checkpoint")
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or b""

    async def delete_checkpoint(self, run_id: str, step_id: str) -> None:
        key = f"{run_id}.{step_id}"
        await _retry(lambda: self._checkpoints.purge(key), "delete the checkpoint")

    # ---- streams ------------------------------------------------------------------

    async def publish(self, entry: ipb.OutboxEntry) -> None:
        """Publish an outbox entry; JetStream entries are deduplicated by Msg-Id."""
        if not entry.msg_id:
            await self.nc.publish(entry.subject, entry.data, headers=dict(entry.headers) or None)
            return
        try:
            await jsx.publish(
                self.js, entry.subject, entry.data, msg_id=entry.msg_id, headers=dict(entry.headers)
            )
        except Exception as err:
            if not jsx.is_transient(err):
                raise
            raise Unavailable(f"could not publish to {entry.subject}: {err!r}") from err

    async def task_in_flight(
        self, subject: str, msg_id: str, *, kept_seq: int = 0, kept_on: str = ""
    ) -> bool:
        """Whether the task queue still holds the dispatch ``msg_id`` (or a
        re-dispatch of it) on ``subject``, i.e. no worker has acknowledged it;
        or, ``kept_seq``, the message a holder kept for the dispatch (the kept
        task), on ``subject`` or on ``kept_on`` (a pinned step's message kept
        from a dispatch on the unpinned lane)."""
        where: dict[str, Any] = {"seq": kept_seq} if kept_seq else {"subject": subject}
        try:
            msg = await self._msg(jsx.TASKS, "read a task", **where)
        except (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError):
            return False
        if kept_seq:
            return msg.subject in (subject, kept_on)
        headers = msg.headers or {}
        stored_id = str(headers.get("Nats-Msg-Id", ""))
        return stored_id == msg_id or stored_id.startswith(msg_id + ".r")

    async def last_history_seq(self, run_id: str) -> int:
        """Stream sequence of the run's newest event; 0 when it has none."""
        subject = history_subject(run_id)
        try:
            msg = await self._msg(jsx.HISTORY, "read history", subject=subject)
        except nats.js.errors.NotFoundError:
            return 0
        return int(msg.seq or 0)

    async def history_after(self, run_id: str, after: int) -> AsyncIterator[tuple[int, bytes]]:
        """The run's history events with a sequence above ``after``, in order,
        each as its sequence and data; read from the stream leader."""
        subject, seq = history_subject(run_id), after + 1
        while True:
            try:
                where = {"seq": seq, "subject": subject, "next": True}
                msg = await self._msg(jsx.HISTORY, "read history", **where)
            except nats.js.errors.NotFoundError:
                return
            seq = int(msg.seq or 0)
            yield seq, msg.data or b""
            seq += 1

    async def history_applied_through(self, consumer: str) -> int | None:
        """Every history event up to this sequence has been applied; None
        when the consumer is not made yet (a partition just taken)."""
        try:
            info = await _retry(
                lambda: self.js.consumer_info(jsx.HISTORY, consumer), "read the history consumer"
            )
        except nats.js.errors.NotFoundError:
            return None
        return int(info.ack_floor.stream_seq if info.ack_floor else 0)

    async def purge_subject(self, stream: str, subject: str) -> None:
        await _retry(lambda: self.js.purge_stream(stream, subject=subject), f"purge {stream}")

    async def ensure_consumer(
        self, stream: str, durable: str, ack_wait: float, filters: list[str]
    ) -> None:
        """A durable consumer of a stream's subjects ``filters`` (a
        partition's slots: ``partition_filters``) that never gives up on a
        message: explicit acks, no delivery limit, no limit on pending acks."""
        from nats.js.api import AckPolicy, ConsumerConfig

        config = ConsumerConfig(
            durable_name=durable,
            **_filtered(filters),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=-1,
            max_ack_pending=-1,
        )
        await _retry(lambda: self.js.add_consumer(stream, config), f"create {durable}")

    async def ensure_task_consumer(
        self,
        task_type: str,
        ack_wait: float,
        build: str = "",
        *,
        partition: int = 0,
        partitions: int = 1,
    ) -> None:
        """The durable consumer of one partition of one lane: a task type, or
        a task type at a build (created when a worker of that build first
        polls), in the priority group ``TASK_GROUP``: its owner's polls pull
        it first (``pull_priority``)."""
        from nats.js.api import AckPolicy, ConsumerConfig

        name = task_consumer(task_type, build, partition)
        filters = partition_filters(lane_prefix(task_type, build), partition, partitions)
        config = ConsumerConfig(
            durable_name=name,
            **_filtered(filters),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=-1,
            max_ack_pending=-1,
            max_waiting=4096,
        )
        await _retry(
            lambda: jsx.add_prioritized_consumer(self.js, jsx.TASKS, config, TASK_GROUP),
            "create the task consumer",
        )

    # ---- deliveries and leases ----------------------------------------------------
    #
    # A lease is a task message's ack subject. Acknowledgements are not fenced
    # (docs/architecture.md, F5): a fenced holder's ack would complete its
    # successor's delivery, so the callers check the journal before any of these.

    async def pull(self, stream: str, durable: str, batch: int, wait: float) -> list[Delivery]:
        """Up to ``batch`` messages of a pull consumer, waiting up to ``wait``
        seconds for the first (see ``jsx.pull_now``)."""
        return [Delivery(m) for m in await jsx.pull_now(self.nc, stream, durable, batch, wait)]

    async def pull_tasks(
        self,
        task_type: str,
        batch: int,
        wait: float,
        build: str = "",
        partition: int = 0,
        priority: int = 0,
    ) -> list[Delivery]:
        """Tasks of one partition of one lane for a poll, pulled with
        ``priority`` (``pull_priority``); none once the connection is closing."""
        consumer = task_consumer(task_type, build, partition)
        try:
            pulled = await jsx.pull_now(
                self.nc, jsx.TASKS, consumer, batch, wait, priority=(TASK_GROUP, priority)
            )
            return [Delivery(m) for m in pulled]
        except nats.errors.ConnectionClosedError:
            return []  # the engine is shutting down

    async def build_present(
        self, task_type: str, build: str, lease: float, partition: int = 0
    ) -> bool:
        """Whether a worker of ``build`` is there for tasks of ``task_type``
        of the run's ``partition``: a poll of it waits on the lane's consumer
        of that partition (the one the run's task comes from), or it handed
        out a task within the last ``lease`` seconds (its taker may hold it
        still; a task left unacknowledged longer than its lease counts for no
        one). False when no worker of that build ever polled for it."""
        consumer = task_consumer(task_type, build, partition)
        try:
            info = await _retry(
                lambda: self.js.consumer_info(jsx.TASKS, consumer),
                "read a build's consumer",
            )
        except nats.js.errors.NotFoundError:
            return False
        if info.num_waiting:
            return True
        last = info.delivered.last_active if info.delivered else None
        return last is not None and (datetime.now(UTC) - last).total_seconds() < lease

    async def give_back(self, deliveries: list[Delivery]) -> None:
        """Deliver these again at once (their receiver is gone)."""
        await jsx.give_back([d._msg for d in deliveries])

    async def extend_lease(self, lease: str) -> None:
        """The task stays with its holder for another ack wait."""
        await self.nc.publish(lease, b"+WPI")

    async def release(self, lease: str) -> None:
        """The task is done: acknowledged, and off the work queue."""
        await self.nc.publish(lease, b"+ACK")

    async def redeliver(self, lease: str) -> None:
        """The task comes back at once rather than when its lease runs out."""
        await self.nc.publish(lease, b"-NAK")

    async def dead_letter(self, delivery: Delivery, err: Exception) -> None:
        """Move a message the engine cannot apply aside, then acknowledge it."""
        subject = dead_letter(delivery.subject)
        headers = {"Dagnats-Error": repr(err)[:500], "Dagnats-Subject": delivery.subject}
        msg_id = f"{subject}.{delivery.stream_seq}"
        await jsx.publish(self.js, subject, delivery.data, msg_id=msg_id, headers=headers)
        await delivery.ack()

    async def publish_event(self, event: ipb.HistoryEvent, msg_id: str) -> None:
        """Append ``event`` to its run's history, deduplicated by ``msg_id``."""
        await jsx.publish(
            self.js,
            history_subject(event.run_id),
            event.SerializeToString(),
            msg_id=msg_id,
            headers=dict(event.trace_context),
        )

    # ---- cancellations ---------------------------------------------------------------

    async def hear_cancels(self, deliver: Callable[[str], None]) -> Callable[[], Awaitable[None]]:
        """Hand the run of every cancel announced from now on to ``deliver``
        (core NATS: at most once); returns once the subscription is in place,
        with the call that ends it."""

        async def on_msg(msg: Msg) -> None:
            deliver(cancelled_run(msg.subject))

        sub = await self.nc.subscribe(ALL_CANCELS, cb=on_msg)
        await self.nc.flush()
        return sub.unsubscribe

    # ---- notices: the engine's word to a holder of a kept task (ADR 31) ------------

    async def expect_notice(self) -> tuple[str, asyncio.Future[bytes]]:
        """A subject to be told on, and the future its first message resolves.
        The caller cancels the future when it stops waiting."""
        if self._notices is None:
            self._notices = await _Notices.open(self.nc)
        return self._notices.expect()

    async def notify(self, subject: str, data: bytes) -> None:
        """Tell ``subject`` (core NATS: at most once, nobody may be listening)."""
        await self.nc.publish(subject, data)

    # ---- a journal commit's event, sent to one engine (ADR 33) ----------------------

    async def send_commit_event(self, event: ipb.HistoryEvent) -> asyncio.Future[bytes]:
        """Send a journal commit's ``event`` to one engine over core NATS (at
        most once). The engine's decision comes on ``event.notify``; the
        future returned resolves if no engine subscribes (nats-server's
        no-responders status to the request's own reply subject, which no
        engine answers on). The caller cancels it when it stops waiting."""
        reply, refused = await self.expect_notice()
        try:
            subject = commit_event_subject(event.run_id)
            await self.nc.publish(subject, event.SerializeToString(), reply=reply)
        except BaseException:
            refused.cancel()
            raise
        return refused

    async def serve_commit_events(
        self, handle: Callable[[bytes], Awaitable[None]], partition: int = 0, partitions: int = 1
    ) -> Callable[[], Awaitable[None]]:
        """Take journal commits' events of one partition's runs (one
        subscription per slot, or one wildcard when there is one partition),
        one engine of the queue group each; ``handle`` is awaited for one at
        a time. Returns the unsubscribe."""

        async def arrived(msg: Msg) -> None:
            await handle(msg.data)

        subs = [
            await self.nc.subscribe(subject, queue=DIRECT_QUEUE, cb=arrived)
            for subject in partition_filters(COMMIT_EVENTS, partition, partitions, last=True)
        ]

        async def stop() -> None:
            for sub in subs:
                with contextlib.suppress(Exception):  # the connection may be closing
                    await sub.unsubscribe()

        return stop

    async def task_at(self, seq: int) -> pb.Task | None:
        """The task message at ``seq`` of the task stream, while it is there."""
        try:
            msg = await self._msg(jsx.TASKS, "read a task", seq=seq)
        except (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError):
            return None  # acknowledged: the lease is spent
        return pb.Task.FromString(msg.data or b"")

    async def run_is_active(self, run_id: str) -> bool:
        stored = await self.load_run(run_id)
        return stored is not None and stored.record.run.status == pb.RUN_STATUS_RUNNING


async def _nothing() -> None:
    pass


def _filtered(filters: list[str]) -> dict[str, Any]:
    """A consumer's filter: one subject as ``filter_subject`` (any server
    takes it), several as ``filter_subjects``."""
    if len(filters) == 1:
        return {"filter_subject": filters[0]}
    return {"filter_subjects": filters}


async def _values(kv: KeyValue) -> AsyncIterator[tuple[str, bytes, int]]:
    """The live keys of a bucket with their values, read with one ordered
    consumer: fast, but it may leave out a key that changes meanwhile (see
    ``jsx.walk_kv``). It also ends when nothing arrives for ``WATCH_IDLE`` seconds: a
    key purged while the consumer starts can keep the watcher from ever saying
    it is done (as nats.go fixed in nats-io/nats.go#1824)."""
    watcher = await kv.watchall(ignore_deletes=True)
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=WATCH_IDLE)  # type: ignore[no-untyped-call]
            except nats.errors.TimeoutError:
                break
            if entry is None:
                break
            if entry.value:
                yield entry.key, entry.value, int(entry.revision or 0)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]


def _start_of(state: StreamState, newest: int, *, end: int = 0) -> int:
    """The sequence a read of about a stream's ``newest`` live messages
    (through sequence ``end``, 0: its last) begins at; 0: its first. The
    deleted messages are spread over the stream's sequences: estimate how far
    back ``newest`` live ones begin from their overall density. Past half the
    stream, the rest costs less than the read that would follow if this one
    fell short: read it all."""
    span = state.last_seq - state.first_seq + 1
    start = (end or state.last_seq) + 1 - math.ceil(newest * span / state.messages)
    return 0 if start <= state.first_seq or 2 * newest >= state.messages else start


async def _to_end(
    queue: asyncio.Queue[Msg], last: int, written_after: Callable[[int], Awaitable[bool]]
) -> AsyncIterator[Msg]:
    """The messages an ordered consumer puts in ``queue``, after sequence
    ``last``, to the stream's end: when the stream, asked directly
    (``written_after``), holds nothing after the last one read. The pending
    count the consumer sends is no proof of the end: it can miss a rewrite
    between its removal and its write."""
    while True:
        try:
            msg = await asyncio.wait_for(queue.get(), WATCH_IDLE)
        except TimeoutError:
            # Nothing came: the messages from the start on were removed (a
            # purge) before the consumer reached them. Done when nothing was
            # written after the last one read.
            if not await written_after(last):
                return
            continue
        yield msg
        last = int(msg.metadata.sequence.stream)
        if msg.metadata.num_pending == 0 and not await written_after(last):
            return


def _recent(found: dict[str, StoredRun], whole: bool, oldest: int | None) -> RecentRuns:
    """The end of a read of recent runs: with the time of its oldest write,
    unless it read the whole bucket. A partial read that found no write at
    all (they were purged meanwhile) says every earlier run is unread, as of
    the newest time there is, so its page is never taken as whole."""
    if whole:
        return RecentRuns(list(found.values()), None)
    return RecentRuns(list(found.values()), oldest if oldest is not None else _NEVER)


_NEVER = 2**63 - 1  # nanoseconds: later than any write


__all__ = ["CreatedRuns", "Delivery", "EngineStore", "RecentRuns", "StaleRevision", "StoredRun"]


class _Notices:
    """One subscription for every notice a process waits for: a wildcard on
    its own inbox, each waiter a token under it (as nats-py's request mux)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._waiting: dict[str, asyncio.Future[bytes]] = {}
        self._next = 0

    @classmethod
    async def open(cls, nc: NATS) -> _Notices:
        notices = cls(nc.new_inbox())
        await nc.subscribe(f"{notices._prefix}.*", cb=notices._arrived)
        return notices

    def expect(self) -> tuple[str, asyncio.Future[bytes]]:
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        return f"{self._prefix}.{token}", future

    async def _arrived(self, msg: Msg) -> None:
        future = self._waiting.get(msg.subject.rpartition(".")[2])
        if future is not None and not future.done():
            future.set_result(msg.data)
