"""A step's journal as server-sent events.

Each record is one event: ``id`` is the record's sequence, ``event`` is
``record`` and ``data`` the record's JSON (``dagnats.sdk.views.record_dict``).
A client that reconnects with ``Last-Event-ID: n`` gets every record after
``n`` exactly once, in order, because the cursor is the stream sequence
itself. While no record arrives, a comment line every ``sse.KEEPALIVE_SECONDS``
keeps proxies from closing the connection and lets the gateway notice a
client that went away.

A stream ends by itself once the step has finished and every record was sent
(``dagnats.sdk.follow``): one ``end`` event, with no ``id`` (so a client's
``Last-Event-ID`` stays on the last record) and the run's and the step's
status as its data, closes it.

The gateway follows a step once however many clients follow it: a
:class:`Follow` holds one ``follow_step`` (one ordered consumer) and hands each
record to every client's bounded queue. A client joins the queue first, then
reads the records from its cursor to the tail as a page, and skips queued
records it already sent, so it misses and repeats nothing. A client that falls
``BUFFER`` records behind is cut off and resumes with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from dagnats.core.errors import DagnatsError
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.gateway import sse
from dagnats.gateway.backend import Backend
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk.follow import Ending, follow_step
from dagnats.sdk.views import enum_name, record_dict

# Records a slow client may fall behind before it is cut off.
BUFFER = 4096

_END = object()
Item = jpb.Record | Ending | DagnatsError | object


class Follow:
    """One step followed once, for every client that follows it."""

    def __init__(self, follows: Follows, backend: Backend, run_id: str, step_id: str) -> None:
        self._follows = follows
        self.key = (run_id, step_id)
        self.queues: set[asyncio.Queue[Item]] = set()
        self._task = asyncio.create_task(
            self._pump(backend), name=f"journal-follow-{run_id}-{step_id}"
        )

    async def _pump(self, backend: Backend) -> None:
        ending: Item = _END
        try:
            async for item in follow_step(backend.client, backend.journal, *self.key):
                if item is not None:
                    self._send(item)
        except DagnatsError as err:
            ending = err
        finally:
            self._follows.forget(self)
            self._send(ending)

    def _send(self, item: Item) -> None:
        for queue in list(self.queues):
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:  # too slow: cut off, it resumes with Last-Event-ID
                self.queues.discard(queue)
                queue.get_nowait()
                queue.put_nowait(_END)

    def join(self) -> asyncio.Queue[Item]:
        queue: asyncio.Queue[Item] = asyncio.Queue(BUFFER)
        self.queues.add(queue)
        return queue

    def leave(self, queue: asyncio.Queue[Item]) -> None:
        self.queues.discard(queue)
        if not self.queues:
            self._task.cancel()
            self._follows.forget(self)


class Follows:
    """The steps the gateway follows, one :class:`Follow` each."""

    def __init__(self) -> None:
        self._follows: dict[tuple[str, str], Follow] = {}

    def join(
        self, backend: Backend, run_id: str, step_id: str
    ) -> tuple[Follow, asyncio.Queue[Item]]:
        follow = self._follows.get((run_id, step_id))
        if follow is None:
            follow = self._follows[(run_id, step_id)] = Follow(self, backend, run_id, step_id)
        return follow, follow.join()

    def forget(self, follow: Follow) -> None:
        if self._follows.get(follow.key) is follow:
            del self._follows[follow.key]

    def __len__(self) -> int:
        return len(self._follows)


async def events(
    request: Request, backend: Backend, run_id: str, step_id: str, from_seq: int
) -> AsyncIterator[str]:
    """Yield the SSE text of every record from ``from_seq`` on, until the
    client leaves or the step has finished and every record was sent."""
    streams = request.app.state.metrics.streams
    follow, queue = request.app.state.follows.join(backend, run_id, step_id)
    streams.inc()
    last = from_seq - 1
    try:
        yield "retry: 1000\n\n"
        try:
            async for record in backend.journal.read(run_id, step_id, from_seq=from_seq):
                last = record.seq
                yield f"id: {record.seq}\nevent: record\ndata: {_json(record_dict(record))}\n\n"
        except DagnatsError as err:
            yield _error(err)
            return
        while True:
            item = await sse.next_item(request, queue)
            if item is None:
                return
            if isinstance(item, sse.Quiet):
                yield sse.KEEPALIVE
                continue
            if item is _END:
                return
            if isinstance(item, DagnatsError):
                yield _error(item)
                return
            if isinstance(item, Ending):
                yield f"event: end\ndata: {_json(ending_dict(item))}\n\n"
                return
            assert isinstance(item, jpb.Record)
            if item.seq <= last:
                continue  # sent from the page already
            last = item.seq
            yield f"id: {item.seq}\nevent: record\ndata: {_json(record_dict(item))}\n\n"
    finally:
        streams.dec()
        follow.leave(queue)


def _error(err: DagnatsError) -> str:
    body = json.dumps({"code": err.code, "message": err.message})
    return f"event: error\ndata: {body}\n\n"


def ending_dict(ending: Ending) -> dict[str, str]:
    """The data of the ``end`` event."""
    return {
        "run_status": enum_name(epb.RunStatus, ending.run_status),
        "step_status": enum_name(epb.StepStatus, ending.step_status),
    }


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
