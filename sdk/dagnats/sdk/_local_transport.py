"""The client of the services' local socket (``dagnats.engine.local_transport``).

For a client on the services' host: the journal's Session calls, PollTasks
and WatchRun in ``LocalCall`` envelopes on a Unix socket, framed
(``dagnats.core.frames``), without HTTP/2 and grpc's threads, which cost a
call more than the call's own work. A :class:`LocalConnection` carries one
call at a time; a call fails as the same gRPC call would: the service's
domain error, raised as its RPC raises it, or :class:`TransportError` with
the status gRPC would have ended it with: UNAVAILABLE when the socket cannot
be reached or the connection ends (so the call is tried again within the
lease, and a services restart costs nothing), DEADLINE_EXCEEDED, or the
server's refusal (UNAUTHENTICATED, PERMISSION_DENIED, FAILED_PRECONDITION).

A call that waits with nothing arriving (a watch of a run that goes on, a
long poll) is kept alive by a ping: a connection looks every third of its
``keepalive`` (``DAGNATS_LOCAL_KEEPALIVE``, seconds) whether a frame came
since it last looked; when none did while a call waits, it sends a ping (an
empty frame), and when none came after the ping either, it ends with
UNAVAILABLE, as gRPC's keepalive breaks a stream to a frozen server. So a
services process frozen (SIGSTOP), or a socket left open by a process that no
longer reads it, ends the call within ``keepalive``; the SDK then tries again
as after any broken connection. A call answered in time costs nothing more:
the look is one timer a connection, not one a call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from dagnats.core.frames import Frames, TransportError
from dagnats.core.grpcutil import status_code
from dagnats.core.settings import env_seconds
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk._errors import answered_error

log = logging.getLogger("dagnats.sdk")
# DAGNATS_LOCAL_SOCKET's value that keeps the journal calls on gRPC.
OFF = "off"
# Seconds within which a call on the socket that nothing answers, not even
# a ping, ends (DAGNATS_LOCAL_KEEPALIVE).
DEFAULT_LOCAL_KEEPALIVE = 10.0
# A connection looks for silence this many times per keepalive.
LOOKS = 3
R = TypeVar("R", bound=Message)


def not_a_socket(path: str) -> str | None:
    """Why nothing can connect to a Unix socket at ``path``; None when it is one."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError as err:
        return err.strerror or str(err)
    return "not a socket"


class LocalConnection(Frames):
    """A connection to the local socket at ``path``, made on its first call:
    the hello (``token``; with ``instance``, the socket a poll's answer
    named, and no other), then one call at a time.

    ``refused`` is told why when the connection ends before its first answer:
    the socket could not be reached, or its server would not take the hello
    or the call's method; :meth:`not_sent` then says that the server cannot
    have taken the call. A call left before its answer (cancelled, timed out)
    closes the connection, which cancels it on the server.
    """

    def __init__(
        self,
        path: str,
        token: str | None = None,
        *,
        instance: str = "",
        refused: Callable[[str], None] | None = None,
        keepalive: float = DEFAULT_LOCAL_KEEPALIVE,
    ) -> None:
        super().__init__()
        self._path = path
        self._keepalive = keepalive
        self._heard = 0  # frames since the connection last looked for silence
        self._pinged = False  # a ping went unanswered so far
        self.pings = 0  # pings sent
        self._look: asyncio.TimerHandle | None = None
        self._hello = pb.LocalHello(token=token or "", instance=instance)
        self._refused = refused
        self._answered = False
        self._frames: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended: TransportError | None = None
        self._sent = 0
        self._open: LocalStream[Any] | None = None  # a stream not read to its end
        self._refused_first = False  # the server refused before any answer

    async def call(
        self, method: str, request: Message, answer: type[R], trace_context: Mapping[str, str]
    ) -> R:
        """``method``'s answer to ``request``.

        Raises:
            TransportError: the transport failed (see the module).
            DagnatsError: the service's domain error, as its RPC raises it.
        """
        try:
            sent = await self._send(method, request, trace_context)
            found = await self._receive(sent)
        except TransportError:
            raise
        except BaseException:  # cancelled: the answer, if any, is for nobody
            self.close()
            raise
        result = found.WhichOneof("result")
        if result == "response":
            return answer.FromString(found.response)
        if result == "error":
            raise answered_error(found.error)
        self._end(grpc.StatusCode.INTERNAL, f"{method} was answered with {result}")
        raise self._failure()

    async def stream(
        self, method: str, request: Message, answer: type[R], trace_context: Mapping[str, str]
    ) -> LocalStream[R]:
        """Send ``request`` to the streaming ``method``; its messages are read
        from the stream returned. See :meth:`call` for what it raises."""
        try:
            sent = await self._send(method, request, trace_context)
        except TransportError:
            raise
        except BaseException:
            self.close()
            raise
        stream = LocalStream(self, sent, answer)
        self._open = stream
        return stream

    def done(self) -> bool:
        """Whether the connection has ended: it takes no more calls."""
        return self._ended is not None

    def idle(self) -> bool:
        """Whether the connection may take the next call."""
        return self._open is None and self._ended is None

    def not_sent(self) -> bool:
        """Whether the last call cannot have been taken: the socket was not
        reached, or the server refused before its first answer."""
        return self.transport is None or self._refused_first

    def cancel(self) -> bool:
        """End the connection from this side; False if it had ended."""
        if self._ended is not None:
            return False
        self._answered = True  # ended by its owner, not refused
        self._end(grpc.StatusCode.CANCELLED, "the connection was closed")
        return True

    def close(self) -> None:
        self.cancel()

    async def _send(self, method: str, request: Message, trace_context: Mapping[str, str]) -> int:
        if self._ended is not None:
            raise self._failure()
        if self.transport is None:
            loop = asyncio.get_running_loop()
            try:
                await loop.create_unix_connection(lambda: self, self._path)
            except OSError as err:
                self._end(grpc.StatusCode.UNAVAILABLE, f"local socket {self._path}: {err}")
                raise self._failure() from None
            self.send(self._hello)
        self._sent += 1
        call = pb.LocalCall(
            id=self._sent,
            method=method,
            trace_context=trace_context,
            request=request.SerializeToString(),
        )
        self.send(call)
        return self._sent

    async def _receive(self, call: int) -> pb.LocalAnswer:
        """The next answer to ``call``; the server's refusal, or the end,
        raised. Answers to an earlier call (the end of a stream its reader
        left at its last message) are skipped."""
        while True:
            while not self._frames:
                if self._ended is not None:
                    raise self._failure()
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            answer = pb.LocalAnswer.FromString(self._frames.popleft())
            if answer.id == 0 and answer.HasField("error"):  # the server ends the connection
                self._refused_first = not self._answered
                self._ended = None  # its reason, not the closed connection that followed
                self._end(status_code(answer.error.status), answer.error.message)
                raise self._failure()
            if answer.id < call:
                continue
            if answer.id != call:
                self._end(grpc.StatusCode.UNAVAILABLE, "an answer to another call")
                raise self._failure()
            self._answered = True
            return answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._look_later()

    def _look_later(self) -> None:
        loop = asyncio.get_running_loop()
        self._look = loop.call_later(self._keepalive / LOOKS, self._look_for_silence)

    def _look_for_silence(self) -> None:
        """Every third of the keepalive: while a call waits and nothing came
        since the last look, ping; if the ping got nothing back, end."""
        self._look = None
        if self._ended is not None:
            return
        waiting = self._waiter is not None and not self._waiter.done()
        if self._heard or not waiting:
            self._heard, self._pinged = 0, False
        elif self._pinged:
            self._end(
                grpc.StatusCode.UNAVAILABLE,
                f"the local socket {self._path} did not answer a ping in "
                f"{self._keepalive:g}s (DAGNATS_LOCAL_KEEPALIVE)",
            )
            return
        else:
            self._pinged = True
            self.pings += 1
            self.send_ping()
        self._look_later()

    def on_frame(self, frame: bytes) -> None:
        self._heard += 1
        if not frame:  # the answer to a ping
            return
        self._frames.append(frame)
        self._wake()

    def on_oversize(self, length: int) -> None:
        self._end(grpc.StatusCode.INTERNAL, f"the server sent a frame of {length} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ended is None:
            self._end(grpc.StatusCode.UNAVAILABLE, f"the local socket {self._path} closed")

    def _end(self, status: grpc.StatusCode, details: str) -> None:
        if self._ended is None:
            self._ended = TransportError(status, details)
        if self._look is not None:
            self._look.cancel()
            self._look = None
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _failure(self) -> TransportError:
        """What ended the connection, as raised to its caller; ``refused``
        hears of it when it came before the first answer."""
        assert self._ended is not None
        if not self._answered and self._refused is not None:
            self._refused(self._ended.message or self._ended.code.name)
        return self._ended

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class LocalStream(Generic[R]):
    """The messages of one streaming call on a :class:`LocalConnection`, in
    order, to the stream's end; its error raised. ``cancel`` leaves it
    (closing the connection, which cancels the call on the server);
    ``release`` leaves it at a last message the caller knows ends it, which
    leaves the connection for the next call."""

    def __init__(self, connection: LocalConnection, call: int, answer: type[R]) -> None:
        self.connection = connection
        self._call = call
        self._answer = answer
        self._ended = False

    def __aiter__(self) -> LocalStream[R]:
        return self

    async def __anext__(self) -> R:
        if self._ended:
            raise StopAsyncIteration
        connection = self.connection
        try:
            found = await connection._receive(self._call)
        except TransportError:
            self._ended = True
            raise
        except BaseException:
            self.cancel()
            raise
        result = found.WhichOneof("result")
        if result == "response":
            return self._answer.FromString(found.response)
        self._left()
        if result == "error":
            raise answered_error(found.error)
        raise StopAsyncIteration

    def release(self) -> None:
        """The caller read the last message it needs, which the server sends
        last: the connection may carry the next call (this one's end, when it
        comes, is skipped)."""
        self._left()

    def cancel(self) -> bool:
        """Leave the stream; False when it had ended or was released."""
        if self._ended or self.connection.done():
            return False
        self._left()
        self.connection.close()
        return True

    def _left(self) -> None:
        self._ended = True
        if self.connection._open is self:
            self.connection._open = None


class FoundSocket:
    """The local socket the worker's polls were answered with.

    A poll's answer names the socket of the process that served it; where
    that path is a socket on this host too, the journal calls, the polls and
    the watches go there, and stay there while it serves: the polls of a
    worker whose address leads to several services processes name each one's
    socket in turn, and every one of them reaches the same journal; but a new
    instance at its path is taken at once, as its server replaced the one
    that listened there. A connection to it that ends before its first answer
    (the path is another host's, or another server's, or not the worker's to
    open; the server stopped) puts them back on gRPC until a poll names a
    socket not refused before: that one is not taken again.
    """

    def __init__(self, token: str | None, *, keepalive: float | None = None) -> None:
        self._token = token
        self._keepalive = (
            env_seconds("DAGNATS_LOCAL_KEEPALIVE", DEFAULT_LOCAL_KEEPALIVE)
            if keepalive is None
            else keepalive
        )
        self._socket: pb.LocalSocket | None = None
        self._refused: set[tuple[str, str]] = set()

    def offered(self, socket: pb.LocalSocket) -> bool:
        """An answer named ``socket``: whether the calls go there from now."""
        key = (socket.path, socket.instance)
        current = self._socket
        if key in self._refused:
            return False
        if current is not None:
            if current.path != socket.path or current.instance == socket.instance:
                return False
            # Its path has a new server (a restart): no two listen on one path.
            self._refused.add((current.path, current.instance))
            self._socket = None
        if not_a_socket(socket.path):  # another host's, most likely: nothing to say
            self._refused.add(key)
            return False
        log.info("calls go to the local socket %s", socket.path)
        self._socket = socket
        return True

    def connection(self) -> LocalConnection | None:
        """A connection to the socket, or None while there is none to use."""
        socket = self._socket
        if socket is None:
            return None
        return LocalConnection(
            socket.path,
            self._token,
            instance=socket.instance,
            refused=lambda why: self._refuse(socket, why),
            keepalive=self._keepalive,
        )

    def _refuse(self, socket: pb.LocalSocket, reason: str) -> None:
        self._refused.add((socket.path, socket.instance))
        if self._socket is not None and self._socket == socket:
            self._socket = None
            log.info("local socket calls go on gRPC: %s", reason)
