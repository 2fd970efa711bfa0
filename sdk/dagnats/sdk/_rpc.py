"""The one place the SDK calls the engine.

Invariants:

- Every call carries a deadline (``timeout=``), per attempt.
- A transport failure is retried by time, not by a count of tries, with
  capped, jittered exponential backoff: a call made for a held task (given
  its ``Lease``) for as long as the lease lasts, as the worker last extended
  it; any other call for the policy's ``budget``. Retried are the statuses
  ``grpcutil.retriable`` names: ``UNAVAILABLE`` for every call, and
  ``DEADLINE_EXCEEDED`` only for calls that are safe to repeat (the first try
  may have been applied). When the time runs out the caller gets
  ``Unavailable``.
- Any other status is a domain error: it is never retried and is turned back
  into the error the engine raised by ``grpcutil.error_from_rpc``.
- Nothing outside this module sees a ``grpc.RpcError``; cancelling the awaiting
  asyncio task cancels the RPC in flight.

Which calls are safe to repeat: reads (a ``WatchRun`` stream the transport
broke is opened again and skips what it gave); RegisterWorkflow (same document, same
result); StartRun only with an idempotency key; CancelRun and PurgeRun; the
task calls Heartbeat, SaveCheckpoint and Report (the engine accepts one report
per dispatch and drops repeats); every journal call: a write is sent again
under the same writer token, which the journal resolves as the earlier try's
when it landed, and a claim sent again fences a claim of ours whose answer was
lost (it counts once toward the restart limit). PollTasks is not: a poll that
timed out on our side may have leased tasks, and repeating it leases more; the
worker's poll loop retries on its own terms.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    wait_random_exponential,
)

from dagnats.core import tracing
from dagnats.core.errors import PermissionDenied, Unauthenticated, Unavailable
from dagnats.core.frames import TransportError
from dagnats.core.grpcutil import WireError, retriable, status_of
from dagnats.core.settings import env_bool, env_seconds
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.core.tracing import client_interceptors
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.inputs.v1 import inputs_pb2_grpc
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._errors import ANSWERED, CallFailure, domain_error, failure
from dagnats.sdk._local_transport import (
    OFF,
    FoundSocket,
    LocalConnection,
    LocalStream,
    not_a_socket,
)
from dagnats.sdk._session import GrpcSession, Session

if TYPE_CHECKING:
    from dagnats.engine.v1.engine_pb2_grpc import EngineServiceAsyncStub
    from dagnats.inputs.v1.inputs_pb2_grpc import InputsServiceAsyncStub
    from dagnats.journal.v1.journal_pb2_grpc import JournalServiceAsyncStub

log = logging.getLogger("dagnats.sdk")

# Session streams kept open between dispatches, so that a journaled dispatch
# does not pay for opening one; more than a worker's slots are rarely idle.
MAX_IDLE_SESSIONS = 64


# A WatchRun stream: a gRPC call, or a watch on the local socket.
WatchStream = (
    grpc.aio.UnaryStreamCall[pb.WatchRunRequest, pb.WatchRunResponse]
    | LocalStream[pb.WatchRunResponse]
)
_ENGINE = f"/{pb.DESCRIPTOR.services_by_name['EngineService'].full_name}/"
POLL_METHOD = _ENGINE + "PollTasks"
WATCH_METHOD = _ENGINE + "WatchRun"


_JOURNAL_METHODS = frozenset(
    m.name for m in jpb.DESCRIPTOR.services_by_name["JournalService"].methods
)
_INPUTS_METHODS = frozenset(
    m.name for m in ipb.DESCRIPTOR.services_by_name["InputsService"].methods
)
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
T = TypeVar("T")


# Channel options: a connection refused while a service restarts is tried again
# within a fraction of a second to two seconds, not after gRPC's default
# backoff, which grows to two minutes.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# With ``DAGNATS_GRPC_BALANCE`` on, a channel whose target names several
# services processes (a list, ``ipv4:a:7233,b:7233``, or a DNS name with an
# address per replica, ``dns:///dagnats:7233``) keeps a connection to each and
# sends its calls to them in turn (gRPC's ``round_robin``), skipping one that is
# down. Off, it sends every call to the first address that answers and moves
# to the next only when that one fails (``pick_first``).
BALANCE = "DAGNATS_GRPC_BALANCE"


def balancing_options() -> tuple[tuple[str, str], ...]:
    """The channel option that spreads calls over the target's addresses,
    when ``DAGNATS_GRPC_BALANCE`` asks for it."""
    return (("grpc.lb_policy_name", "round_robin"),) if env_bool(BALANCE, False) else ()


# Seconds of silence on a connection with calls open (a WatchRun, a session)
# before it is pinged; a ping unanswered as long again (at most 20 s) ends the
# connection, so an engine that froze or a peer that vanished without closing
# fails its calls as UNAVAILABLE, which the rules above retry elsewhere or give
# up on, instead of waiting on a stream that no one will write to.
DEFAULT_KEEPALIVE = 20.0


def keepalive_options(seconds: float) -> tuple[tuple[str, int], ...]:
    """Channel options that ping a connection silent for ``seconds``."""
    interval = max(int(seconds * 1000), 100)
    return (
        ("grpc.keepalive_time_ms", interval),
        ("grpc.keepalive_timeout_ms", min(interval, 20_000)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", min(interval, 20_000)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How transport failures are retried.

    Attributes:
        budget: Seconds a call not made for a held task keeps trying (a call
            for a held task tries for as long as its lease lasts).
        backoff: Scale of the randomised exponential wait between tries, in seconds.
        max_backoff: Upper bound of one wait, in seconds.
        keepalive: Seconds of silence before an open call's connection is
            pinged (``DAGNATS_GRPC_KEEPALIVE``, default 20).
    """

    budget: float = 30.0
    backoff: float = 0.1
    max_backoff: float = 2.0
    keepalive: float = field(
        default_factory=lambda: env_seconds("DAGNATS_GRPC_KEEPALIVE", DEFAULT_KEEPALIVE)
    )


class Lease:
    """When a held task's lease runs out, as this worker last extended it.

    The engine's lease is the task message's ack wait, restarted by every
    heartbeat the server receives. This clock restarts it from when the
    heartbeat was sent, and starts it from when the poll that leased the task
    was sent: both before the server's, so the lease here never outlasts the
    server's. Until it runs out no other worker can have been given the task.
    """

    def __init__(self, duration: float, *, since: float | None = None) -> None:
        self.duration = duration
        start = asyncio.get_running_loop().time() if since is None else since
        self._expires = start + duration

    @property
    def expires(self) -> float:
        """Event-loop time at which the lease runs out."""
        return self._expires

    def remaining(self) -> float:
        """Seconds left; negative once it ran out."""
        return self._expires - asyncio.get_running_loop().time()

    def live(self) -> bool:
        """True while the lease has not run out by this clock, with a margin for
        the heartbeat in flight (a tenth of the lease, at most a second)."""
        return self.remaining() > min(self.duration / 10, 1.0)

    def extended(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (event-loop time) was answered."""
        self._expires = max(self._expires, sent + self.duration)


class EngineRpc:
    """Connections to the services; every method is one RPC with retries and a deadline.

    The engine, the journal and the inputs services are reached at ``target``
    unless ``journal_target`` or ``inputs_target`` name another address (each
    service running as its own process, ``dagnats serve journal``). A channel
    is opened per address on the first call to it, so that it belongs to the
    running event loop; TLS files are read here, so a missing one fails at
    once. ``credentials`` None reads them from the environment
    (``Credentials.from_env``); the same credentials go to every service.
    ``local_socket`` (by default ``DAGNATS_LOCAL_SOCKET``) puts the
    journal's Session calls on the services' local socket, with the
    credentials' token; ``"off"`` keeps every call on gRPC; unset, the
    journal calls, the polls and the watches go to the socket the polls' and
    watches' answers name when it is on this host and the journal is the
    engine's. ``sessions`` opens the journal's sessions instead of any of
    these: the services give their own when they run the handlers.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float,
        retry: RetryPolicy | None = None,
        credentials: Credentials | None = None,
        journal_target: str | None = None,
        inputs_target: str | None = None,
        local_socket: str | None = None,
        sessions: Callable[[], Session] | None = None,
    ) -> None:
        self._target = target
        self._journal_target = journal_target or target
        self._inputs_target = inputs_target or target
        self._credentials = credentials if credentials is not None else Credentials.from_env()
        socket = local_socket or os.environ.get("DAGNATS_LOCAL_SOCKET") or None
        given = socket if sessions is None and socket != OFF else None
        self._local_socket = given
        if given is not None:
            sessions = functools.partial(LocalConnection, given, self._credentials.token)
        self._sessions = sessions
        # The socket the answers name, where nothing above chose.
        self._found = (
            FoundSocket(self._credentials.token)
            if sessions is None and socket is None and self._journal_target == target
            else None
        )
        self._channel_credentials = self._credentials.channel_credentials()
        self._timeout = timeout
        self._retry = retry or RetryPolicy()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stub: EngineServiceAsyncStub | None = None
        self._journal_stub: JournalServiceAsyncStub | None = None
        self._inputs_stub: InputsServiceAsyncStub | None = None
        self._idle_sessions: list[Session] = []
        self._polls: LocalConnection | None = None  # idle between polls
        self._watches: LocalConnection | None = None  # idle between watches

    def check_local_socket(self) -> None:
        """Warn, once, when the local socket the journal calls go to is not
        there: a wrong path would keep them retrying for as long as the
        worker's heartbeats keep its leases. Not an error: the services may
        not have started yet."""
        path = self._local_socket
        if path is not None and (problem := not_a_socket(path)) is not None:
            log.warning("the local socket %s: %s", path, problem)

    @property
    def timeout(self) -> float:
        """Deadline of one attempt, in seconds."""
        return self._timeout

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled. A later call reconnects."""
        channels, self._channels, self._stub = self._channels, {}, None
        self._journal_stub = None
        self._inputs_stub = None
        self._drop_idle_sessions()
        self._drop_polls()
        self._drop_watches()
        for channel in channels.values():
            await channel.close(None)

    # Workflows and runs.

    async def register_workflow(
        self, request: pb.RegisterWorkflowRequest
    ) -> pb.RegisterWorkflowResponse:
        return await self._call(self._connect().RegisterWorkflow, request, idempotent=True)

    async def get_workflow(self, request: pb.GetWorkflowRequest) -> pb.GetWorkflowResponse:
        return await self._call(self._connect().GetWorkflow, request, idempotent=True)

    async def list_workflows(self, request: pb.ListWorkflowsRequest) -> pb.ListWorkflowsResponse:
        return await self._call(self._connect().ListWorkflows, request, idempotent=True)

    async def start_run(self, request: pb.StartRunRequest) -> pb.StartRunResponse:
        idempotent = bool(request.idempotency_key)
        return await self._call(self._connect().StartRun, request, idempotent=idempotent)

    async def get_run(self, request: pb.GetRunRequest) -> pb.GetRunResponse:
        return await self._call(self._connect().GetRun, request, idempotent=True)

    async def watch_run(self, request: pb.WatchRunRequest) -> AsyncIterator[pb.WatchRunResponse]:
        """The run's states from ``WatchRun`` until the one whose status is final
        (with ``request.start``, the run it starts).

        A stream the transport broke (an engine restart) is opened again, by
        the retry rules above with the budget counted from the break; the new
        stream starts with the run as stored then, and states at or below a
        revision already given are skipped.
        """
        revision = 0
        # A watch that starts its run is sent again only as StartRun would be.
        idempotent = not request.HasField("start") or bool(request.start.idempotency_key)
        while True:
            call, response = await self.retrying(
                "WatchRun", functools.partial(self._open_watch, request), idempotent=idempotent
            )
            if response is not None and request.HasField("start"):
                # Started: from now on the run is watched by its id.
                request = pb.WatchRunRequest(
                    run_id=response.run.run_id, ended_only=request.ended_only
                )
                idempotent = True
            try:
                while response is not None:
                    final = response.run.status in FINAL_RUN_STATUSES
                    if final:
                        # Its connection serves the next watch at once: a caller
                        # that has the end may not close this generator for a while.
                        self._watch_ended(call, released=True)
                    if response.revision > revision:
                        revision = response.revision
                        yield response
                    if final:
                        return
                    response = await _next(call)
                # Closed before the run ended (an engine stopping): watch again;
                # a socket watch's connection, read to the stream's end, may.
                self._watch_ended(call)
            except (grpc.aio.AioRpcError, TransportError) as err:
                if not _is_transient(err, idempotent=True):
                    raise self._domain_error("WatchRun", err) from None
                log.info("engine WatchRun stream broke with %s; watching again", _status_name(err))
            finally:
                call.cancel()  # left before its end: a socket watch's connection closes

    async def watch_runs(self, request: pb.WatchRunsRequest) -> AsyncIterator[pb.WatchRunsResponse]:
        """The list of runs and its changes from ``WatchRuns``, for as long as
        the caller reads. A stream the transport broke is opened again by the
        retry rules above; the new stream starts with a snapshot (the list as
        it is then), which replaces what the caller holds."""
        while True:
            call, response = await self.retrying(
                "WatchRuns", lambda: _open(self._connect().WatchRuns, request), idempotent=True
            )
            try:
                while response is not None:
                    yield response
                    response = await _next(call)
                # Closed without an error (an engine stopping): watch again.
            except grpc.aio.AioRpcError as err:
                if not _is_transient(err, idempotent=True):
                    raise self._domain_error("WatchRuns", err) from None
                log.info("engine WatchRuns stream broke with %s; watching again", err.code().name)
            finally:
                call.cancel()

    async def _open_watch(
        self, request: pb.WatchRunRequest
    ) -> tuple[WatchStream, pb.WatchRunResponse | None]:
        """Open a ``WatchRun`` stream at this try, and read its first state:
        on the local socket when one was found, else on the channel."""
        watches = self._take_watches()
        if watches is not None:
            carrier: dict[str, str] = {}
            with tracing.client_span(WATCH_METHOD, carrier) as span:
                try:
                    watch = await watches.stream(
                        WATCH_METHOD, request, pb.WatchRunResponse, carrier
                    )
                    first = await _next(watch)
                except TransportError as err:
                    tracing.set_status(span, err.code, err.message, server=False)
                    if not watches.not_sent():
                        raise  # the watch may have been taken: the retry rules decide
                    log.info("a watch on the local socket failed (%s); on gRPC", err.message)
                except ANSWERED as err:  # refused: the connection serves on
                    tracing.set_status(span, status_of(err), err.message, server=False)
                    self._watch_ended(watches)
                    raise
                except BaseException:  # cancelled: the connection was closed
                    self._watch_ended(watches)
                    raise
                else:
                    tracing.set_status(span, grpc.StatusCode.OK, "", server=False)
                    return watch, first
        call, response = await _open(self._connect().WatchRun, request)
        if response is not None and response.HasField("local_socket"):
            self._offered(response.local_socket)
        return call, response

    def _take_watches(self) -> LocalConnection | None:
        """The idle connection for watches on the socket, or a new one; None
        when the watches go on gRPC."""
        idle = self._watches
        self._watches = None
        if idle is not None and idle.idle():
            return idle
        if idle is not None:
            idle.close()
        return self._found.connection() if self._found is not None else None

    def _watch_ended(self, call: WatchStream | LocalConnection, *, released: bool = False) -> None:
        """Keep the connection of a socket watch that has ended (``released``
        at its final state) for the next watch, or close it."""
        if isinstance(call, LocalStream):
            if released:
                call.release()
            call = call.connection
        if not isinstance(call, LocalConnection):
            return
        if call.idle() and self._watches is None:
            self._watches = call
        else:
            call.close()

    async def list_runs(self, request: pb.ListRunsRequest) -> pb.ListRunsResponse:
        return await self._call(self._connect().ListRuns, request, idempotent=True)

    async def cancel_run(self, request: pb.CancelRunRequest) -> pb.CancelRunResponse:
        return await self._call(self._connect().CancelRun, request, idempotent=True)

    async def purge_run(self, request: pb.PurgeRunRequest) -> pb.PurgeRunResponse:
        return await self._call(self._connect().PurgeRun, request, idempotent=True)

    async def fork_run(self, request: pb.ForkRunRequest) -> pb.ForkRunResponse:
        # Retried only with an idempotency key, as StartRun.
        return await self._call(
            self._connect().ForkRun, request, idempotent=bool(request.idempotency_key)
        )

    async def upgrade_run(self, request: pb.UpgradeRunRequest) -> pb.UpgradeRunResponse:
        return await self._call(self._connect().UpgradeRun, request, idempotent=True)

    # The task API.

    async def poll_tasks(
        self, request: pb.PollTasksRequest, *, deadline: float
    ) -> pb.PollTasksResponse:
        polls = self._take_polls()
        if polls is not None:
            try:
                return await _poll(polls, request, deadline)
            except TransportError as err:  # the socket failed, not the poll
                log.info("a poll on the local socket failed (%s); on gRPC", err.message)
            finally:
                self._give_back_polls(polls)
        response: pb.PollTasksResponse = await self._call(
            self._connect().PollTasks, request, idempotent=False, deadline=deadline
        )
        if response.HasField("local_socket"):
            self._offered(response.local_socket)
        return response

    def _take_polls(self) -> LocalConnection | None:
        """A connection to the socket for one poll: the idle one, or a new one
        while another poll holds it; None when the polls go on gRPC."""
        if self._polls is None or self._polls.done():
            self._polls = self._found.connection() if self._found is not None else None
        polls, self._polls = self._polls, None
        return polls

    def _give_back_polls(self, polls: LocalConnection) -> None:
        if self._polls is None and not polls.done():
            self._polls = polls
        else:
            polls.close()

    def _drop_polls(self) -> None:
        polls, self._polls = self._polls, None
        if polls is not None:
            polls.close()

    async def heartbeat(
        self, request: pb.HeartbeatRequest, *, lease: Lease | None = None
    ) -> pb.HeartbeatResponse:
        return await self._call(self._connect().Heartbeat, request, idempotent=True, lease=lease)

    async def report(
        self, request: pb.ReportRequest, *, lease: Lease | None = None
    ) -> pb.ReportResponse:
        return await self._call(self._connect().Report, request, idempotent=True, lease=lease)

    async def load_checkpoint(
        self, request: pb.LoadCheckpointRequest, *, lease: Lease | None = None
    ) -> pb.LoadCheckpointResponse:
        method = self._connect().LoadCheckpoint
        return await self._call(method, request, idempotent=True, lease=lease)

    async def save_checkpoint(
        self, request: pb.SaveCheckpointRequest, *, lease: Lease | None = None
    ) -> pb.SaveCheckpointResponse:
        method = self._connect().SaveCheckpoint
        return await self._call(method, request, idempotent=True, lease=lease)

    # The journal (served next to the engine).

    async def claim(self, request: jpb.ClaimRequest) -> jpb.ClaimResponse:
        return await self._call(self._journal().Claim, request, idempotent=True)

    async def begin_model(self, request: jpb.BeginModelRequest) -> jpb.BeginModelResponse:
        return await self._call(self._journal().BeginModel, request, idempotent=True)

    async def record_model(self, request: jpb.RecordModelRequest) -> jpb.RecordModelResponse:
        return await self._call(self._journal().RecordModel, request, idempotent=True)

    async def record_spent(self, request: jpb.RecordSpentRequest) -> jpb.RecordSpentResponse:
        # Deduplicated by the call's identity (writer and position).
        return await self._call(self._journal().RecordSpent, request, idempotent=True)

    async def begin_tool(self, request: jpb.BeginToolRequest) -> jpb.BeginToolResponse:
        return await self._call(self._journal().BeginTool, request, idempotent=True)

    async def begin_tools(self, request: jpb.BeginToolsRequest) -> jpb.BeginToolsResponse:
        return await self._call(self._journal().BeginTools, request, idempotent=True)

    async def tool_output(self, request: jpb.ToolOutputRequest) -> jpb.ToolOutputResponse:
        return await self._call(self._journal().ToolOutput, request, idempotent=True)

    async def finish_tool(self, request: jpb.FinishToolRequest) -> jpb.FinishToolResponse:
        return await self._call(self._journal().FinishTool, request, idempotent=True)

    async def check_tail(self, request: jpb.CheckTailRequest) -> jpb.CheckTailResponse:
        return await self._call(self._journal().CheckTail, request, idempotent=True)

    async def commit(self, request: jpb.CommitRequest) -> jpb.CommitResponse:
        return await self._call(self._journal().Commit, request, idempotent=True)

    async def check_journal(self, request: jpb.CheckRequest) -> jpb.CheckResponse:
        return await self._call(self._journal().Check, request, idempotent=True)

    async def read_state(self, request: jpb.ReadStateRequest) -> bytes | None:
        """The state at a commit (``ReadState``), its chunks joined; None when
        the commit carried none."""

        async def read() -> bytes | None:
            parts: list[bytes] = []
            async for answer in self._journal().ReadState(request):
                if not answer.has_state:
                    return None
                parts.append(answer.chunk)
            return b"".join(parts)

        return await self.retrying("ReadState", read, idempotent=True)

    def journal_stub(self) -> JournalServiceAsyncStub:
        """The journal service's stub, for streams (``Read``) a caller drives itself."""
        return self._journal()

    async def place_inputs(self, request: jpb.PlaceInputsRequest) -> jpb.PlaceInputsResponse:
        return await self._call(self._journal().PlaceInputs, request, idempotent=True)

    async def list_inputs(
        self, request: ipb.ListRequest, *, lease: Lease | None = None
    ) -> ipb.ListResponse:
        return await self._call(self._inputs().List, request, idempotent=True, lease=lease)

    async def submit_input(self, request: ipb.SubmitRequest) -> ipb.SubmitResponse:
        return await self._call(self._inputs().Submit, request, idempotent=True)

    async def get_input(self, request: ipb.GetRequest, *, deadline: float) -> ipb.GetResponse:
        return await self._call(self._inputs().Get, request, idempotent=True, deadline=deadline)

    async def withdraw_input(self, request: ipb.WithdrawRequest) -> ipb.WithdrawResponse:
        return await self._call(self._inputs().Withdraw, request, idempotent=True)

    async def put_stream(
        self, requests: AsyncIterator[jpb.PutStreamRequest]
    ) -> jpb.PutStreamResponse:
        """One live stream's chunks; not retried (a preview is not a record)."""
        return await self._journal().PutStream(requests)

    def _inputs(self) -> InputsServiceAsyncStub:
        if self._inputs_stub is None:
            channel = self._channel(self._inputs_target)
            self._inputs_stub = inputs_pb2_grpc.InputsServiceStub(channel)
        return self._inputs_stub

    def _journal(self) -> JournalServiceAsyncStub:
        if self._journal_stub is None:
            channel = self._channel(self._journal_target)
            self._journal_stub = journal_pb2_grpc.JournalServiceStub(channel)
        return self._journal_stub

    def _connect(self) -> EngineServiceAsyncStub:
        if self._stub is None:
            self._stub = engine_pb2_grpc.EngineServiceStub(self._channel(self._target))
        return self._stub

    def _channel(self, target: str) -> grpc.aio.Channel:
        """The channel to ``target``, opened on first use (one per address)."""
        channel = self._channels.get(target)
        if channel is None:
            interceptors = client_interceptors() + self._credentials.interceptors()
            options = (
                *CHANNEL_OPTIONS,
                *keepalive_options(self._retry.keepalive),
                *balancing_options(),
            )
            if self._channel_credentials is None:
                channel = grpc.aio.insecure_channel(
                    target, options=options, interceptors=interceptors
                )
            else:
                channel = grpc.aio.secure_channel(
                    target,
                    self._channel_credentials,
                    options=options,
                    interceptors=interceptors,
                )
            self._channels[target] = channel
        return channel

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        idempotent: bool,
        deadline: float | None = None,
        lease: Lease | None = None,
    ) -> Resp:
        timeout = self._timeout if deadline is None else deadline
        name = type(request).__name__.removesuffix("Request")
        return await self.retrying(
            name, lambda: method(request, timeout=timeout), idempotent=idempotent, lease=lease
        )

    def open_session(self) -> Session:
        """A journal session (see ``JournalSession``): an idle one given back
        by an earlier dispatch, or a new one: from ``sessions`` when given,
        on the local socket when one was found, else a gRPC Session stream."""
        while self._idle_sessions:
            stream = self._idle_sessions.pop()
            if not stream.done():
                return stream
        if self._sessions is not None:
            return self._sessions()
        if self._found is not None and (found := self._found.connection()) is not None:
            return found
        return GrpcSession(self._journal().Session(None))  # None: written with write()

    def _offered(self, socket: pb.LocalSocket) -> None:
        """A poll's or a watch's answer named ``socket``: when the calls go
        there from now, the idle ones on gRPC or on another socket are
        closed, so that the next ones open there."""
        if self._found is not None and self._found.offered(socket):
            self._drop_idle_sessions()  # the next dispatch's calls go to the socket
            self._drop_polls()  # and so do the polls and watches, where it takes them
            self._drop_watches()

    def _drop_watches(self) -> None:
        watches, self._watches = self._watches, None
        if watches is not None:
            watches.close()

    def _drop_idle_sessions(self) -> None:
        idle, self._idle_sessions = self._idle_sessions, []
        for stream in idle:
            stream.cancel()

    def release_session(self, stream: Session) -> None:
        """Keep ``stream`` for the next dispatch; it must have no call pending."""
        if len(self._idle_sessions) < MAX_IDLE_SESSIONS and not stream.done():
            self._idle_sessions.append(stream)
        else:
            stream.cancel()

    async def retrying(
        self,
        name: str,
        attempt: Callable[[], Awaitable[T]],
        *,
        idempotent: bool,
        lease: Lease | None = None,
    ) -> T:
        """``await attempt()``, tried again by the rules above until ``lease``
        runs out (or, without one, for the policy's budget); ``attempt`` raises
        ``AioRpcError`` or ``TransportError`` when the transport fails."""
        transient = functools.partial(_is_transient, idempotent=idempotent)
        try:  # the common case, without the retry machinery around it
            return await attempt()
        except (grpc.aio.AioRpcError, TransportError) as err:
            if not transient(err):
                raise self._domain_error(name, err) from None
        loop = asyncio.get_running_loop()
        started = loop.time() - 1e-3  # the first try
        budget_end = started + self._retry.budget

        def until() -> float:
            return lease.expires if lease is not None else budget_end

        backoff = wait_random_exponential(
            multiplier=self._retry.backoff, max=self._retry.max_backoff
        )

        def wait(state: RetryCallState) -> float:  # never past the end
            return max(0.0, min(backoff(state), until() - loop.time()))

        retrying = AsyncRetrying(
            stop=lambda _: loop.time() >= until(),
            wait=wait,
            retry=retry_if_exception(transient),
            before_sleep=functools.partial(_log_retry, name),
            reraise=True,
        )
        tries = 1
        try:
            async for tried in retrying:
                tries += 1
                with tried:
                    return await attempt()
        except (grpc.aio.AioRpcError, TransportError) as err:
            # Raised "from None": the status is already in the message, and the
            # domain error is the whole story for the caller.
            if transient(err):
                spent = loop.time() - started
                what = "the task's lease ran out" if lease is not None else "gave up"
                last = failure(err)
                assert last is not None
                raise Unavailable(
                    f"{name} failed for {spent:.1f}s ({tries} tries; {what}); last: "
                    f"{last.status.name}: {last.details}"
                ) from None
            raise self._domain_error(name, err) from None
        raise AssertionError("unreachable: the retry loop returns or raises")

    def _target_of(self, name: str) -> str:
        """The address the RPC ``name`` went to."""
        if name in _JOURNAL_METHODS:
            return self._journal_target
        if name in _INPUTS_METHODS:
            return self._inputs_target
        return self._target

    def _domain_error(self, name: str, err: CallFailure) -> WireError:
        if _status_name(err) == grpc.StatusCode.UNIMPLEMENTED.name:
            # A server without that service (an engine served without the journal).
            return Unavailable(f"{self._target_of(name)} does not serve {name}")
        domain = domain_error(err)
        if isinstance(domain, Unauthenticated | PermissionDenied):
            # Say which credential was used, never the token itself.
            used = "a token" if self._credentials.token else "no token (DAGNATS_TOKEN)"
            domain.message = f"{domain.message} (sent {used}, to {self._target})"
            domain.args = (domain.message,)
        return domain


async def _open(
    method: Callable[[Req], grpc.aio.UnaryStreamCall[Req, Resp]], request: Req
) -> tuple[grpc.aio.UnaryStreamCall[Req, Resp], Resp | None]:
    """Open a server stream and read its first message, so that the retry of a
    failed open covers an engine that is not there yet."""
    call = method(request)
    try:
        return call, await _next(call)
    except BaseException:
        call.cancel()
        raise


async def _next(call: AsyncIterable[Resp]) -> Resp | None:
    """The stream's next message; None once it has ended."""
    try:
        return await anext(aiter(call))
    except StopAsyncIteration:
        return None


async def _poll(
    polls: LocalConnection, request: pb.PollTasksRequest, deadline: float
) -> pb.PollTasksResponse:
    """One poll on the local socket, failing as on gRPC: ``TransportError``
    when the socket failed (DEADLINE_EXCEEDED when no answer came in time),
    the domain error when the poll itself is refused."""
    carrier: dict[str, str] = {}
    with tracing.client_span(POLL_METHOD, carrier) as span:
        try:
            async with asyncio.timeout(deadline):
                answer = await polls.call(POLL_METHOD, request, pb.PollTasksResponse, carrier)
        except TimeoutError:  # the connection was closed: the server gives back what it pulled
            raise TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "PollTasks: no answer"
            ) from None
        except ANSWERED as err:
            tracing.set_status(span, status_of(err), err.message, server=False)
            raise
        tracing.set_status(span, grpc.StatusCode.OK, "", server=False)
        return answer


def _is_transient(err: BaseException, *, idempotent: bool) -> bool:
    failed = failure(err)
    if failed is None:
        return False
    return retriable(failed.status, failed.code, idempotent=idempotent)


def _status_name(err: BaseException) -> str:
    failed = failure(err)
    return failed.status.name if failed is not None else type(err).__name__


# Seconds of retrying one call after which each retry is logged as a warning:
# a service restart is over by then, and what is left (a wrong address, a
# local socket that is not there) is for someone to look at.
LOUD_AFTER = 10.0


def _log_retry(name: str, state: RetryCallState) -> None:
    err = state.outcome.exception() if state.outcome else None
    failed = failure(err) if err is not None else None
    status = f"{failed.status.name}: {failed.details}" if failed is not None else repr(err)
    since = state.seconds_since_start or 0.0
    level = logging.WARNING if since >= LOUD_AFTER else logging.INFO
    log.log(
        level,
        "engine %s attempt %d failed with %s; retrying (for %.0fs so far)",
        name,
        state.attempt_number + 1,
        status,
        since,
    )
