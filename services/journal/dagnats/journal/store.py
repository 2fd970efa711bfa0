"""The journal's one adapter to JetStream.

Appends are fenced: a publish with ``Nats-Expected-Last-Subject-Sequence`` =
the writer's last seen sequence on the step's exact subject, and a Msg-Id made
of the record's identity and the claim's random writer nonce, so a retry of a
write whose ack was lost resolves as the writer's own (``duplicate`` on R3;
error 10071 plus a read-back on R1) and a zombie reusing its successor's
identifiers never passes as the successor. A record found under our Msg-Id
counts as ours only if it records the same thing: a writer token sent again for
another record (an HTTP worker that lost track of its latest token) is behind,
not retried. Error 10071 becomes ``Fenced`` here and nowhere else, with the
tail the writer expected and the one the stream holds (read from the stream:
nats-server names it only in the error's text). Tail reads
use the stream leader (the message-get API), not direct gets. A missing
``AGENT_JOURNAL`` stream is ``NotProvisioned``, told apart from an empty
subject here and nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, RawStreamMsg
from opentelemetry import trace

from dagnats.core import jetstream as jsx
from dagnats.core import tracing
from dagnats.core.errors import Fenced, NotProvisioned, RecordTooLarge, Unavailable
from dagnats.core.settings import env_seconds
from dagnats.core.subjects import (
    journal_subject,
    live_stream_subject,
    run_journal,
    spent_subject,
)
from dagnats.journal import convert
from dagnats.journal.limits import HEADER_ROOM, MAX_RECORD_BYTES
from dagnats.journal.v1 import journal_pb2 as pb

log = logging.getLogger(__name__)

WRONG_LAST_SEQUENCE = 10071
IN_FLIGHT_ON_SUBJECT = 10164
RETRY_IN_FLIGHT = jsx.MSG_ID_IN_PROCESS
STREAM_NOT_FOUND = 10059
# The longest one publish attempt waits for its ack.
ATTEMPT_TIMEOUT = env_seconds("DAGNATS_NATS_ATTEMPT_TIMEOUT", 5.0)


@dataclass(frozen=True, slots=True)
class Written:
    """A record as the engine checks it: the record, and the task delivery of
    its writer (the ``Dagnats-Delivery`` header; 0 when its claim named none)."""

    record: pb.Record
    delivery: int


class JournalStore:
    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()

    async def append(
        self, token: pb.WriterToken, record: pb.Record, *, guessed: bool = False
    ) -> int:
        """Append ``record`` after ``token.last_seq``; returns its sequence.

        ``guessed``: ``token.last_seq`` is the guessed tail, not a tail the
        writer read; a miss raises ``Fenced`` but marks the span "guessed tail
        missed", not "fenced".

        Raises:
            Fenced: another writer's record follows ``token.last_seq``.
            RecordTooLarge: the record is over ``MAX_RECORD_BYTES`` or what the
                NATS server accepts; nothing was written.
        """
        subject = journal_subject(token.run_id, token.step_id)
        kind = record.WhichOneof("kind") or "unknown"
        msg_id = (
            f"{token.run_id}.{token.step_id}.{token.iteration}.{token.attempt}"
            f".{token.writer}.{token.written}"
        )
        headers = {
            "Nats-Msg-Id": msg_id,
            "Nats-Expected-Last-Subject-Sequence": str(token.last_seq),
            "Dagnats-Kind": kind,
            "Dagnats-Iteration": str(token.iteration),
            "Dagnats-Attempt": str(token.attempt),
        }
        if token.delivery > 0:  # whose lease holds the step (the engine's Heartbeat)
            headers["Dagnats-Delivery"] = str(token.delivery)
        tracing.inject(headers)
        data = record.SerializeToString()
        limit = min(MAX_RECORD_BYTES, self.nc.max_payload - HEADER_ROOM)
        if len(data) > limit:
            raise RecordTooLarge(_too_large(kind, record, len(data), limit), field=kind)
        # Transient errors are retried with the same Msg-Id, by the budget of
        # jsx.retry_transient (here by hand: 10071 and the in-flight errors
        # need answers of their own), then resolved by reading what landed.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + jsx.retry_budget()
        delay = 0.02
        while True:
            try:
                timeout = min(ATTEMPT_TIMEOUT, max(deadline - loop.time(), 0.5))
                ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
                if ack.duplicate:  # R3: our Msg-Id landed before; is it this record?
                    landed = await self.get(int(ack.seq))
                    _same_or_fenced(token, landed, record)
                return int(ack.seq)
            except nats.js.errors.APIError as err:
                if err.err_code == WRONG_LAST_SEQUENCE:
                    return await self._resolve(token, msg_id, record, err, guessed=guessed)
                in_flight = err.err_code in (IN_FLIGHT_ON_SUBJECT, RETRY_IN_FLIGHT)
                if not in_flight and not jsx.is_transient(err):
                    raise
            except Exception as err:
                if not jsx.is_transient(err):
                    raise
            if loop.time() > deadline:
                return await self._resolve(token, msg_id, record, None, guessed=guessed)
            await asyncio.sleep(delay)  # backoff between retries of the same write
            delay = min(delay * 2, 1.0)

    async def _resolve(
        self,
        token: pb.WriterToken,
        msg_id: str,
        record: pb.Record,
        err: nats.js.errors.APIError | None,
        *,
        guessed: bool = False,
    ) -> int:
        """After a rejected or unanswered write: did our own earlier try land?"""
        subject, expected = journal_subject(token.run_id, token.step_id), token.last_seq
        try:
            first = await self._get_msg(seq=expected + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError as missing:
            _unless_stream_missing(missing)
            first = None
        if first is not None and (first.headers or {}).get("Nats-Msg-Id") == msg_id:
            _same_or_fenced(token, _decode(first.data, first.seq), record)
            return int(first.seq or 0)
        if err is None and first is None:
            raise Unavailable(f"could not append to {subject}; try again")
        tail = await self.tail(token.run_id, token.step_id)
        actual = tail.seq if tail is not None else 0
        span = trace.get_current_span()
        span.add_event(
            "guessed tail missed" if guessed else "fenced",
            {"subject": subject, "expected_seq": expected, "actual_seq": actual},
        )
        raise Fenced(
            token.run_id,
            token.step_id,
            expected=expected,
            actual=actual,
            detail=f"{subject}: another holder wrote after sequence {expected} (tail is {actual})",
        )

    async def append_copied(self, record: pb.Record, *, after: int, msg_id: str) -> int:
        """Append a fork's copy of a record to its step's subject after
        ``after`` (0: an empty subject); returns its sequence. No writer
        holds the step yet, so nothing but another copy of the same fork can
        be there: a retry under the same ``msg_id`` answers the one stored.

        Raises:
            Fenced: another record follows ``after``.
        """
        subject = journal_subject(record.run_id, record.step_id)
        headers = {
            "Nats-Msg-Id": msg_id,
            "Nats-Expected-Last-Subject-Sequence": str(after),
            "Dagnats-Kind": record.WhichOneof("kind") or "unknown",
            "Dagnats-Iteration": str(record.iteration),
            "Dagnats-Attempt": str(record.attempt),
        }
        data = record.SerializeToString()

        async def publish() -> int:
            try:
                ack = await self.js.publish(subject, data, headers=headers)
            except nats.js.errors.APIError as err:
                if err.err_code != WRONG_LAST_SEQUENCE:
                    raise
                tail = await self.tail(record.run_id, record.step_id)
                raise Fenced(
                    record.run_id,
                    record.step_id,
                    expected=after,
                    actual=tail.seq if tail is not None else 0,
                    detail=f"{subject}: another record follows sequence {after}",
                ) from err
            return int(ack.seq)

        return await jsx.retry_transient(publish, "copy a record")

    async def tail(self, run_id: str, step_id: str) -> pb.Record | None:
        """The last record of a step, read from the stream leader."""
        subject = journal_subject(run_id, step_id)
        try:
            msg = await self._get_msg(subject=subject)
        except nats.js.errors.NotFoundError as err:
            _unless_stream_missing(err)
            return None
        return _decode(msg.data, msg.seq)

    async def last_written(self, run_id: str, step_id: str) -> Written | None:
        """The last record of a step with its writer's delivery, from the
        stream leader; None for a step without a journal, and without the
        stream itself (then nothing was journaled)."""
        subject = journal_subject(run_id, step_id)
        try:
            msg = await jsx.retry_transient(
                functools.partial(self.js.get_last_msg, jsx.JOURNAL, subject), "read the tail"
            )
        except (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError):
            return None
        return _written(msg)

    async def written_at(self, run_id: str, step_id: str, seq: int) -> Written | None:
        """The record at ``seq`` with its writer's delivery, if it is on the
        step's journal; None otherwise."""
        try:
            msg = await self._get_msg(seq=seq)
        except (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError):
            return None
        if msg.subject != journal_subject(run_id, step_id):
            return None
        return _written(msg)

    # ---- the live preview, on core NATS -------------------------------------------

    async def publish_live(self, event: dict[str, Any]) -> None:
        """Send one preview event; a preview is best-effort, so a lost one is
        not an error."""
        data = json.dumps(event, separators=(",", ":")).encode()
        await self.nc.publish(live_stream_subject(event["run"], event["step"]), data)

    async def watch_live(
        self, run_id: str, step_id: str, deliver: Callable[[bytes], None]
    ) -> Callable[[], Awaitable[None]]:
        """Hand every preview event of a step to ``deliver`` from now on;
        returns once the subscription is in place on the server, with the call
        that ends it."""

        async def on_msg(msg: Msg) -> None:
            deliver(msg.data)

        sub = await self.nc.subscribe(live_stream_subject(run_id, step_id), cb=on_msg)
        await self.nc.flush()
        return sub.unsubscribe

    async def get(self, seq: int) -> pb.Record | None:
        try:
            msg = await self._get_msg(seq=seq)
        except nats.js.errors.NotFoundError as err:
            _unless_stream_missing(err)
            return None
        return _decode(msg.data, msg.seq)

    async def read(
        self, run_id: str, step_id: str, *, after: int, through: int | None = None, limit: int = 0
    ) -> list[pb.Record]:
        """Records of a step with ``after < seq <= through``, one leader read each."""
        subject = journal_subject(run_id, step_id)
        records: list[pb.Record] = []
        seq = after + 1
        while (through is None or seq <= through) and (not limit or len(records) < limit):
            try:
                msg = await self._get_msg(seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError as err:
                _unless_stream_missing(err)
                break
            if through is not None and (msg.seq or 0) > through:
                break
            records.append(_decode(msg.data, msg.seq))
            seq = int(msg.seq or 0) + 1
        return records

    async def read_run(self, run_id: str, *, after: int = 0) -> list[tuple[str, pb.Record]]:
        """Every record of a run's journals with ``seq > after``, each with its
        step and whether it is on the step's spent subject: ``(subject tail,
        record)``, the tail being ``<step>`` or ``<step>.spent``."""
        prefix = run_journal(run_id)[:-1]  # journal.<run>.
        found: list[tuple[str, pb.Record]] = []
        seq = after + 1
        while True:
            try:
                msg = await self._get_msg(seq=seq, subject=run_journal(run_id), next=True)
            except nats.js.errors.NotFoundError as err:
                _unless_stream_missing(err)
                return found
            found.append((str(msg.subject).removeprefix(prefix), _decode(msg.data, msg.seq)))
            seq = int(msg.seq or 0) + 1

    async def append_spent(self, token: pb.WriterToken, record: pb.Record) -> None:
        """Store what a fenced holder's model call spent on the step's spent
        subject: not fenced (its holder is out), deduplicated by the call's
        identity (writer and position) within the stream's duplicate window;
        the ledger's rules charge a call found twice once."""
        position = record.model.position
        msg_id = f"{token.run_id}.{token.step_id}.spent.{token.writer}.{position}"
        await jsx.publish(
            self.js,
            spent_subject(token.run_id, token.step_id),
            record.SerializeToString(),
            msg_id=msg_id,
            headers={"Dagnats-Kind": "spent"},
        )

    async def follow(self, run_id: str, step_id: str, *, from_seq: int) -> AsyncIterator[pb.Record]:
        """Records from ``from_seq`` on, then each new one as it is written. The
        ordered consumer behind it is removed when the iterator is closed."""
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if from_seq else DeliverPolicy.ALL,
            opt_start_seq=from_seq or None,
        )
        sub = await self.js.subscribe(
            journal_subject(run_id, step_id), ordered_consumer=True, config=config
        )
        try:
            async for msg in sub.messages:
                yield _decode(msg.data, msg.metadata.sequence.stream)
        finally:
            await sub.unsubscribe()

    async def purge(self, run_id: str) -> None:
        purge = functools.partial(self.js.purge_stream, jsx.JOURNAL, subject=run_journal(run_id))
        await jsx.retry_transient(purge, "purge the journal")

    async def _get_msg(self, **where: Any) -> RawStreamMsg:
        """One message from the stream leader, read again while JetStream is
        unavailable (a read is always safe to repeat)."""
        get = functools.partial(jsx.get_msg, self.js, jsx.JOURNAL, **where)
        return await jsx.retry_transient(get, "read the journal")


def _same_or_fenced(token: pb.WriterToken, landed: pb.Record | None, record: pb.Record) -> None:
    """A record with our Msg-Id landed: it is our earlier try of this write only
    if it records the same thing. A writer token used again for another record
    (a worker that lost track of its latest token) wrote nothing and is behind."""
    if (
        landed is not None
        and record.WhichOneof("kind") is not None
        and _body(landed) == _body(record)
    ):
        return
    expected = token.last_seq
    actual = landed.seq if landed is not None else expected
    raise Fenced(
        token.run_id,
        token.step_id,
        expected=expected,
        actual=actual,
        detail=f"{journal_subject(token.run_id, token.step_id)}: this writer already wrote "
        f"sequence {actual} with the token it sent; that token is behind",
    )


def _body(record: pb.Record) -> tuple[object, ...]:
    """What a record records: its kind's entry and the one stored ahead of it."""
    kind, leading = record.WhichOneof("kind"), record.WhichOneof("leading")
    return (
        kind,
        getattr(record, kind) if kind else None,
        leading,
        getattr(record, leading) if leading else None,
    )


def _unless_stream_missing(err: nats.js.errors.NotFoundError) -> None:
    """A "not found" is an empty subject, unless the stream itself is gone."""
    if err.err_code == STREAM_NOT_FOUND:
        raise NotProvisioned(
            f"the {jsx.JOURNAL} stream does not exist; provision the streams "
            "(start the engine, or run `dagnats dev`)"
        ) from None


def _written(msg: RawStreamMsg) -> Written:
    delivery = str((msg.headers or {}).get("Dagnats-Delivery", "0"))
    return Written(_decode(msg.data, msg.seq), int(delivery) if delivery.isdigit() else 0)


def _decode(data: bytes | None, seq: int | None) -> pb.Record:
    record = pb.Record.FromString(data or b"")
    record.seq = int(seq or 0)
    return record


def _too_large(kind: str, record: pb.Record, size: int, limit: int) -> str:
    """Why ``record`` (``size`` bytes serialized) is refused: what makes it too
    large, with the numbers."""
    part, part_size = convert.largest_part(record)
    most = f"a journal record is at most {limit:,} bytes"
    if part_size > limit:
        return f"{part} is {part_size:,} bytes; {most}"
    return f"the {kind} record would be {size:,} bytes, {part} {part_size:,} of them; {most}"


__all__ = ["JournalStore", "Written", "journal_subject"]
