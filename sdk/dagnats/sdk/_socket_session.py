"""A journal Session on the services' session socket (ADR 45).

For a worker on the services' host: the same ``SessionRequest`` and
``SessionResponse`` messages as the gRPC ``Session`` stream, framed on a Unix
socket (``dagnats.core.frames``), without HTTP/2 and grpc's threads, which
cost a journal call more than the call's own work. It has the shape of the
client's end of a gRPC stream (``SessionStream``), and fails as one does:
``AioRpcError`` UNAVAILABLE when the socket cannot be reached or the
connection ends, so ``JournalSession`` opens another and the call is tried
again within the lease (a services restart costs nothing); a refusal
(UNAUTHENTICATED, PERMISSION_DENIED) carries the server's code and message.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import grpc.aio

from dagnats.core.frames import Frames
from dagnats.core.grpcutil import status_code
from dagnats.journal.v1 import journal_pb2 as jpb


class SocketSession(Frames):
    """One Session on the socket at ``path``, connected on its first write."""

    def __init__(self, path: str, token: str | None = None) -> None:
        super().__init__()
        self._path = path
        self._token = token or ""
        self._frames: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended: grpc.aio.AioRpcError | None = None

    async def write(self, request: jpb.SessionRequest) -> None:
        if self._ended is not None:
            raise self._ended
        if self.transport is None:
            loop = asyncio.get_running_loop()
            try:
                await loop.create_unix_connection(lambda: self, self._path)
            except OSError as err:
                self._end(grpc.StatusCode.UNAVAILABLE, f"session socket {self._path}: {err}")
                raise self._failure() from None
            self.send(jpb.SessionHello(token=self._token))
        self.send(request)

    async def read(self) -> jpb.SessionResponse:
        while not self._frames:
            if self._ended is not None:
                raise self._ended
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        answer = jpb.SessionResponse.FromString(self._frames.popleft())
        if answer.id == 0 and answer.HasField("error"):  # the server ends the session
            self._ended = None  # its reason, not the closed connection that followed
            self._end(status_code(answer.error.status), answer.error.message)
            raise self._failure()
        return answer

    def done(self) -> bool:
        return self._ended is not None

    def cancel(self) -> bool:
        if self._ended is not None:
            return False
        self._end(grpc.StatusCode.CANCELLED, "the session was closed")
        return True

    def on_frame(self, frame: bytes) -> None:
        self._frames.append(frame)
        self._wake()

    def on_oversize(self, length: int) -> None:
        self._end(grpc.StatusCode.INTERNAL, f"the server sent a frame of {length} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ended is None:
            self._end(grpc.StatusCode.UNAVAILABLE, f"the session socket {self._path} closed")

    def _end(self, status: grpc.StatusCode, details: str) -> None:
        if self._ended is None:
            empty = grpc.aio.Metadata()
            self._ended = grpc.aio.AioRpcError(
                status, empty, empty, details=details, debug_error_string=""
            )
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _failure(self) -> grpc.aio.AioRpcError:
        assert self._ended is not None
        return self._ended

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
