"""The local transport: the services' calls for clients on their host, without gRPC.

One method table (:func:`methods`) names what a client on the services' host
may call without gRPC: the journal's Session calls, the engine's PollTasks
(its cancel watch included) and WatchRun. It is served two ways:

- On **the local socket** (:class:`LocalListener`), a Unix socket beside the
  gRPC port. A frame is a 4-byte big-endian length and a message
  (``dagnats.core.frames``). The client's first frame is a ``LocalHello``
  (its token, and the instance it expects when it found the socket in an
  answer), then ``LocalCall`` envelopes (an id, the gRPC method's name, the
  trace context, the request's bytes), each answered in order by
  ``LocalAnswer`` envelopes: the response's bytes (a streaming method sends
  one per message, then an ``end``), or the error the method would have
  ended with on gRPC (the same checks, replay rules, fences, spans and
  domain errors: the table's handlers are the servicers' own methods). A call
  is answered to its end before the next is read; the connection's end
  cancels the call under way, which gives back what a poll pulled. What a
  gRPC stream would end with a status ends the connection after an answer
  with id 0 and that error: a refusal of the hello, or of a method's first
  call (the token's role may not make it; the table has no such method), a
  frame too long or unreadable, an unexpected failure (UNKNOWN, logged). The
  client reads a closed connection as a broken stream and opens another.
  An empty frame after the hello is the client's ping: it is answered at
  once with an empty frame, ahead of the call under way, which it does not
  touch; a client whose call waited with nothing arriving sends it, and ends
  the connection when no frame comes back (``DAGNATS_LOCAL_KEEPALIVE``).
- **In the process** (:class:`LocalSession`), for the handlers the services
  run: the same table, called without bytes.

A call on the frames costs a client about a third of a gRPC call on a
``unix:`` target (the measurement is in docs/adr/0060).

Who may connect: the file is created the services' user's alone (mode 0600,
at the bind), and, when the server takes calls only with a credential, each
method's first call on a connection checks that the hello's token's role may
make it, as gRPC's interceptor checks every call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message

from dagnats.core import errors
from dagnats.core.frames import MAX_FRAME, Frames, TransportError
from dagnats.core.grpcutil import WireError, error_from_status, status_code
from dagnats.core.session_calls import CALLS, SERVICE
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.engine.service import EngineServicer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.service import SESSION_CALLS, JournalServicer
from dagnats.journal.session import answered, session_error
from dagnats.journal.v1 import journal_pb2 as jpb

# sockaddr_un's sun_path holds 108 bytes with the terminating NUL.
MAX_PATH = 107
# Seconds a connection may take to send its hello.
HELLO_SECONDS = 10.0
# Calls read ahead of the one being answered; past this the socket is not
# read until they are (a client sends one at a time).
READ_AHEAD = 16
_ENGINE = f"/{pb.DESCRIPTOR.services_by_name['EngineService'].full_name}/"
POLL_METHOD = _ENGINE + "PollTasks"
WATCH_METHOD = _ENGINE + "WatchRun"
# The check of a token for one method: None admits it, else the refusal.
Admit = Callable[[str], WireError | None]
R = TypeVar("R", bound=Message)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Method:
    """One entry of the table: the request's type and the handler, which
    answers it (``call``) or sends its messages (``stream``), raising domain
    errors as the servicer's method does."""

    request: type[Message]
    call: Callable[[Any], Awaitable[Message]] | None = None
    stream: Callable[[Any], AsyncIterator[Message]] | None = None


def methods(
    journal: JournalServicer | None, engine: EngineServicer | None = None
) -> dict[str, Method]:
    """The method table of a services process: the journal's Session calls
    when it serves the journal, PollTasks and WatchRun when it serves the engine."""
    table: dict[str, Method] = {}
    if journal is not None:
        for kind, rpc in CALLS.items():
            request = type(getattr(jpb.SessionRequest(), kind))
            table[SERVICE + rpc] = Method(request, call=_bound(SESSION_CALLS[kind], journal))
    if engine is not None:
        table[POLL_METHOD] = Method(pb.PollTasksRequest, call=engine.poll)
        table[WATCH_METHOD] = Method(pb.WatchRunRequest, stream=_to_final(engine.watch))
    return table


def _bound(
    behaviour: Callable[[Any, Any, None], Awaitable[Message]], servicer: object
) -> Callable[[Any], Awaitable[Message]]:
    def call(request: Any) -> Awaitable[Message]:
        return behaviour(servicer, request, None)

    return call


def _to_final(
    watch: Callable[[pb.WatchRunRequest], AsyncIterator[pb.WatchRunResponse]],
) -> Callable[[pb.WatchRunRequest], AsyncIterator[pb.WatchRunResponse]]:
    """WatchRun's states up to the first whose status is final, as its gRPC
    stream ends there."""

    async def states(request: pb.WatchRunRequest) -> AsyncIterator[pb.WatchRunResponse]:
        async for state in watch(request):
            yield state
            if state.run.status in FINAL_RUN_STATUSES:
                return

    return states


# ---- in the process -------------------------------------------------------------------


class LocalSession:
    """The journal's Session calls answered in this process, for the handlers
    the services run: each call runs the table's handler in the caller's task,
    inside the SERVER span the socket would open, so the checks, fences, spans
    and domain errors are the same code.

    The request is copied, as the wire would copy it, so the servicer holds
    nothing the caller may change; the answer is copied into a new message,
    so the caller holds nothing of the servicer's; a domain error is raised
    as the client of the socket raises it. An exception that would end a
    connection with UNKNOWN ends this session with the same status, and is
    logged; a call cancelled in flight ends it, as closing a connection
    cancels its call.
    """

    def __init__(self, table: Mapping[str, Method]) -> None:
        self._table = table
        self._ended = False

    async def call(
        self, method: str, request: Message, answer: type[R], trace_context: Mapping[str, str]
    ) -> R:
        if self._ended:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "the session ended")
        entry = self._table[method]
        assert entry.call is not None, f"{method} streams"
        sent = entry.request()
        sent.CopyFrom(request)
        try:
            result = await answered(method, trace_context, entry.call(sent))
        except Exception as err:
            self._ended = True
            log.exception("a journal call on a session in this process failed")
            raise TransportError(grpc.StatusCode.UNKNOWN, f"{type(err).__name__}: {err}") from err
        except BaseException:
            self._ended = True
            raise
        if isinstance(result, WireError):
            raise errors_of(result)
        copied = answer()
        copied.CopyFrom(cast(R, result))
        return copied

    def done(self) -> bool:
        return self._ended

    def cancel(self) -> bool:
        ended, self._ended = self._ended, True
        return not ended


def errors_of(err: WireError) -> WireError:
    """A copy of ``err``, as a client across the wire would raise it."""
    error = session_error(err)
    details = dict(error.details)
    return error_from_status(
        status_code(error.status), error.message, error.code, error.field, details
    )


# ---- on the socket --------------------------------------------------------------------


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
            field="local_socket",
        )
    if path.exists() and not stat.S_ISSOCK(path.stat().st_mode):
        raise errors.InvalidArgument(
            f"{path} exists and is not a socket; refusing to replace it", field="local_socket"
        )
    return path


class _Connection(Frames):
    """One client's connection: the hello, then its calls one at a time."""

    def __init__(self, listener: LocalListener) -> None:
        super().__init__()
        self._listener = listener
        self._frames: asyncio.Queue[bytes] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._greeted = False  # the hello came: an empty frame is a ping

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._task = asyncio.get_running_loop().create_task(self._serve())
        self._listener.connections.add(self)
        self._listener.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.connections.discard(self)
        if self._task is not None:
            self._task.cancel()  # as a gRPC stream's end cancels its handler

    def on_frame(self, frame: bytes) -> None:
        if not frame and self._greeted:
            self.send_ping()  # answered here: the call under way may wait long
            return
        self._greeted = True
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
        self.send(pb.LocalAnswer(id=0, error=session_error(err)))
        self.close()

    def _end_unknown(self, err: Exception) -> None:
        """End the connection as a gRPC stream ends on a server error."""
        unknown = jpb.SessionError(
            status=grpc.StatusCode.UNKNOWN.value[0], message=f"{type(err).__name__}: {err}"
        )
        self.send(pb.LocalAnswer(id=0, error=unknown))
        self.close()

    async def _serve(self) -> None:
        listener = self._listener
        try:
            async with asyncio.timeout(HELLO_SECONDS):
                first = await self._next()
        except TimeoutError:
            return self._end(errors.DeadlineExceeded(f"no hello in {HELLO_SECONDS:g}s"))
        try:
            hello = pb.LocalHello.FromString(first)
        except Exception:  # a malformed protobuf: DecodeError, or worse
            return self._end(errors.InvalidArgument("the first frame is not a LocalHello"))
        if hello.instance and hello.instance != listener.instance:
            return self._end(
                errors.Conflict(
                    f"{listener.path} is another server's local socket", field="instance"
                )
            )
        admitted: set[str] = set()  # the methods the token may call
        while True:
            frame = await self._next()
            try:
                call = pb.LocalCall.FromString(frame)
            except Exception:  # a malformed protobuf: DecodeError, or worse
                return self._end(errors.InvalidArgument("a frame is not a LocalCall"))
            method = listener.table.get(call.method)
            if method is None:
                return self._end(
                    errors.Conflict(
                        f"{listener.path} takes no {call.method}: call it on gRPC", field="method"
                    )
                )
            if call.method not in admitted:
                if (refusal := listener.admit(call.method, hello.token)) is not None:
                    return self._end(refusal)
                admitted.add(call.method)
            try:
                request = method.request.FromString(call.request)
            except Exception:  # a malformed protobuf: DecodeError, or worse
                return self._end(
                    errors.InvalidArgument(f"the request of {call.method} is unreadable")
                )
            listener.calls[call.method] += 1
            try:
                if method.call is not None:
                    await self._answer(call, method.call(request))
                elif method.stream is not None:
                    await self._stream(call, method.stream(request))
            except Exception as err:
                log.exception("a call on the local socket failed")
                return self._end_unknown(err)

    async def _answer(self, call: pb.LocalCall, work: Awaitable[Message]) -> None:
        answer = await answered(call.method, call.trace_context, work)
        if isinstance(answer, WireError):
            self.send(pb.LocalAnswer(id=call.id, error=session_error(answer)))
        else:
            self.send(pb.LocalAnswer(id=call.id, response=answer.SerializeToString()))

    async def _stream(self, call: pb.LocalCall, messages: AsyncIterator[Message]) -> None:
        async def send_all() -> None:
            async for message in messages:
                self.send(pb.LocalAnswer(id=call.id, response=message.SerializeToString()))

        ended = await answered(call.method, call.trace_context, send_all())
        if isinstance(ended, WireError):
            self.send(pb.LocalAnswer(id=call.id, error=session_error(ended)))
        else:
            self.send(pb.LocalAnswer(id=call.id, end=True))


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


class LocalListener:
    """A listening local socket; :meth:`close` stops it and its connections."""

    def __init__(
        self, path: Path, table: Mapping[str, Method], admission: Callable[[str], Admit]
    ) -> None:
        self.path = path
        self.table = table
        self._admits = {name: admission(name) for name in table}
        self.connections: set[_Connection] = set()
        self.accepted = 0  # connections since the start
        self.calls: collections.Counter[str] = collections.Counter()  # by method
        # Tells this socket from another at the same path.
        self.instance = secrets.token_hex(8)
        self._server: asyncio.Server | None = None

    @property
    def polled(self) -> int:
        """Polls taken since the start."""
        return self.calls[POLL_METHOD]

    @property
    def watched(self) -> int:
        """Watches taken since the start."""
        return self.calls[WATCH_METHOD]

    def admit(self, method: str, token: str) -> WireError | None:
        return self._admits[method](token)

    @classmethod
    async def start(
        cls, path: Path, table: Mapping[str, Method], admission: Callable[[str], Admit]
    ) -> LocalListener:
        """Listen at ``path`` for ``table``'s methods, each call's token
        checked by ``admission(method)``; a socket a stopped server left
        there is replaced.

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
        listener = cls(path, table, admission)
        loop = asyncio.get_running_loop()
        try:
            listening = _bound_private(path)
            listener._server = await loop.create_unix_server(
                lambda: _Connection(listener), sock=listening
            )
        except OSError as err:
            raise errors.Unavailable(f"cannot listen on {path}: {err.strerror}") from None
        return listener

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
