"""Faults the soak injects inside the test process, and the record of what
the journal store acknowledged.

:class:`LossyPublish` stands in for a service's JetStream context: some
publishes land and then lose their acknowledgement (a timeout), so the
caller's retry path -- the same Msg-Id again -- runs against a write that is
already stored. :func:`instrumented_journal` makes every ``JournalStore``
created inside it publish through one, and logs each sequence its ``append``
returned (and how each append that returned none ended), so the soak can
check at the end that each acknowledged record is stored at that sequence.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import nats.errors

from dagnats.journal.store import JournalStore, journal_subject
from dagnats.journal.v1 import journal_pb2 as pb


class LossyPublish:
    """A JetStream context whose publishes sometimes land without an ack.

    Everything but ``publish`` goes straight to the wrapped context.
    """

    def __init__(self, js: Any, rng: random.Random, faults: Counter[str], rate: float) -> None:
        self._js = js
        self._rng = rng
        self._faults = faults
        self.rate = rate
        self.active = True
        self.subjects: Counter[str] = Counter()  # the acks lost, by subject

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish(self, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        ack = await self._js.publish(subject, payload, **kwargs)
        if self.active and self._rng.random() < self.rate:
            self._faults["lost-ack"] += 1
            self.subjects[subject] += 1
            raise nats.errors.TimeoutError
        return ack


@dataclass(frozen=True, slots=True)
class Ack:
    """A record the journal store said it stored at ``seq``."""

    subject: str
    msg_id: str
    kind: str
    seq: int


@dataclass
class JournalTap:
    """What :func:`instrumented_journal` collected."""

    acks: list[Ack] = field(default_factory=list)
    # Msg-Id -> how an append that returned no sequence ended (its exception).
    failed: dict[str, str] = field(default_factory=dict)
    publishers: list[LossyPublish] = field(default_factory=list)

    def lose_acks(self, active: bool) -> None:
        for publisher in self.publishers:
            publisher.active = active


@contextlib.contextmanager
def instrumented_journal(
    rng: random.Random, faults: Counter[str], rate: float
) -> Iterator[JournalTap]:
    """Every ``JournalStore`` created inside publishes through a
    :class:`LossyPublish`, and every sequence its ``append`` returns is logged."""
    tap = JournalTap()
    init, append = JournalStore.__init__, JournalStore.append

    def lossy_init(self: JournalStore, nc: Any) -> None:
        init(self, nc)
        publisher = LossyPublish(self.js, rng, faults, rate)
        tap.publishers.append(publisher)
        self.js = publisher  # type: ignore[assignment]

    async def logged_append(
        self: JournalStore, token: pb.WriterToken, record: pb.Record, *, guessed: bool = False
    ) -> int:
        # The store's Msg-Id: the dispatch, the writer's nonce, its record count.
        msg_id = (
            f"{token.run_id}.{token.step_id}.{token.iteration}.{token.attempt}"
            f".{token.writer}.{token.written}"
        )
        try:
            seq = await append(self, token, record, guessed=guessed)
        except BaseException as err:
            tap.failed[msg_id] = type(err).__name__
            raise
        subject = journal_subject(token.run_id, token.step_id)
        tap.acks.append(Ack(subject, msg_id, record.WhichOneof("kind") or "unknown", seq))
        return seq

    with (
        mock.patch.object(JournalStore, "__init__", lossy_init),
        mock.patch.object(JournalStore, "append", logged_append),
    ):
        yield tap
