"""A step's journal as server-sent events.

Each record is one event: ``id`` is the record's sequence, ``event`` is
``record`` and ``data`` the record's JSON (``dagnats.sdk.views.record_dict``).
A client that reconnects with ``Last-Event-ID: n`` gets every record after
``n`` exactly once, in order, because the cursor is the stream sequence
itself. While no record arrives, a comment line every ``KEEPALIVE_SECONDS``
keeps proxies from closing the connection and lets the gateway notice a
client that went away.

A stream ends by itself once the step has finished and every record was sent
(``dagnats.sdk._follow``): one ``end`` event, with no ``id`` (so a client's
``Last-Event-ID`` stays on the last record) and the run's and the step's
status as its data, closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request

from dagnats.core.errors import DagnatsError
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.gateway.backend import Backend
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._follow import Ending, follow_step
from dagnats.sdk.views import enum_name, record_dict

KEEPALIVE_SECONDS = 15.0
# Records read ahead of a slow client; the reader waits when it is full.
BUFFER = 256

_END = object()


async def events(
    request: Request, backend: Backend, run_id: str, step_id: str, from_seq: int
) -> AsyncIterator[str]:
    """Yield the SSE text of every record from ``from_seq`` on, until the
    client leaves or the step has finished and every record was sent."""
    streams = request.app.state.metrics.streams
    queue: asyncio.Queue[jpb.Record | Ending | DagnatsError | object] = asyncio.Queue(BUFFER)

    async def pump() -> None:
        try:
            async for item in follow_step(
                backend.client, backend.journal, run_id, step_id, from_seq=from_seq
            ):
                if item is not None:
                    await queue.put(item)
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
            if isinstance(item, Ending):
                yield f"event: end\ndata: {_json(ending_dict(item))}\n\n"
                return
            assert isinstance(item, jpb.Record)
            yield f"id: {item.seq}\nevent: record\ndata: {_json(record_dict(item))}\n\n"
    finally:
        streams.dec()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


def ending_dict(ending: Ending) -> dict[str, str]:
    """The data of the ``end`` event."""
    return {
        "run_status": enum_name(epb.RunStatus, ending.run_status),
        "step_status": enum_name(epb.StepStatus, ending.step_status),
    }


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
