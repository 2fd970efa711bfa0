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
import logging
import os
import stat
from collections.abc import Callable
from typing import TypedDict, TypeVar

import grpc
import grpc.aio
from opentelemetry.trace import Span

from dagnats.core import tracing
from dagnats.core.frames import Frames
from dagnats.core.grpcutil import status_code
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._session import answered_error

log = logging.getLogger("dagnats.sdk")
# DAGNATS_JOURNAL_SOCKET's value that keeps the journal calls on gRPC.
OFF = "off"


def not_a_socket(path: str) -> str | None:
    """Why nothing can connect to a Unix socket at ``path``; None when it is one."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError as err:
        return err.strerror or str(err)
    return "not a socket"


A = TypeVar("A", jpb.SessionResponse, pb.SocketPollAnswer, pb.SocketWatchAnswer)


class _Connection(Frames):
    """A connection to the socket at ``path``, made on its first message:
    ``hello`` first, then the caller's frames, each answered in order. It
    ends as a gRPC stream does (``AioRpcError``); a refusal (an answer with
    id 0 and an error, then the close) carries the server's code and message.

    With ``instance`` (a socket a poll's answer named, ADR 46) the hello asks
    for that socket and no other, and ``refused`` is told why when the
    connection ends before its first answer: the socket could not be
    reached, or its server would not take the hello.
    """

    def __init__(
        self, path: str, hello: jpb.SessionHello, refused: Callable[[str], None] | None
    ) -> None:
        super().__init__()
        self._path = path
        self._hello = hello
        self._refused = refused
        self._answered = False
        self._frames: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended: grpc.aio.AioRpcError | None = None
        self.refused_hello = False  # the server refused the hello: it read nothing else

    def done(self) -> bool:
        return self._ended is not None

    async def _send(self, message: jpb.SessionRequest | pb.SocketPoll | pb.SocketWatch) -> None:
        if self._ended is not None:
            raise self._failure()
        if self.transport is None:
            loop = asyncio.get_running_loop()
            try:
                await loop.create_unix_connection(lambda: self, self._path)
            except OSError as err:
                self._end(grpc.StatusCode.UNAVAILABLE, f"session socket {self._path}: {err}")
                raise self._failure() from None
            self.send(self._hello)
        self.send(message)

    async def _receive(self, kind: type[A]) -> A:
        """The next answer; the server's refusal, or the end, raised."""
        while not self._frames:
            if self._ended is not None:
                raise self._failure()
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        answer = kind.FromString(self._frames.popleft())
        if answer.id == 0 and answer.HasField("error"):  # the server ends the connection
            self.refused_hello = not self._answered
            self._ended = None  # its reason, not the closed connection that followed
            self._end(status_code(answer.error.status), answer.error.message)
            raise self._failure()
        self._answered = True
        return answer

    def _close(self, why: str) -> bool:
        """End the connection from this side; False if it had ended."""
        if self._ended is not None:
            return False
        self._answered = True  # ended by its owner, not refused
        self._end(grpc.StatusCode.CANCELLED, why)
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
        """What ended the connection, as raised to its caller; ``refused``
        hears of it when it came before the first answer."""
        assert self._ended is not None
        if not self._answered and self._refused is not None:
            self._refused(self._ended.details() or self._ended.code().name)
        return self._ended

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class SocketSession(_Connection):
    """One Session on the socket at ``path``, connected on its first write,
    in the shape of the client's end of a gRPC stream (``SessionStream``)."""

    def __init__(
        self,
        path: str,
        token: str | None = None,
        *,
        instance: str = "",
        refused: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(path, jpb.SessionHello(token=token or "", instance=instance), refused)

    async def write(self, request: jpb.SessionRequest) -> None:
        await self._send(request)

    async def read(self) -> jpb.SessionResponse:
        return await self._receive(jpb.SessionResponse)

    def cancel(self) -> bool:
        return self._close("the session was closed")


# The name of a poll's client span, as gRPC's interceptor names PollTasks.
POLL_METHOD = f"/{pb.DESCRIPTOR.services_by_name['EngineService'].full_name}/PollTasks"


class SocketPolls(_Connection):
    """The worker's polls on the session socket (ADR 49): a connection of
    their own (its hello sets ``polls``), one poll at a time, since the
    server answers in order and a poll is held up to its wait.

    ``poll`` fails as a gRPC call does: ``AioRpcError`` UNAVAILABLE when the
    socket cannot be reached or the connection ends, DEADLINE_EXCEEDED when
    no answer comes in time, the server's code when it refuses the hello,
    and the domain error when the poll itself is refused. A poll that ends
    without its answer (cancelled, timed out) closes the connection: the
    server then cancels it, which gives back the tasks it pulled.
    """

    def __init__(
        self, path: str, token: str | None, *, instance: str, refused: Callable[[str], None]
    ) -> None:
        hello = jpb.SessionHello(token=token or "", instance=instance, polls=True)
        super().__init__(path, hello, refused)
        self._sent = 0

    async def poll(self, request: pb.PollTasksRequest, *, deadline: float) -> pb.PollTasksResponse:
        carrier: dict[str, str] = {}
        with tracing.client_span(POLL_METHOD, carrier) as span:
            self._sent += 1
            try:
                async with asyncio.timeout(deadline):
                    await self._send(
                        pb.SocketPoll(id=self._sent, trace_context=carrier, request=request)
                    )
                    answer = await self._receive(pb.SocketPollAnswer)
            except TimeoutError:
                self._end(grpc.StatusCode.DEADLINE_EXCEEDED, "PollTasks: no answer")
                raise self._failure() from None
            except BaseException:  # cancelled: the answer, if any, is for nobody
                self._close("the poll was cancelled")
                raise
            if answer.id != self._sent:
                self._end(grpc.StatusCode.UNAVAILABLE, "PollTasks: an answer to another poll")
                raise self._failure()
            if answer.HasField("error"):
                raise answered_error(span, answer.error)
            tracing.set_status(span, grpc.StatusCode.OK, "", server=False)
            return answer.tasks

    def close(self) -> None:
        self._close("the polls' connection was closed")


# The name of a watch's client span, as gRPC's interceptor names WatchRun.
WATCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['EngineService'].full_name}/WatchRun"


class SocketWatches(_Connection):
    """A client's watches on the session socket (ADR 52): a connection of
    their own (its hello sets ``watches``), one watch at a time to its end,
    since the server answers a watch to its end before it reads the next.

    :meth:`watch` fails as opening a gRPC ``WatchRun`` does (see
    :class:`SocketPolls`); ``not_sent`` then says whether the server cannot
    have taken the watch (the socket was unreachable, or refused the hello),
    so that the caller may make it on gRPC at once. A watch left before its
    final state closes the connection, which cancels it on the server.
    """

    def __init__(
        self, path: str, token: str | None, *, instance: str, refused: Callable[[str], None]
    ) -> None:
        hello = jpb.SessionHello(token=token or "", instance=instance, watches=True)
        super().__init__(path, hello, refused)
        self._sent = 0
        self._open = False  # a watch is under way: the connection is not idle
        self.not_sent = False

    async def watch(self, request: pb.WatchRunRequest) -> SocketWatch:
        """Send ``request`` and wait for its first state, with no deadline, as
        a gRPC ``WatchRun`` has none: a start may take as long as the engine's
        own retries."""
        carrier: dict[str, str] = {}
        self._sent += 1
        self._open = True
        with tracing.client_span(WATCH_METHOD, carrier) as span:
            message = pb.SocketWatch(id=self._sent, trace_context=carrier, request=request)
            try:
                await self._send(message)
                first = await self._state(span)
            except grpc.aio.AioRpcError:
                self.not_sent = self.transport is None or self.refused_hello
                raise
            except BaseException:  # cancelled mid-watch, or the watch's own error
                if self._open:
                    self.close()  # the server then cancels the watch
                raise
            tracing.set_status(span, grpc.StatusCode.OK, "", server=False)
            return SocketWatch(self, first, span)

    async def _state(self, span: Span) -> pb.WatchRunResponse:
        """The watch's next state; its error or the connection's end, raised.
        The final state leaves the connection idle, for the next watch."""
        answer = await self._receive(pb.SocketWatchAnswer)
        if answer.id != self._sent:
            self._end(grpc.StatusCode.UNAVAILABLE, "WatchRun: an answer to another watch")
            raise self._failure()
        if answer.HasField("error"):
            self._open = False
            raise answered_error(span, answer.error)
        if answer.state.run.status in FINAL_RUN_STATUSES:
            self._open = False
        return answer.state

    def idle(self) -> bool:
        """Whether the connection may take the next watch."""
        return not self._open and not self.done()

    def close(self) -> None:
        self._close("the watches' connection was closed")


class SocketWatch:
    """One watch on :class:`SocketWatches`, in the shape of a gRPC
    ``WatchRun`` call: its states in order, from the first; ``cancel``
    leaves it (closing the connection, unless the watch has ended)."""

    def __init__(self, watches: SocketWatches, first: pb.WatchRunResponse, span: Span) -> None:
        self.watches = watches
        self._first: pb.WatchRunResponse | None = first
        self._span = span
        self._ended = False  # its final state was read: the connection is another's

    def __aiter__(self) -> SocketWatch:
        return self

    async def __anext__(self) -> pb.WatchRunResponse:
        if self._ended:
            raise StopAsyncIteration
        first, self._first = self._first, None
        state = first if first is not None else await self.watches._state(self._span)
        self._ended = state.run.status in FINAL_RUN_STATUSES
        return state

    def cancel(self) -> bool:
        """Leave the watch; False when it had ended (its connection may
        carry another watch by now)."""
        if self._ended or self.watches.done():
            return False
        self.watches.close()
        return True


class _Checks(TypedDict):
    instance: str
    refused: Callable[[str], None]


class FoundSocket:
    """The session socket the worker's polls were answered with (ADR 46).

    A poll's answer names the socket of the process that served it; where
    that path is a socket on this host too, the journal calls go there, and
    stay there while it serves: the polls of a worker whose address leads to
    several services processes name each one's socket in turn, and every
    one of them reaches the same journal; but a new instance at its path is
    taken at once, as its server replaced the one that listened there. A
    session on it that ends before its first answer (the path is another
    host's, or another server's, or not the worker's to open; the server
    stopped) puts them back on gRPC until a poll names a socket not refused
    before: that one is not taken again.
    """

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._socket: pb.JournalSocket | None = None
        self._refused: set[tuple[str, str]] = set()

    def offered(self, socket: pb.JournalSocket) -> bool:
        """A poll's answer named ``socket``: whether the calls go there from now."""
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
        log.info("calls go to the session socket %s", socket.path)
        self._socket = socket
        return True

    def session(self) -> SocketSession | None:
        """A session on the socket, or None while there is none to use."""
        socket = self._socket
        if socket is None:
            return None
        return SocketSession(socket.path, self._token, **self._checks(socket))

    def polls(self) -> SocketPolls | None:
        """A connection for the polls on the socket, when it takes them
        (ADR 49); None while there is none to use."""
        socket = self._socket
        if socket is None or not socket.polls:
            return None
        return SocketPolls(socket.path, self._token, **self._checks(socket))

    def watches(self) -> SocketWatches | None:
        """A connection for a client's watches on the socket, when it takes
        them (ADR 52); None while there is none to use."""
        socket = self._socket
        if socket is None or not socket.watches:
            return None
        return SocketWatches(socket.path, self._token, **self._checks(socket))

    def _checks(self, socket: pb.JournalSocket) -> _Checks:
        """How a connection to ``socket`` asks for it, and tells of its refusal."""
        return {"instance": socket.instance, "refused": lambda why: self._refuse(socket, why)}

    def _refuse(self, socket: pb.JournalSocket, reason: str) -> None:
        self._refused.add((socket.path, socket.instance))
        if self._socket is not None and self._socket == socket:
            self._socket = None
            log.info("session socket calls go on gRPC: %s", reason)
