"""A step's journal as server-sent events.

Each record is one event: ``id`` is the record's sequence, ``event`` is
``record`` and ``data`` the record's JSON (``dagnats.sdk.views.record_dict``).
A client that reconnects with ``Last-Event-ID: n`` gets every record after
``n`` exactly once, in order, because the cursor is the stream sequence
itself. While no record arrives, a comment line every ``KEEPALIVE_SECONDS``
keeps proxies from closing the connection and lets the gateway notice a
client that went away.

A stream ends by itself once the step has finished: when the run or the step
is seen in a final state, the journal's tail is read, and when every record
up to it was sent, one ``end`` event (no ``id``; its data the run's and the
step's status) closes the stream. The step is looked at
when the stream opens, after each commit that completes or fails it, and
every ``STATUS_SECONDS`` while nothing arrives (a cancel writes no commit).
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
from dagnats.sdk.views import enum_name, record_dict

KEEPALIVE_SECONDS = 15.0
# How often a quiet stream looks whether its step has finished.
STATUS_SECONDS = 5.0
# Records read ahead of a slow client; the reader waits when it is full.
BUFFER = 256

_END = object()
_FINAL_STEP = frozenset(
    {epb.STEP_STATUS_COMPLETED, epb.STEP_STATUS_FAILED, epb.STEP_STATUS_CANCELLED}
)
_FINAL_ACTIONS = frozenset({jpb.ACTION_COMPLETE, jpb.ACTION_FAIL, jpb.ACTION_FAIL_PERMANENT})


async def events(
    request: Request, backend: Backend, run_id: str, step_id: str, from_seq: int
) -> AsyncIterator[str]:
    """Yield the SSE text of every record from ``from_seq`` on, until the
    client leaves or the step has finished and every record was sent."""
    streams = request.app.state.metrics.streams
    queue: asyncio.Queue[jpb.Record | DagnatsError | object] = asyncio.Queue(BUFFER)
    journal = backend.journal

    async def pump() -> None:
        try:
            async for record in journal.read(run_id, step_id, from_seq=from_seq, follow=True):
                await queue.put(record)
        except DagnatsError as err:
            await queue.put(err)
        await queue.put(_END)

    reader = asyncio.create_task(pump(), name=f"journal-sse-{run_id}-{step_id}")
    streams.inc()
    loop = asyncio.get_running_loop()
    sent = max(from_seq, 1) - 1  # the last sequence sent, or the one before the cursor
    end: _Ending | None = None
    look = True  # whether to look at the step before waiting again
    quiet_since = loop.time()
    try:
        yield "retry: 1000\n\n"
        while True:
            if look and end is None:
                try:
                    end = await _ending(backend, run_id, step_id, after=sent)
                except DagnatsError as err:
                    yield _error(err)
                    return
                look = False
            if end is not None and sent >= end.tail:
                yield end.event()
                return
            try:
                item = await asyncio.wait_for(queue.get(), STATUS_SECONDS)
            except TimeoutError:
                look = True
                if loop.time() - quiet_since >= KEEPALIVE_SECONDS:
                    if await request.is_disconnected():
                        return
                    quiet_since = loop.time()
                    yield ": keepalive\n\n"
                continue
            if item is _END:
                return
            if isinstance(item, DagnatsError):
                yield _error(item)
                return
            assert isinstance(item, jpb.Record)
            sent, quiet_since = item.seq, loop.time()
            look = item.HasField("commit") and item.commit.action in _FINAL_ACTIONS
            data = json.dumps(record_dict(item), separators=(",", ":"))
            yield f"id: {item.seq}\nevent: record\ndata: {data}\n\n"
    finally:
        streams.dec()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


def _error(err: DagnatsError) -> str:
    body = json.dumps({"code": err.code, "message": err.message})
    return f"event: error\ndata: {body}\n\n"


class _Ending:
    """A finished step: its statuses and the last record of its journal."""

    def __init__(self, run: epb.Run, step: epb.StepState | None, tail: int) -> None:
        self.run_status = enum_name(epb.RunStatus, run.status)
        self.step_status = enum_name(epb.StepStatus, step.status) if step else "pending"
        self.tail = tail

    def event(self) -> str:
        body = {"run_status": self.run_status, "step_status": self.step_status}
        return f"event: end\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _ending(backend: Backend, run_id: str, step_id: str, *, after: int) -> _Ending | None:
    """The ending of a step that has finished (its run has, or the step is in a
    final state), else None. The tail is read after the status, so no record
    the step wrote before it finished is left out."""
    run = await backend.client.get_run(run_id)
    step = next((s for s in run.steps if s.step_id == step_id), None)
    if run.status == epb.RUN_STATUS_RUNNING and (step is None or step.status not in _FINAL_STEP):
        return None
    tail = after
    async for record in backend.journal.read(run_id, step_id, from_seq=after + 1):
        tail = record.seq
    return _Ending(run, step, tail)
