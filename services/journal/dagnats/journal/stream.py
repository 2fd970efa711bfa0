"""A step's live preview: chunks a holder streams, on core NATS.

A preview is not a record (the spec's PutStream): chunks go to the readers of
``dagnats.stream.<run>.<step>`` with no stream behind them, so they cost no
fsync and a reader that was not listening never sees them. The markers tie
the preview to the journal: ``committed`` (the sequence of the record that
holds the model response, sent once it is stored: by RecordModel, or with the
intent or commit it rode), ``claim`` (a successor holds the step: every
open stream of another writer is abandoned) and ``abandoned`` (the call
failed). Run and step ids are validated tokens before they reach a subject,
so nothing from a request becomes a wildcard.

A watcher starts from the journal's tail (the writer of the step's last claim
wrote it), so it knows the holder before any chunk arrives, and keeps every
marker however far behind it falls: past ``WATCH_BUFFER`` chunks it drops
chunks and puts a ``gap`` event in their place.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dagnats.core import errors
from dagnats.journal.v1 import journal_pb2 as pb

MAX_CHUNK = 64 * 1024


def stream_id(writer: str, position: int) -> str:
    """A stream's name: one writer's preview of one call position."""
    return f"{writer}.{position}"


_HEAD = ("run", "step", "iteration", "attempt", "position", "writer")


def _head(token: pb.WriterToken, position: int) -> dict[str, Any]:
    return {
        "run": token.run_id,
        "step": token.step_id,
        "iteration": token.iteration,
        "attempt": token.attempt,
        "position": position,
        "writer": token.writer,
    }


def chunk_event(request: pb.PutStreamRequest) -> dict[str, Any]:
    """The event a chunk is published as; raises InvalidArgument for a bad one."""
    if request.seq < 1:
        raise errors.InvalidArgument("seq must be >= 1", field="seq")
    event = _head(request.token, request.position) | {"seq": request.seq}
    match request.WhichOneof("chunk"):
        case "text":
            if len(request.text.encode()) > MAX_CHUNK:
                raise errors.InvalidArgument(f"text is over {MAX_CHUNK} bytes", field="text")
            event |= {"type": "token", "text": request.text}
        case "json":
            if len(request.json) > MAX_CHUNK:
                raise errors.InvalidArgument(f"json is over {MAX_CHUNK} bytes", field="json")
            try:
                event |= {"type": "token", "json": json.loads(request.json)}
            except ValueError as err:
                raise errors.InvalidArgument(f"json must be JSON: {err}", field="json") from None
        case "abandon":
            event |= {"type": "abandoned", "reason": "failed"}
        case _:
            raise errors.InvalidArgument("a chunk needs text, json or abandon", field="chunk")
    if request.dropped:
        event["dropped"] = request.dropped
    return event


def committed_event(token: pb.WriterToken, record: pb.Record) -> dict[str, Any]:
    """The marker that ends a stream once its model response is stored: in a
    record of its own, or ahead of the intent or commit it rode."""
    model = record.model if record.HasField("model") else record.leading_model
    return _head(token, model.position) | {
        "type": "committed",
        "record_seq": record.seq,
        "response": json.loads(model.response),
    }


def claim_event(token: pb.WriterToken) -> dict[str, Any]:
    """The marker a successor's claim sends: other writers' streams are abandoned.
    ``token`` is the claim's (its ``last_seq`` is the claim record's sequence)."""
    return _head(token, -1) | {"type": "claim", "record_seq": token.last_seq}


WATCH_BUFFER = 1024  # chunks a slow WatchStream reader may fall behind


def event_id(event: dict[str, Any]) -> str:
    """An event's id: ``<writer>.<position>.<seq>`` for a chunk (for a gap, the
    last chunk it stands for, so a resume from it goes on after the gap), a
    marker's type in place of the sequence (a claim names only its writer)."""
    if event["type"] == "claim":
        return f"{event['writer']}.claim"
    if event["type"] == "token":
        return f"{stream_id(event['writer'], event['position'])}.{event['seq']}"
    if event["type"] == "gap":
        return f"{stream_id(event['writer'], event['position'])}.{event['last_seq']}"
    return f"{stream_id(event['writer'], event['position'])}.{event['type']}"


class WatchQueue:
    """A watcher's events in the order published, without blocking the
    publisher: at most ``limit`` chunks wait; past that a chunk is dropped and
    counted in a ``gap`` event that takes its place (one per stream, growing
    while its stream's chunks keep being dropped and no marker came). Markers are always kept:
    they are few (a claim per dispatch, an end per call), and a slow reader
    must still learn that a stream ended."""

    def __init__(self, limit: int = WATCH_BUFFER) -> None:
        self._limit = limit
        self._items: deque[dict[str, Any]] = deque()
        self._chunks = 0
        self._gaps: dict[str, dict[str, Any]] = {}  # stream id -> its gap, still queued
        self._ready = asyncio.Event()

    def put(self, raw: bytes) -> None:
        try:
            event = json.loads(raw)
        except ValueError:
            return  # nothing the journal published
        if not isinstance(event, dict):
            return
        if event.get("type") == "token":
            sid = stream_id(event["writer"], event["position"])
            if self._chunks >= self._limit:
                self._drop(sid, event)
                return
            self._gaps.pop(sid, None)  # a later drop gets a gap after this chunk
            self._chunks += 1
        else:
            self._gaps.clear()  # no gap grows past a marker: the order stays as published
        self._items.append(event)
        self._ready.set()

    def _drop(self, sid: str, event: dict[str, Any]) -> None:
        gap = self._gaps.get(sid)
        if gap is None:
            gap = {k: event[k] for k in _HEAD}
            gap |= {"type": "gap", "stream": sid, "first_seq": event["seq"], "dropped": 0}
            self._gaps[sid] = gap
            self._items.append(gap)
            self._ready.set()
        gap["last_seq"] = event["seq"]
        gap["dropped"] += 1

    async def get(self) -> dict[str, Any]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        event = self._items.popleft()
        if event["type"] == "token":
            self._chunks -= 1
        elif event["type"] == "gap" and self._gaps.get(event["stream"]) is event:
            del self._gaps[event["stream"]]  # delivered: it grows no more
        return event


@dataclass(slots=True)
class Event:
    """One event a watcher gets: a chunk or a marker, after the rules."""

    id: str
    type: str
    data: dict[str, Any]

    def json(self) -> str:
        return json.dumps(self.data, separators=(",", ":"))

    def sse(self) -> str:
        return f"id: {self.id}\nevent: {self.type}\ndata: {self.json()}\n\n"


@dataclass(slots=True)
class StreamRules:
    """The rules that tie a step's preview to its journal, for one watcher
    (pure: no I/O). See ``JournalService.WatchStream``."""

    holder: str = ""  # the writer of the last claim seen
    holder_seq: int = 0  # a sequence at or after that claim: older claims are stale
    # With no holder known: the last dispatch whose commit was seen, whose
    # chunks (and any before it) are a finished holder's.
    ended_dispatch: tuple[int, int] = (-1, -1)
    open: dict[str, dict[str, Any]] = field(default_factory=dict)  # stream id -> first event
    ended: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    abandoned_at: dict[tuple[int, int], str] = field(default_factory=dict)
    retry_of: dict[str, str] = field(default_factory=dict)

    @classmethod
    def after(cls, tail: pb.Record | None) -> StreamRules:
        """The rules of a watcher that starts at the step's ``tail`` record:
        every record after a claim is its writer's (the journal is fenced), so
        the tail's writer holds the step, and chunks of any other are dropped
        from the first one on. A commit ends its writer's dispatch: the next
        holder may already stream, its claim handed over with the commit and
        not stored yet (the hand-over), so chunks of a later dispatch are shown until
        a claim names the holder."""
        if tail is None:
            return cls()
        if tail.HasField("commit"):
            return cls(holder_seq=tail.seq, ended_dispatch=(tail.iteration, tail.attempt))
        return cls(holder=tail.writer, holder_seq=tail.seq)

    def apply(self, event: dict[str, Any]) -> list[Event]:
        """The events readers get for one published ``event``."""
        kind = event.get("type")
        if kind == "claim":
            if event.get("record_seq", 0) and event["record_seq"] < self.holder_seq:
                return []  # published late: a claim the watcher's start already follows
            # At the start's own sequence it is that record's claim (nothing
            # changes) or a hand-over fenced on it, the commit.
            self.holder, self.holder_seq = event["writer"], event.get("record_seq", 0)
            out = []
            for sid, first in list(self.open.items()):
                if first["writer"] != self.holder:
                    out.append(self._abandon(sid, first, "superseded"))
            return out
        writer, position = event["writer"], event["position"]
        sid = stream_id(writer, position)
        if kind == "committed":
            self.open.pop(sid, None)
            self.ended.add(sid)
            self.committed.add(sid)
            return [Event(event_id(event), "committed", event | {"stream": sid})]
        if sid in self.ended or (self.holder and writer != self.holder):
            return []  # a finished stream, or a fenced holder's chunk
        if not self.holder and (event["iteration"], event["attempt"]) <= self.ended_dispatch:
            return []  # a chunk of a committed dispatch, or one before it
        if kind == "abandoned":
            return [self._abandon(sid, event, event.get("reason", "failed"))]
        if kind not in ("token", "gap"):
            return []
        if sid not in self.open:
            self.open[sid] = event
            earlier = self.abandoned_at.get((event["iteration"], position))
            if earlier is not None:
                self.retry_of[sid] = earlier
        data = event | {"stream": sid}
        if sid in self.retry_of:
            data["retry_of"] = self.retry_of[sid]
        return [Event(event_id(event), kind, data)]

    def _abandon(self, sid: str, first: dict[str, Any], reason: str) -> Event:
        self.open.pop(sid, None)
        self.ended.add(sid)
        self.abandoned_at[(first["iteration"], first["position"])] = sid
        data = {k: first[k] for k in _HEAD}
        data |= {"type": "abandoned", "reason": reason, "stream": sid}
        return Event(f"{sid}.abandoned", "abandoned", data)
