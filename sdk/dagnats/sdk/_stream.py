"""A holder's live preview (the spec's PutStream).

:meth:`TokenStream.put` never waits: chunks go into a bounded buffer that one
``PutStream`` call drains to the journal service. While chunks wait (the link
or the service is slower than the model), a text chunk is coalesced into the
text chunk before it that has not been sent yet (up to ``COALESCE`` bytes), so
text loses nothing. When the buffer is full all the same, the newest chunk is
dropped and counted; the next chunk that fits carries the count as
``dropped``, so a reader sees a marked gap, never a silent one. A stream is
one call position of one writer: :meth:`close` ends the call and waits (a
bounded time) until the service has published what was sent, so the model
record's ``committed`` marker follows the last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from dagnats.journal.v1 import journal_pb2 as jpb

log = logging.getLogger("dagnats.sdk")

BUFFER = 1024  # chunks a stream holds for a slow link before it drops
COALESCE = 16 * 1024  # bytes of text one waiting chunk may grow to
CLOSE_SECONDS = 2.0  # how long close waits for the service to publish the rest

PutStream = Callable[[AsyncIterator[jpb.PutStreamRequest]], Awaitable[jpb.PutStreamResponse]]


class TokenStream:
    """One writer's live preview of one call position."""

    def __init__(self, put: PutStream, token: jpb.WriterToken, position: int) -> None:
        self._token = jpb.WriterToken()
        self._token.CopyFrom(token)
        self.position = position
        self._buffer: deque[jpb.PutStreamRequest] = deque()
        self._ready = asyncio.Event()
        self._closed = False
        self._seq = 0
        self._dropped = 0
        self.dropped_total = 0
        self._task = asyncio.create_task(self._send(put), name=f"put-stream-{position}")

    def put(self, chunk: Any) -> None:
        """Queue a chunk: a ``str`` is text, anything else JSON. Never waits."""
        if self._closed:
            return
        if isinstance(chunk, str) and self._buffer:
            last = self._buffer[-1]
            if last.HasField("text") and len(last.text) + len(chunk) <= COALESCE:
                last.text += chunk
                return
        if len(self._buffer) >= BUFFER:
            self._dropped += 1
            self.dropped_total += 1
            return
        self._seq += 1
        request = jpb.PutStreamRequest(token=self._token, position=self.position, seq=self._seq)
        if isinstance(chunk, str):
            request.text = chunk
        else:
            request.json = json.dumps(chunk, separators=(",", ":")).encode()
        request.dropped, self._dropped = self._dropped, 0
        self._buffer.append(request)
        self._ready.set()

    async def close(self, *, abandon: bool = False) -> None:
        """End the stream; ``abandon`` tells readers the call failed."""
        if self._closed:
            return
        if abandon:
            self._seq += 1
            self._buffer.append(
                jpb.PutStreamRequest(
                    token=self._token, position=self.position, seq=self._seq, abandon=True
                )
            )
        self._closed = True
        self._ready.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), CLOSE_SECONDS)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _requests(self) -> AsyncIterator[jpb.PutStreamRequest]:
        while True:
            while self._buffer:
                yield self._buffer.popleft()
            if self._closed:
                return
            self._ready.clear()
            await self._ready.wait()

    async def _send(self, put: PutStream) -> None:
        try:
            await put(self._requests())
        except Exception as err:  # a preview is best-effort: the record is what counts
            log.warning("live stream of position %d ended: %s", self.position, err)
