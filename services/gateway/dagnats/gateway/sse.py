"""Server-sent events relayed from an engine stream: a run's changes
(``run_watch``) and the live list of runs (``runs_stream``).

The stream is read by a task of its own into a queue of one, so the engine's
stream waits while the client does (a slow client slows only its own stream;
the engine skips or coalesces what it cannot send). While nothing arrives, a
comment line every ``KEEPALIVE_SECONDS`` keeps proxies from closing the
connection and notices a client that went away. An engine that cannot be
reached ends the stream with an event ``error`` (data: ``code``, ``message``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request

from dagnats.core.errors import DagnatsError

KEEPALIVE_SECONDS = 15.0
KEEPALIVE = ": keepalive\n\n"

T = TypeVar("T")


class Quiet:
    """Nothing arrived for ``KEEPALIVE_SECONDS``, and the client is still there."""


QUIET = Quiet()


async def next_item(request: Request, queue: asyncio.Queue[T]) -> T | Quiet | None:
    """The queue's next item; ``QUIET`` (send ``KEEPALIVE``) when none came for
    ``KEEPALIVE_SECONDS``; None once the client has gone away."""
    try:
        return await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
    except TimeoutError:
        return None if await request.is_disconnected() else QUIET


async def first(source: AsyncGenerator[T, None]) -> T:
    """The first item of ``source``, read before a response starts so that a
    refused request is a 4xx rather than an event; ``source`` is closed when
    that fails."""
    try:
        return await anext(source)
    except BaseException:
        await source.aclose()
        raise


def event(kind: str, data: object) -> str:
    """One event's text."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def relay(
    request: Request,
    source: AsyncGenerator[T, None],
    first: T,
    render: Callable[[T], tuple[str, bool]],
) -> AsyncIterator[str]:
    """The SSE text of ``first`` and each later item of ``source``, as
    ``render`` writes it (the text, and whether it is the last), until the
    last, the client's leaving, or an error; ``source`` is closed at the end."""
    streams = request.app.state.metrics.streams
    streams.inc()
    queue: asyncio.Queue[T | DagnatsError] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put(item)
        except DagnatsError as err:
            await queue.put(err)

    reader = asyncio.create_task(pump(), name="sse-relay")
    try:
        yield "retry: 1000\n\n"
        item: T | DagnatsError = first
        while True:
            if isinstance(item, DagnatsError):
                yield event("error", {"code": item.code, "message": item.message})
                return
            text, last = render(item)
            yield text
            if last:
                return
            while isinstance(got := await next_item(request, queue), Quiet):
                yield KEEPALIVE
            if got is None:
                return
            item = got
    finally:
        streams.dec()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await source.aclose()
