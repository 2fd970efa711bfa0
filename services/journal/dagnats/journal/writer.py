"""The journal service's writes: every record goes through :class:`JournalWriter`.

An append stamps the record with its writer's dispatch and view of the tail,
stores it fenced (``JournalStore.append``), and returns the writer's next token.
The writer also keeps two caches, as optimisations only: a miss, on another
replica or after an eviction, reads from the stream instead.

- The replay snapshot (the iteration's records as the claim found them), per writer.
- The last commit it stored on each step: the likely tail when the step's next
  iteration is claimed. A claim appends after it without reading the tail
  first; the fenced append itself checks the guess (see ``Claim``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from opentelemetry import trace

from dagnats.core import errors, tracing
from dagnats.core.subjects import journal_subject
from dagnats.core.timestamps import timestamp
from dagnats.journal import convert
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
        self, token: pb.WriterToken, record: pb.Record, *, guessed: bool = False
    ) -> tuple[pb.WriterToken, pb.Record]:
        """Store ``record`` after the writer's last seen sequence.

        Args:
            guessed: ``token.last_seq`` is a guess at the tail, not a sequence
                the writer read: a miss is no fenced writer (see the store).

        Returns:
            The writer's next token, and the record as stored (with its sequence).

        Raises:
            Fenced: another writer's record follows ``token.last_seq``.
        """
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
        headers: dict[str, str] = {}
        tracing.inject(headers)
        record.trace_context.update(headers)
        seq = await self.store.append(token, record, guessed=guessed)
        record.seq = seq
        if record.HasField("commit"):
            self._remember_commit(record)
        following = pb.WriterToken()
        following.CopyFrom(token)
        following.last_seq = seq
        following.written = token.written + 1
        following.ClearField("claim")  # stored now
        return following, record

    async def hold(self, token: pb.WriterToken) -> None:
        """Raise ``Fenced`` unless the step's tail is still the writer's last record."""
        tail = await self.store.tail(token.run_id, token.step_id)
        actual = tail.seq if tail else 0
        if actual != token.last_seq:
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


def _key(token: pb.WriterToken) -> tuple[str, str]:
    return journal_subject(token.run_id, token.step_id), token.writer
