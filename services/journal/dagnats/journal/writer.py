"""The journal service's writes: every record goes through :class:`JournalWriter`.

An append stamps the record with its writer's dispatch and view of the tail,
stores it fenced (``JournalStore.append``), and returns the writer's next token.
The writer also keeps two caches, as optimisations only: a miss, on another
replica or after an eviction, reads from the stream instead.

- The replay snapshot (the iteration's records as the claim found them), per writer.
- The last commit it stored on each step: the guessed tail when the step's
  next iteration is claimed. A claim appends after it without reading the
  tail first; the fenced append itself checks the guessed tail
  (``append_on_guessed_tail``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from opentelemetry import trace

from dagnats.core import errors, tracing
from dagnats.core.subjects import journal_subject
from dagnats.core.timestamps import timestamp
from dagnats.journal import convert, replay
from dagnats.journal import model as jm
from dagnats.journal.store import JournalStore
from dagnats.journal.v1 import journal_pb2 as pb

SNAPSHOTS = 4096
COMMITS = 4096
COMMIT_BYTES = 64 * 1024  # a commit with a larger state is read again instead


class JournalWriter:
    def __init__(self, store: JournalStore, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock  # stamps each record's time
        self._snapshots: OrderedDict[tuple[str, str], list[jm.AnyEntry]] = OrderedDict()
        self._commits: OrderedDict[str, pb.Record] = OrderedDict()

    async def append(
        self, token: pb.WriterToken, record: pb.Record
    ) -> tuple[pb.WriterToken, pb.Record]:
        """Store ``record`` after the writer's last seen sequence.

        Returns:
            The writer's next token, and the record as stored (with its sequence).

        Raises:
            Fenced: another writer's record follows ``token.last_seq``.
            RunCancelled: the run was cancelled; nothing was written, but for
                a tool result the record carries (see ``replay.fenced_out_write``).
        """
        self._stamp(token, record)
        try:
            seq = await self.store.append(token, record)
        except errors.Fenced as refused:
            # A result stored after a cancel leaves the writer's tail where
            # it was: its next write is refused by the fence, and decided again.
            return self._stored(
                token, record, await self._fenced_out(token, record, refused), moved=False
            )
        return self._stored(token, record, seq, moved=True)

    async def append_on_guessed_tail(
        self, token: pb.WriterToken, record: pb.Record
    ) -> tuple[pb.WriterToken, pb.Record] | None:
        """Store ``record`` after the guessed tail ``token.last_seq`` (the last
        commit this replica stored on the step), as ``append`` does; None when
        the guessed tail was wrong, and nothing was written: the claim reads
        the tail then, which also tells a cancel."""
        self._stamp(token, record)
        try:
            seq = await self.store.append(token, record, guessed=True)
        except errors.Fenced:
            return None
        return self._stored(token, record, seq, moved=True)

    def _stored(
        self, token: pb.WriterToken, record: pb.Record, seq: int, *, moved: bool
    ) -> tuple[pb.WriterToken, pb.Record]:
        """The writer's next token after ``record`` was stored at ``seq``;
        ``moved``: the writer's tail is now ``seq``."""
        following = pb.WriterToken()
        following.CopyFrom(token)
        if moved:
            following.last_seq = seq
        record.seq = seq
        if record.HasField("commit"):
            self._remember_commit(record)
        following.written = token.written + 1
        following.ClearField("claim")  # stored now
        return following, record

    def _stamp(self, token: pb.WriterToken, record: pb.Record) -> None:
        """Mark ``record`` with its writer's dispatch and view of the tail."""
        record.run_id = token.run_id
        record.step_id = token.step_id
        record.iteration = token.iteration
        record.attempt = token.attempt
        record.writer = token.writer
        record.expected_seq = token.last_seq
        record.base_seq = token.base_seq
        record.time.CopyFrom(timestamp(self.clock()))
        if token.HasField("claim"):  # a dispatch handed over with the last commit
            record.leading_claim.CopyFrom(token.claim)
        if token.build_id and not record.HasField("commit"):  # a commit carries its own
            record.build_id = token.build_id
        headers: dict[str, str] = {}
        tracing.inject(headers)
        record.trace_context.update(headers)

    async def _fenced_out(
        self, token: pb.WriterToken, record: pb.Record, refused: errors.Fenced
    ) -> int:
        """The fence refused ``record``: raise ``Fenced`` as it did, or
        ``RunCancelled`` when the step's tail is a cancel; a tool result the
        record carries is stored after the cancel (its sequence is returned
        when the record was that result alone). Only a refused write reads."""
        run_id, step_id = token.run_id, token.step_id
        tail = await self.store.tail(run_id, step_id)
        tail_entries = convert.entries(tail) if tail is not None else []
        if replay.cancel_of(tail_entries) is None:
            raise refused
        after = await self.store.read(run_id, step_id, after=token.last_seq, limit=1)
        result = None if token.HasField("claim") else _carried_result(record)
        decision = replay.fenced_out_write(
            tail=tail_entries,
            first=convert.entry(after[0]) if after else None,
            writer=token.writer,
            result_for=result.intent_seq if result is not None else 0,
            result_index=result.intent_index if result is not None else 0,
        )
        match decision:
            case replay.FencedWrite():
                raise refused
            case replay.Cancelled(reason=reason):
                raise cancelled(token, reason)
            case replay.StoredAfterCancel(seq=seq):
                stored = seq
            case replay.StoreAfterCancel(after=tail_seq, cancel=cancel):
                assert result is not None
                kept = pb.Record(cancel=pb.Cancel(reason=cancel.reason))
                kept.leading_tool_result.CopyFrom(result)
                behind = pb.WriterToken()
                behind.CopyFrom(token)
                behind.last_seq = tail_seq
                self._stamp(behind, kept)
                try:
                    stored = await self.store.append(behind, kept)
                except errors.Fenced:
                    raise cancelled(token, cancel.reason) from None
        if not record.HasField("tool_result"):
            raise cancelled(token, reason_of(tail_entries))  # its result kept, the rest refused
        return stored

    async def check_tail(self, token: pb.WriterToken) -> None:
        """Raise ``Fenced`` unless the step's tail is still the writer's last
        record; ``RunCancelled`` when it is a cancel."""
        tail = await self.store.tail(token.run_id, token.step_id)
        actual = tail.seq if tail else 0
        if actual != token.last_seq:
            if (cancel := replay.cancel_of(convert.entries(tail) if tail else [])) is not None:
                raise cancelled(token, cancel.reason)
            raise fenced(token, actual)

    def remember(self, token: pb.WriterToken, entries: list[jm.AnyEntry]) -> None:
        key = _key(token)
        self._snapshots[key] = entries
        self._snapshots.move_to_end(key)
        while len(self._snapshots) > SNAPSHOTS:
            self._snapshots.popitem(last=False)

    def last_commit(self, run_id: str, step_id: str) -> pb.Record | None:
        """The last commit this writer stored on the step, if it is still cached."""
        return self._commits.get(journal_subject(run_id, step_id))

    def _remember_commit(self, record: pb.Record) -> None:
        subject = journal_subject(record.run_id, record.step_id)
        if record.ByteSize() > COMMIT_BYTES:
            self._commits.pop(subject, None)
            return
        self._commits[subject] = record
        self._commits.move_to_end(subject)
        while len(self._commits) > COMMITS:
            self._commits.popitem(last=False)

    def forget(self, token: pb.WriterToken) -> None:
        """Drop the writer's snapshot (its dispatch committed)."""
        self._snapshots.pop(_key(token), None)

    async def snapshot(self, token: pb.WriterToken) -> list[jm.AnyEntry]:
        """The iteration's records as the claim found them (plus what it closed)."""
        cached = self._snapshots.get(_key(token))
        if cached is not None:
            return cached
        found = await self.store.read(
            token.run_id, token.step_id, after=token.base_seq, through=token.snapshot_seq
        )
        entries = convert.all_entries(r for r in found if r.iteration == token.iteration)
        self.remember(token, entries)
        return entries


def fenced(token: pb.WriterToken, actual: int) -> errors.Fenced:
    """The error of a writer whose tail moved on to ``actual``, as a span event too."""
    trace.get_current_span().add_event(
        "fenced", {"expected_seq": token.last_seq, "actual_seq": actual}
    )
    return errors.Fenced(
        token.run_id,
        token.step_id,
        expected=token.last_seq,
        actual=actual,
        detail=f"{journal_subject(token.run_id, token.step_id)}: a successor holds the step "
        f"(expected tail {token.last_seq}, found {actual})",
    )


def cancelled(token: pb.WriterToken, reason: str) -> errors.RunCancelled:
    """The error of a write refused because the run was cancelled."""
    trace.get_current_span().add_event("cancelled", {"expected_seq": token.last_seq})
    why = f": {reason}" if reason else ""
    return errors.RunCancelled(
        token.run_id,
        f"run {token.run_id} was cancelled{why}; the journal of step {token.step_id} "
        "takes no new call",
        step_id=token.step_id,
    )


def reason_of(tail: list[jm.AnyEntry]) -> str:
    """The cancel's reason, from the entries of a tail that is a cancel."""
    cancelled = replay.cancel_of(tail)
    return cancelled.reason if cancelled is not None else ""


def _carried_result(record: pb.Record) -> pb.ToolResult | None:
    """The tool result ``record`` carries: its kind's, or the one ahead of it."""
    if record.HasField("tool_result"):
        return record.tool_result
    if record.HasField("leading_tool_result"):
        return record.leading_tool_result
    return None


def _key(token: pb.WriterToken) -> tuple[str, str]:
    return journal_subject(token.run_id, token.step_id), token.writer
