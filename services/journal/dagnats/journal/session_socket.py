"""The session socket: journal Sessions without gRPC for workers on this host.

(Its connections can also carry the engine's polls, ADR 49, and its
WatchRun, ADR 52: a hello that asks for them says so.)

A Unix socket beside the gRPC port (ADR 45). Each connection is one Session:
the worker's first frame is a ``SessionHello`` with its token (and, from a
worker that found the socket in a poll's answer, the instance it expects), then
``SessionRequest`` frames, each answered in order by a ``SessionResponse``
from the same ``_answer`` a gRPC Session request goes through (checks, replay
rules, fences, spans, domain errors). A frame is a 4-byte big-endian length
and the message. What a gRPC stream would end with a status ends the
connection after a ``SessionResponse`` with id 0 and that error: a refusal of
the hello, a frame too long or unreadable, an unexpected failure (UNKNOWN,
logged). The worker reads a closed connection as a broken stream and opens
another, as it does on gRPC.

Who may connect: the file is the services' user's alone (mode 0600), and,
when the server takes calls only with a credential, the hello's token must
be one whose role may call ``JournalService/Session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from dagnats.core import errors
from dagnats.core.frames import MAX_FRAME, Frames
from dagnats.core.grpcutil import WireError
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.journal.session import Behaviour, _answer, answered, failed
from dagnats.journal.v1 import journal_pb2 as pb

# sockaddr_un's sun_path holds 108 bytes with the terminating NUL.
MAX_PATH = 107
# Seconds a connection may take to send its hello.
HELLO_SECONDS = 10.0
# Requests read ahead of the one being answered; past this the socket is not
# read until they are (a worker sends one at a time).
READ_AHEAD = 16
# The method a poll on the socket is, for its span.
POLL_METHOD = f"/{epb.DESCRIPTOR.services_by_name['EngineService'].full_name}/PollTasks"
# The method a watch on the socket is, for its span.
WATCH_METHOD = f"/{epb.DESCRIPTOR.services_by_name['EngineService'].full_name}/WatchRun"
M = TypeVar("M", pb.SessionRequest, epb.SocketPoll, epb.SocketWatch)
# The hello's check: None lets the connection in, else the refusal to answer.
Admit = Callable[[str], WireError | None]
log = logging.getLogger(__name__)


def fits(path: Path) -> bool:
    """Whether ``path`` fits a socket address."""
    return len(os.fsencode(path)) <= MAX_PATH


def address(path: Path) -> str | None:
    """``path`` as a process with another working directory reaches it, or
    None when that is too long for a socket address."""
    absolute = os.path.abspath(path)
    return absolute if fits(Path(absolute)) else None


def check_path(path: Path) -> Path:
    """``path`` if a Unix socket can be bound there.

    Raises:
        InvalidArgument: the path is too long for a socket address, or names
            something that is not a socket.
    """
    if not fits(path):
        raise errors.InvalidArgument(
            f"a socket path must be at most {MAX_PATH} bytes, got {len(os.fsencode(path))}: {path}",
            field="session_socket",
        )
    if path.exists() and not stat.S_ISSOCK(path.stat().st_mode):
        raise errors.InvalidArgument(
            f"{path} exists and is not a socket; refusing to replace it", field="session_socket"
        )
    return path


class _Connection(Frames):
    """One worker's Session: the hello, then its requests one at a time."""

    def __init__(self, sockets: SessionSocket) -> None:
        super().__init__()
        self._sockets = sockets
        self._frames: asyncio.Queue[bytes] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._task = asyncio.get_running_loop().create_task(self._serve())
        self._sockets.connections.add(self)
        self._sockets.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._sockets.connections.discard(self)
        if self._task is not None:
            self._task.cancel()  # as a gRPC stream's end cancels its handler

    def on_frame(self, frame: bytes) -> None:
        self._frames.put_nowait(frame)
        if self._frames.qsize() >= READ_AHEAD and self.transport is not None:
            self.transport.pause_reading()

    async def _next(self) -> bytes:
        frame = await self._frames.get()
        transport = self.transport
        if transport is None or transport.is_reading() or transport.is_closing():
            return frame
        if self._frames.qsize() < READ_AHEAD:
            transport.resume_reading()
        return frame

    def on_oversize(self, length: int) -> None:
        self._end(errors.InvalidArgument(f"a frame of {length} bytes is over {MAX_FRAME}"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _end(self, err: WireError) -> None:
        self.send(failed(0, err))
        self.close()

    def _end_unknown(self, err: Exception) -> None:
        """End the connection as a gRPC stream ends on a server error."""
        unknown = pb.SessionError(
            status=grpc.StatusCode.UNKNOWN.value[0], message=f"{type(err).__name__}: {err}"
        )
        self.send(pb.SessionResponse(id=0, error=unknown))
        self.close()

    async def _serve(self) -> None:
        try:
            async with asyncio.timeout(HELLO_SECONDS):
                first = await self._next()
        except TimeoutError:
            return self._end(errors.DeadlineExceeded(f"no hello in {HELLO_SECONDS:g}s"))
        try:
            hello = pb.SessionHello.FromString(first)
        except Exception:  # a malformed protobuf: DecodeError, or worse
            return self._end(errors.InvalidArgument("the first frame is not a SessionHello"))
        if hello.polls and hello.watches:
            return self._end(errors.InvalidArgument("a connection polls or watches, not both"))
        polls = self._sockets.polls if hello.polls else None
        if hello.polls and polls is None:
            return self._end(
                errors.Conflict(f"{self._sockets.path} takes no polls: poll on gRPC", field="polls")
            )
        watches = self._sockets.watches if hello.watches else None
        if hello.watches and watches is None:
            return self._end(
                errors.Conflict(
                    f"{self._sockets.path} takes no watches: watch on gRPC", field="watches"
                )
            )
        refusal = (polls or watches or self._sockets).admit(hello.token)
        if refusal is not None:
            return self._end(refusal)
        if hello.instance and hello.instance != self._sockets.instance:
            return self._end(
                errors.Conflict(
                    f"{self._sockets.path} is another server's session socket", field="instance"
                )
            )
        if polls is not None:
            return await self._serve_polls(polls)
        if watches is not None:
            return await self._serve_watches(watches)
        while (request := await self._read(pb.SessionRequest)) is not None:
            try:
                answer = await _answer(self._sockets.servicer, self._sockets.methods, request, None)
            except Exception as err:
                log.exception("a journal call on a session socket failed")
                return self._end_unknown(err)
            self.send(answer)

    async def _read(self, kind: type[M]) -> M | None:
        """The next frame as a ``kind``; None when it is not one, and the
        connection is ended with that error."""
        frame = await self._next()
        try:
            return kind.FromString(frame)
        except Exception:  # a malformed protobuf: DecodeError, or worse
            self._end(errors.InvalidArgument(f"a frame is not a {kind.DESCRIPTOR.name}"))
            return None

    async def _serve_polls(self, polls: Polls) -> None:
        """The engine's PollTasks, one at a time (ADR 49); the connection's
        end cancels the poll under way, which gives back what it pulled."""
        while (poll := await self._read(epb.SocketPoll)) is not None:
            self._sockets.polled += 1
            try:
                answer = await answered(POLL_METHOD, poll.trace_context, polls.call(poll.request))
            except Exception as err:
                log.exception("a poll on a session socket failed")
                return self._end_unknown(err)
            if isinstance(answer, WireError):
                error = failed(poll.id, answer).error
                self.send(epb.SocketPollAnswer(id=poll.id, error=error))
            else:
                self.send(epb.SocketPollAnswer(id=poll.id, tasks=answer))

    async def _serve_watches(self, watches: Watches) -> None:
        """The engine's WatchRun, one watch at a time to its end (ADR 52);
        the connection's end cancels the watch under way. A watch that ends
        before its run does (the engine stopping) closes the connection, as
        its gRPC stream would break, and the client watches again."""
        while (watch := await self._read(epb.SocketWatch)) is not None:
            self._sockets.watched += 1
            try:
                ended = await answered(
                    WATCH_METHOD, watch.trace_context, self._watch(watches, watch)
                )
            except Exception as err:
                log.exception("a watch on a session socket failed")
                return self._end_unknown(err)
            if isinstance(ended, WireError):
                error = failed(watch.id, ended).error
                self.send(epb.SocketWatchAnswer(id=watch.id, error=error))
            elif not ended:
                return self.close()

    async def _watch(self, watches: Watches, watch: epb.SocketWatch) -> bool:
        """Send the watch's states; whether the last one sent was final."""
        async for state in watches.call(watch.request):
            self.send(epb.SocketWatchAnswer(id=watch.id, state=state))
            if state.run.status in FINAL_RUN_STATUSES:
                return True
        return False


@dataclass(frozen=True, slots=True)
class Watches:
    """The engine of this process's WatchRun, served on its session socket
    too (ADR 52): ``call`` gives the states the RPC sends (raising domain
    errors), and ``admit`` checks a watch connection's token."""

    call: Callable[[epb.WatchRunRequest], AsyncIterator[epb.WatchRunResponse]]
    admit: Admit


@dataclass(frozen=True, slots=True)
class Polls:
    """The engine of this process's PollTasks, served on its session socket
    too (ADR 49): ``call`` answers a request as the RPC does (raising domain
    errors), and ``admit`` checks a poll connection's token."""

    call: Callable[[epb.PollTasksRequest], Awaitable[epb.PollTasksResponse]]
    admit: Admit


def _bound_private(path: str | Path) -> socket.socket:
    """A Unix socket bound at ``path`` whose file is created mode 0600: no
    other user can connect to it, not even for the moment after the bind."""
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)
    try:
        listening.bind(str(path))
    except OSError:
        listening.close()
        raise
    finally:
        os.umask(mask)
    return listening


class SessionSocket:
    """A listening session socket; :meth:`close` stops it and its connections."""

    def __init__(
        self,
        path: Path,
        servicer: object,
        methods: dict[str, Behaviour],
        admit: Admit,
        polls: Polls | None = None,
        watches: Watches | None = None,
    ) -> None:
        self.path = path
        self.servicer = servicer
        self.methods = methods
        self.admit = admit
        self.polls = polls
        self.watches = watches
        self.connections: set[_Connection] = set()
        self.accepted = 0  # connections since the start
        self.polled = 0  # polls taken since the start
        self.watched = 0  # watches taken since the start
        # Tells this socket from another at the same path (ADR 46).
        self.instance = secrets.token_hex(8)
        self._server: asyncio.Server | None = None

    @classmethod
    async def start(
        cls,
        path: Path,
        servicer: object,
        methods: dict[str, Behaviour],
        admit: Admit,
        polls: Polls | None = None,
        watches: Watches | None = None,
    ) -> SessionSocket:
        """Listen at ``path``, replacing a socket a stopped server left there;
        with ``polls`` (``watches``), connections that ask for it carry the
        engine's polls (watches).

        Raises:
            InvalidArgument: see :func:`check_path`.
            Unavailable: a server answers at ``path``, or the socket cannot be
                bound there (its directory is missing or not writable).
        """
        check_path(path)
        try:
            _, writer = await asyncio.open_unix_connection(path)
        except FileNotFoundError:
            pass
        except ConnectionRefusedError:  # a stopped server's socket, replaced below
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except OSError as err:  # another user's, say: not ours to replace
            raise errors.Unavailable(f"cannot use {path}: {err.strerror}") from None
        else:
            writer.close()
            raise errors.Unavailable(f"another server listens on {path}")
        sockets = cls(path, servicer, methods, admit, polls, watches)
        loop = asyncio.get_running_loop()
        try:
            listening = _bound_private(path)
            sockets._server = await loop.create_unix_server(
                lambda: _Connection(sockets), sock=listening
            )
        except OSError as err:
            raise errors.Unavailable(f"cannot listen on {path}: {err.strerror}") from None
        return sockets

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
