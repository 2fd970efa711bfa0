"""A step's journal as server-sent events.

Each record is one event: ``id`` is the record's sequence, ``event`` is
``record`` and ``data`` the record's JSON (``dagnats.sdk.views.record_dict``).
A client that reconnects with ``Last-Event-ID: n`` gets every record after
``n`` exactly once, in order, because the cursor is the stream sequence
itself. While no record arrives, a comment line every ``KEEPALIVE_SECONDS``
keeps proxies from closing the connection and lets the gateway notice a
client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request

from dagnats.core.errors import DagnatsError
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import JournalClient
from dagnats.sdk.views import record_dict

KEEPALIVE_SECONDS = 15.0
# Records read ahead of a slow client; the reader waits when it is full.
BUFFER = 256

_END = object()


async def events(
    request: Request, journal: JournalClient, run_id: str, step_id: str, from_seq: int
) -> AsyncIterator[str]:
    """Yield the SSE text of every record from ``from_seq`` on, until the client leaves."""
    streams = request.app.state.metrics.streams
    queue: asyncio.Queue[jpb.Record | DagnatsError | object] = asyncio.Queue(BUFFER)

    async def pump() -> None:
        try:
            async for record in journal.read(run_id, step_id, from_seq=from_seq, follow=True):
                await queue.put(record)
        except DagnatsError as err:
            await queue.put(err)
        await queue.put(_END)

    reader = asyncio.create_task(pump(), name=f"journal-sse-{run_id}-{step_id}")
    streams.inc()
    try:
        yield "retry: 1000\n\n"
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                yield ": keepalive\n\n"
                continue
            if item is _END:
                return
            if isinstance(item, DagnatsError):
                body = json.dumps({"code": item.code, "message": item.message})
                yield f"event: error\ndata: {body}\n\n"
                return
            assert isinstance(item, jpb.Record)
            data = json.dumps(record_dict(item), separators=(",", ":"))
            yield f"id: {item.seq}\nevent: record\ndata: {data}\n\n"
    finally:
        streams.dec()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
