"""Heard writes: other writers' writes of runs, heard on the runs' subjects (ADR 38).

An engine decides a kept iteration on its own last write of the run and
leaves it unwritten for a while (the deferred write). That is only right if nobody wrote
the run since. Rather than read the run's revision on every such iteration,
the engine listens to every publish to the runs' subjects on its own NATS
connection, and knows which runs another writer wrote since a moment.

Why hearing is enough, on one nats-server: the server hands a publish to its
core subscribers while it takes the publish in, before the stream stores it
and acknowledges its writer; and it writes to one connection in the order it
handed messages to it. Whatever follows another engine's write and reaches
this engine (a commit's event, the ack of the journal append of a commit
that a worker made after that engine told it to go on) comes on this
connection after that write's publish. So when this engine decides on an
event, the write was either heard, or its message waits, parsed, in the
subscription's queue. Both are seen here.

Invariants:

* A mark is taken just before this engine sends a write of the run; the run
  is quiet since the mark when no other writer's publish of the run was
  heard after it. A write this engine sends carries ``WRITER`` with its own
  name, so its own publishes are told apart.
* Nothing is trusted (``quiet_since`` is False, and the caller reads) on a
  cluster, where routes between servers are neither ordered with the stream
  nor lossless; before this engine heard one of its own writes (so the
  subscription is known to deliver); after a reconnect since the mark (the
  publishes sent meanwhile are lost); while a publish waits in the queue;
  and for marks taken before a publish was dropped (a slow consumer).
* Events reach the engine on this connection only: its subscriptions, or
  the journal service of its own process, which shares it
  (``server.start_services``).

The subscription is the store's (``EngineStore.hear_run_writes``); this
module keeps what was heard, and is pure.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["HEARD_RUNS", "WRITER", "Listening", "Mark", "RunWrites"]

# The header naming the engine that wrote a run.
WRITER = "Dagnats-Engine"
# Runs whose last foreign write is remembered one by one; older ones are
# summed up in a floor, which makes every mark before it doubtful.
HEARD_RUNS = 4096


class Listening(NamedTuple):
    """The subscription as its connection sees it now."""

    delivered: int  # publishes the connection took for it, dropped ones too
    pending: int  # taken and not heard yet
    reconnects: int  # of the connection


@dataclass(frozen=True, slots=True)
class Mark:
    """A moment in what was heard: foreign writes heard so far, and the
    connection's reconnects."""

    heard: int
    reconnects: int


class RunWrites:
    """What one engine heard of the writes of runs on its connection."""

    def __init__(self) -> None:
        self.writer = secrets.token_hex(8)
        self._listening: Callable[[], Listening] | None = None
        self._live = False  # heard a write of its own
        self._heard = 0  # foreign writes heard
        self._floor = 0  # marks below it are doubtful
        self._last: OrderedDict[str, int] = OrderedDict()  # run -> its last foreign write
        self._processed = 0
        # Told the run of each other writer's publish, as it is heard.
        self.on_other_write: Callable[[str], None] | None = None

    def listen(self, listening: Callable[[], Listening] | None) -> None:
        """Start trusting what is heard, as ``listening`` says the
        subscription stands; None: stop (nothing is trusted)."""
        self._listening, self._live = listening, False

    def headers(self) -> dict[str, str]:
        """The headers of a write of a run by this engine."""
        return {WRITER: self.writer}

    def heard(self, run_id: str, writer: str | None) -> None:
        """A publish of run ``run_id`` by ``writer``, heard. Called as each
        arrives, with nothing awaited between taking it and this call."""
        self._processed += 1
        if writer == self.writer:
            self._live = True
            return
        self._heard += 1
        if self.on_other_write is not None:
            self.on_other_write(run_id)
        self._last[run_id] = self._heard
        self._last.move_to_end(run_id)
        if len(self._last) > HEARD_RUNS:
            _, forgotten = self._last.popitem(last=False)
            self._floor = max(self._floor, forgotten)

    def mark(self) -> Mark | None:
        """Now, in what was heard; None while nothing heard can be trusted.
        Taken before a write is sent."""
        now = self._settled()
        return Mark(self._heard, now.reconnects) if now is not None else None

    def quiet_since(self, run_id: str, mark: Mark | None) -> bool:
        """Whether no other writer wrote ``run_id`` since ``mark``, as far as
        hearing can tell; False whenever it cannot."""
        now = self._settled()
        if mark is None or now is None:
            return False
        if mark.reconnects != now.reconnects or mark.heard < self._floor:
            return False
        return self._last.get(run_id, 0) <= mark.heard

    def _settled(self) -> Listening | None:
        """The subscription now, if live and every publish it was delivered
        is heard: none waits, none was dropped (a drop makes every mark
        before it doubtful)."""
        if self._listening is None or not self._live:
            return None
        now = self._listening()
        if now.pending:
            return None
        if now.delivered != self._processed:
            self._processed = now.delivered
            self._heard += 1
            self._floor = self._heard
            return None
        return now
