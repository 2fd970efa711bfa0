"""The services' local socket: the journal's Session calls, PollTasks and
WatchRun on a Unix socket for clients on the services' host, each call one
envelope dispatched through one method table.

What a user checks: a worker given the socket, or told nothing on the
services' host, runs on it and writes what a gRPC worker writes
(``tests/test_journal.py`` runs the crash-free run and the unsafe-intent
crash with each); the socket takes only a worker's token
when the server needs one; a bad frame ends that connection with an error,
never the server; a restart of the socket costs a worker nothing; the file
is the services' user's alone, and a live one is never taken over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration

from dagnats.cli import dev
from dagnats.core import errors
from dagnats.core.frames import HEADER, MAX_FRAME, TransportError
from dagnats.core.natsserver import NatsServer
from dagnats.engine import local_transport
from dagnats.engine.access import Role, tokens_of
from dagnats.engine.local_transport import LocalListener, methods
from dagnats.engine.security import ServerSecurity
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, TaskContext, Worker, run_output
from dagnats.sdk import _rpc as rpc
from dagnats.sdk._local_transport import FoundSocket, LocalConnection, LocalStream
from dagnats.sdk._rpc import POLL_METHOD, WATCH_METHOD
from dagnats.sdk.testing import ScriptedModel
from tests.helpers import wait_for
from tests.journal_agent import SCRIPT, Tools, agent
from tests.matrix import EngineProcess
from tests.stack import FAST, loop_workflow, socket_dir, unique
from tests.test_journal import finish, found, remote, run_without_a_crash, socketed, start

WORKER_TOKEN, CLIENT_TOKEN = "socket-worker-token", "socket-client-token"
CHECK_TAIL = "/dagnats.journal.v1.JournalService/CheckTail"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with socket_dir() as path:
        yield path


@pytest_asyncio.fixture(loop_scope="module")
async def secured(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[EngineServer]:
    """Services on loopback that take calls only with a token."""
    tokens = tokens_of(Role.WORKER, [WORKER_TOKEN]).merged(tokens_of(Role.CLIENT, [CLIENT_TOKEN]))
    server = await start_engine(
        nats_server.url,
        config=FAST,
        security=ServerSecurity(tokens=tokens),
        local_socket=short_dir / "local.sock",
    )
    yield server
    await server.stop()


async def test_a_worker_given_the_socket_takes_it_for_its_journal_calls(
    client: Client, engine: EngineServer
) -> None:
    assert engine.local_socket is not None
    before = engine.local_socket.accepted
    await run_without_a_crash(client, engine, socketed)  # the records a gRPC worker writes
    assert engine.local_socket.accepted > before


async def test_a_worker_on_the_services_host_finds_their_socket(
    client: Client, engine: EngineServer
) -> None:
    """Told nothing, a worker's journal calls go to the socket its polls'
    answers name; told "off", they stay on gRPC."""
    sockets = engine.local_socket
    assert sockets is not None
    before, polled = sockets.accepted, sockets.polled
    await run_without_a_crash(client, engine, found)
    assert sockets.accepted > before
    assert sockets.polled > polled, "its polls go there too"
    before, polled = sockets.accepted, sockets.polled
    await run_without_a_crash(client, engine, remote)  # local_socket="off"
    assert (sockets.accepted, sockets.polled) == (before, polled)


async def test_another_servers_socket_at_the_path_puts_the_calls_back_on_grpc(
    engine: EngineServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The polls name this server's socket, but the one at the path answers
    as another server's (a host's path reused, say): its hello is refused,
    the worker says so, and the run's journal calls go on gRPC. (The client
    is told "off", so that only the worker says where its calls go.)"""
    assert engine.local_socket is not None
    sockets = engine.local_socket
    caplog.set_level(logging.INFO, logger="dagnats.sdk")
    with monkeypatch.context() as env:
        env.setenv("DAGNATS_LOCAL_SOCKET", "off")
        client = Client(engine.target)  # read when made; the worker is made without it
    ours, sockets.instance = sockets.instance, "another-server"
    try:
        before = sockets.accepted
        await run_without_a_crash(client, engine, found)
    finally:
        sockets.instance = ours
        await client.close()
    # The polls' connection, the watch's for the runs' cancel (a poll of its
    # own while a poll is out) and the journal calls', or fewer if a
    # refusal came first: each refused, then none.
    assert sockets.accepted - before in (1, 2, 3)
    said = [r.getMessage() for r in caplog.records if "calls go" in r.getMessage()]
    assert said == [
        f"calls go to the local socket {sockets.path}",
        f"local socket calls go on gRPC: {sockets.path} is another server's local socket",
    ]


async def test_a_client_on_the_services_host_watches_its_runs_on_their_socket(
    engine: EngineServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's first watch goes on gRPC and its answer names the socket;
    the next ones, a start and wait among them, go there and give
    what gRPC gives. Told "off", or refused at the socket, a client watches
    on gRPC."""
    sockets = engine.local_socket
    assert sockets is not None
    caplog.set_level(logging.INFO, logger="dagnats.sdk")
    task, name = unique("watched"), unique("watched")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))

    async def done(tc: TaskContext) -> None:
        await tc.complete("done")

    async with found(engine, {task: done}):
        async with Client(engine.target) as own:
            before = sockets.watched
            assert await own.run(name, {"ask": "weather"}) == "done"  # on gRPC
            assert sockets.watched == before
            assert await own.run(name, {"ask": "weather"}) == "done"  # starts on the socket
            run = await own.start_run(name, {"ask": "weather"})
            ended = await own.wait_for_run(run.run_id, timeout=40)
            assert ended.status == pb.RUN_STATUS_COMPLETED and run_output(ended) == "done"
            assert sockets.watched == before + 2
            with pytest.raises(errors.NotFound):  # the engine's error, as on gRPC
                await own.wait_for_run("0" * 32, timeout=5)
            assert sockets.watched == before + 3
        refused = f"local socket calls go on gRPC: {sockets.path} is another server's"
        ours, sockets.instance = sockets.instance, "another-server"
        try:
            async with Client(engine.target) as own:
                assert await own.run(name, {"ask": "weather"}) == "done"  # names the socket
                assert own._rpc._found is not None and own._rpc._found._socket is not None
                assert await own.run(name, {"ask": "weather"}) == "done"  # refused: gRPC
                assert own._rpc._found._socket is None, "the refused socket is set aside"
        finally:
            sockets.instance = ours
        said = [r.getMessage() for r in caplog.records if "calls go on gRPC" in r.getMessage()]
        assert any(line.startswith(refused) for line in said), said  # the worker's may follow
        monkeypatch.setenv("DAGNATS_LOCAL_SOCKET", "off")
        async with Client(engine.target) as own:
            for _ in range(2):
                assert await own.run(name, {"ask": "weather"}) == "done"
        assert sockets.watched == before + 3


async def test_a_clients_watch_on_the_socket_rides_out_a_services_restart(
    nats_server: NatsServer, short_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The services restart while a client waits on the socket for a run:
    the wait goes on (on gRPC while they are down), ends with the run, and
    the client's next watches go to the restarted services' socket."""
    path = short_dir / "restart.sock"
    env = {"DAGNATS_LOCAL_SOCKET": str(path), "DAGNATS_TASK_ACK_WAIT": "20"}
    engine = EngineProcess(nats_server.url, tmp_path, "engine", env=env)
    await engine.start()
    task, name = unique("restarted"), unique("restarted")
    gate = asyncio.Event()

    async def held(tc: TaskContext) -> None:
        if tc.input.get("hold"):
            await gate.wait()
        await tc.complete("done")

    try:
        async with (
            Client(engine.target) as client,
            Worker(engine.target, handlers={task: held}, poll_wait=0.5),
        ):
            await client.register_workflow(loop_workflow(name, task))
            assert await client.run(name, {}) == "done"  # its answer names the socket
            found = client._rpc._found
            assert found is not None and found._socket is not None
            first = found._socket.instance
            made: list[LocalConnection] = []  # the client's connections to the socket
            connect = found.connection

            def connection() -> LocalConnection | None:
                if (made_now := connect()) is not None:
                    made.append(made_now)
                return made_now

            monkeypatch.setattr(found, "connection", connection)
            run = await client.start_run(name, {"hold": True})
            waiting = asyncio.create_task(client.wait_for_run(run.run_id, timeout=60))
            await wait_for(lambda: bool(made) and made[0].transport is not None, timeout=10)
            await engine.stop()
            await engine.start()
            gate.set()
            done = await waiting
            assert done.status == pb.RUN_STATUS_COMPLETED and run_output(done) == "done"
            assert found._socket is not None and found._socket.instance != first
            assert await client.run(name, {}) == "done"
            assert client._rpc._watches is not None, "a watch on the new socket, kept idle"
    finally:
        await engine.stop()


# The keepalive of the frozen-process test, and what it allows a loaded machine more.
KEEPALIVE, MARGIN = 1.0, 5.0


async def test_a_frozen_services_process_ends_a_watch_and_a_poll_on_its_socket_within_the_keepalive(
    nats_server: NatsServer, short_dir: Path, tmp_path: Path
) -> None:
    """A watch of a run that goes on and a long poll wait on the socket with
    nothing arriving: their pings are answered and they go on. Then the
    services process is frozen (SIGSTOP: its socket stays open, nothing
    reads it): each ends within the keepalive, UNAVAILABLE, which the SDK
    tries again as any broken connection."""
    path = short_dir / "frozen.sock"
    env = {"DAGNATS_LOCAL_SOCKET": str(path)}
    engine = EngineProcess(nats_server.url, tmp_path, "engine", env=env)
    await engine.start()
    try:
        async with Client(engine.target) as client:
            name = unique("frozen")
            await client.register_workflow(loop_workflow(name, unique("nobody")))
            run = await client.start_run(name, {})
        watches = LocalConnection(str(path), keepalive=KEEPALIVE)
        watch, first = await _watch(watches, pb.WatchRunRequest(run_id=run.run_id))
        assert first.run.status == pb.RUN_STATUS_RUNNING
        watched = asyncio.create_task(anext(watch))
        polls = LocalConnection(str(path), keepalive=KEEPALIVE)
        request = pb.PollTasksRequest(task_types=[unique("none")], wait=Duration(seconds=60))
        polled = asyncio.create_task(_poll(polls, request))
        # Two pings each, the first answered, or the connection would have ended.
        await wait_for(lambda: watches.pings >= 2 and polls.pings >= 2, timeout=30)
        assert not watches.done() and not polls.done()
        engine.freeze()
        for waiting in (watched, polled):
            with pytest.raises(TransportError) as ended:
                await asyncio.wait_for(waiting, KEEPALIVE + MARGIN)
            assert ended.value.code == grpc.StatusCode.UNAVAILABLE
            assert "DAGNATS_LOCAL_KEEPALIVE" in ended.value.message
    finally:
        engine.thaw()
        await engine.stop()


def test_the_sdk_reads_the_sockets_keepalive_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DAGNATS_LOCAL_KEEPALIVE", "2.5")
    assert FoundSocket(None)._keepalive == 2.5
    assert FoundSocket(None, keepalive=1.0)._keepalive == 1.0


def _connection(sockets: LocalListener, token: str | None = None) -> LocalConnection:
    """A connection to ``sockets``, as a client that found it makes."""
    refusals: list[str] = []
    return LocalConnection(
        str(sockets.path), token, instance=sockets.instance, refused=refusals.append
    )


async def _watch(
    connection: LocalConnection, request: pb.WatchRunRequest
) -> tuple[LocalStream[pb.WatchRunResponse], pb.WatchRunResponse]:
    """A watch on ``connection`` and its first state."""
    stream = await connection.stream(WATCH_METHOD, request, pb.WatchRunResponse, {})
    return stream, await anext(stream)


async def _poll(connection: LocalConnection, request: pb.PollTasksRequest) -> pb.PollTasksResponse:
    return await connection.call(POLL_METHOD, request, pb.PollTasksResponse, {})


async def test_the_watches_socket_takes_only_a_token_that_may_watch(
    secured: EngineServer,
) -> None:
    """A client's token (not a worker's) may watch on the socket; a watch the
    engine refuses raises its domain error, and the connection serves on."""
    assert secured.local_socket is not None
    for token, status in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (WORKER_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
    ):
        watches = _connection(secured.local_socket, token)
        with pytest.raises(TransportError) as refused:
            await _watch(watches, pb.WatchRunRequest(run_id="0" * 32))
        assert refused.value.code == status, token
        assert watches.not_sent(), "a refused call: the watch was never read"
    watches = _connection(secured.local_socket, CLIENT_TOKEN)
    with pytest.raises(errors.NotFound):
        await _watch(watches, pb.WatchRunRequest(run_id="0" * 32))
    with pytest.raises(errors.InvalidArgument) as bad:
        await _watch(watches, pb.WatchRunRequest(run_id="not an id"))
    assert bad.value.field == "run_id" and watches.idle()
    watches.close()


async def test_a_watch_left_before_its_run_ends_is_cancelled_on_the_server(
    client: Client, engine: EngineServer
) -> None:
    """A client that stops watching a run that goes on (nobody polls its
    task) closes its connection, and the engine stops watching the run."""
    sockets = engine.local_socket
    assert sockets is not None
    _, name = await start(client)
    run = await client.start_run(name, {"ask": "weather"})
    watches = _connection(sockets)
    watch, first = await _watch(watches, pb.WatchRunRequest(run_id=run.run_id))
    assert first.run.run_id == run.run_id and first.run.status == pb.RUN_STATUS_RUNNING
    hubs = engine.watches._hubs
    await wait_for(lambda: run.run_id in hubs, timeout=10)
    assert watch.cancel() and watches.done()
    await wait_for(lambda: run.run_id not in hubs, timeout=10)
    await client.cancel_run(run.run_id)


def test_a_worker_keeps_the_socket_it_found_until_it_is_refused_or_replaced(
    short_dir: Path,
) -> None:
    """Polls answered by two services processes name two sockets: the
    calls stay on the first (both reach the same journal) until a session
    on it is refused; then the next one named is taken, and the refused one
    never again. A new instance at the path in use (its server restarted)
    is taken at once."""
    found = FoundSocket(token=None)
    first, second = (
        pb.LocalSocket(path=str(short_dir / name), instance=name) for name in ("a.sock", "b.sock")
    )
    listening = []
    for offer in (first, second):
        listening.append(socket.socket(socket.AF_UNIX))
        listening[-1].bind(offer.path)
    try:
        assert found.offered(first)
        assert not found.offered(second) and not found.offered(first)
        connection = found.connection()
        assert connection is not None
        with pytest.raises(TransportError):  # nothing listens: refused before any answer
            asyncio.run(
                connection.call(CHECK_TAIL, jpb.CheckTailRequest(), jpb.CheckTailResponse, {})
            )
        assert found.connection() is None, "back on gRPC"
        assert not found.offered(first), "a refused socket is not taken again"
        assert found.offered(second)
        restarted = pb.LocalSocket(path=second.path, instance="b-again")
        assert found.offered(restarted), "a new server at the path is taken at once"
        assert not found.offered(second)
    finally:
        for bound in listening:
            bound.close()


def test_a_socket_path_that_is_not_a_socket_here_is_not_taken(short_dir: Path) -> None:
    """A worker on another host gets a path that means nothing there."""
    sockets = FoundSocket(token=None)
    for path in (short_dir / "missing.sock", short_dir):
        assert not sockets.offered(pb.LocalSocket(path=str(path), instance="i"))
    assert sockets.connection() is None


async def _call(path: str, token: str | None) -> errors.InvalidArgument:
    """One call on a new connection with ``token``: a tail check that names
    no writer, which the journal refuses with an error of its own when it
    gets that far."""
    connection = LocalConnection(path, token)
    try:
        with pytest.raises(errors.InvalidArgument) as refused:
            await connection.call(CHECK_TAIL, jpb.CheckTailRequest(), jpb.CheckTailResponse, {})
        assert not connection.done(), "a domain error answers its call"
        return refused.value
    finally:
        connection.cancel()


async def test_the_socket_takes_a_worker_token_when_the_server_needs_one(
    secured: EngineServer,
) -> None:
    assert secured.local_socket is not None
    path = str(secured.local_socket.path)
    for token, status in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
        (CLIENT_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(TransportError) as refused:
            await _call(path, token)
        assert refused.value.code == status, token
    answer = await _call(path, WORKER_TOKEN)  # reached the journal: its own error
    assert answer.field == "token.run_id"


async def test_the_polls_socket_takes_only_a_token_that_may_poll(secured: EngineServer) -> None:
    assert secured.local_socket is not None
    for token, status in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (CLIENT_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
    ):
        polls = _connection(secured.local_socket, token)
        with pytest.raises(TransportError) as refused:
            await _poll(polls, pb.PollTasksRequest(task_types=["t"]))
        assert refused.value.code == status, token
    polls = _connection(secured.local_socket, WORKER_TOKEN)
    wait = Duration(nanos=50_000_000)
    answer = await _poll(polls, pb.PollTasksRequest(task_types=[unique("none")], wait=wait))
    assert list(answer.tasks) == []
    polls.close()


async def test_a_poll_refused_on_the_socket_fails_as_on_grpc_and_the_connection_serves_on(
    engine: EngineServer,
) -> None:
    assert engine.local_socket is not None
    polls = _connection(engine.local_socket)
    with pytest.raises(errors.InvalidArgument) as refused:
        await _poll(polls, pb.PollTasksRequest(task_types=["not a type"]))
    assert refused.value.field == "task_types[0]"
    wait = Duration(nanos=50_000_000)
    answer = await _poll(polls, pb.PollTasksRequest(task_types=[unique("none")], wait=wait))
    assert list(answer.tasks) == [] and not polls.done()
    polls.close()


async def test_a_socket_that_serves_no_engine_refuses_a_poll(
    engine: EngineServer, short_dir: Path
) -> None:
    """A journal's socket in a process without the engine: a poll or a watch
    is refused by name before it is read, and the worker's polls (told
    nothing of it) stay on gRPC."""
    assert engine.journal is not None
    sockets = await LocalListener.start(
        short_dir / "local.sock", methods(engine.journal), ServerSecurity().admission
    )
    try:
        polls = _connection(sockets)
        with pytest.raises(TransportError) as refused:
            await _poll(polls, pb.PollTasksRequest(task_types=["t"]))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"takes no {POLL_METHOD}" in refused.value.message and polls.not_sent()
        watches = _connection(sockets)
        with pytest.raises(TransportError) as refused:
            await _watch(watches, pb.WatchRunRequest(run_id="0" * 32))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"takes no {WATCH_METHOD}" in refused.value.message and watches.not_sent()
    finally:
        await sockets.close()


async def test_a_bad_frame_ends_its_connection_and_the_socket_serves_on(
    engine: EngineServer,
) -> None:
    assert engine.local_socket is not None
    path = str(engine.local_socket.path)
    for sent in (
        HEADER.pack(3) + b"\xff\xff\xff",  # not a LocalHello
        HEADER.pack(MAX_FRAME + 1),  # longer than any frame may be
        _frame(pb.LocalHello()) + HEADER.pack(2) + b"\xff\xff",  # not a LocalCall
        _frame(pb.LocalHello())
        + _frame(pb.LocalCall(id=1, method=CHECK_TAIL, request=b"\xff\xff")),  # nor its request
    ):
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(sent)
        answer = pb.LocalAnswer.FromString(await _read_frame(reader))
        assert answer.id == 0
        assert answer.error.status == grpc.StatusCode.INVALID_ARGUMENT.value[0], answer
        assert await reader.read() == b"", "the connection is closed after the error"
        writer.close()
    refused = await _call(path, None)  # the socket still serves
    assert refused.field == "token.run_id"


async def test_a_silent_connection_is_ended_and_requests_sent_ahead_are_answered_in_order(
    engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.local_socket is not None
    path = str(engine.local_socket.path)
    monkeypatch.setattr(local_transport, "HELLO_SECONDS", 0.2)
    reader, writer = await asyncio.open_unix_connection(path)
    answer = pb.LocalAnswer.FromString(await _read_frame(reader))
    assert answer.id == 0
    assert answer.error.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], answer
    writer.close()
    # More calls than the socket reads ahead, sent before reading any answer:
    # it stops reading, then goes on, and answers every one, in order.
    sent = 4 * local_transport.READ_AHEAD
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(_frame(pb.LocalHello()))
    writer.write(
        b"".join(_frame(pb.LocalCall(id=n, method=CHECK_TAIL)) for n in range(1, sent + 1))
    )
    await writer.drain()
    answers = [pb.LocalAnswer.FromString(await _read_frame(reader)) for _ in range(sent)]
    assert [a.id for a in answers] == list(range(1, sent + 1))
    assert all(a.error.field == "token.run_id" for a in answers)
    writer.close()


def _frame(message: pb.LocalHello | pb.LocalCall) -> bytes:
    data = message.SerializeToString()
    return HEADER.pack(len(data)) + data


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    return await reader.readexactly(length)


async def test_a_restarted_socket_costs_a_worker_nothing(
    client: Client, engine: EngineServer, short_dir: Path
) -> None:
    """The socket closes under a worker that keeps idle sessions on it (the
    services restarting) and comes back: the worker's next run opens new ones."""
    assert engine.journal is not None
    path = short_dir / "restart.sock"
    table, admission = methods(engine.journal), ServerSecurity().admission
    (first, first_name), (second, second_name) = await start(client), await start(client)
    handlers = {
        first: agent(ScriptedModel(SCRIPT), Tools()),
        second: agent(ScriptedModel(SCRIPT), Tools()),
    }
    sockets = await LocalListener.start(path, table, admission)
    try:
        async with Worker(engine.target, handlers=handlers, poll_wait=1.0, local_socket=str(path)):
            run = await client.start_run(first_name, {"ask": "weather"})
            assert (await finish(client, engine, run.run_id)).status == pb.RUN_STATUS_COMPLETED
            assert sockets.connections, "the worker keeps its idle session open"
            await sockets.close()
            assert not path.exists(), "a closed socket leaves no file"
            sockets = await LocalListener.start(path, table, admission)
            run = await client.start_run(second_name, {"ask": "weather"})
            assert (await finish(client, engine, run.run_id)).status == pb.RUN_STATUS_COMPLETED
            assert sockets.accepted >= 1
    finally:
        await sockets.close()


async def test_the_socket_file_is_the_owners_and_a_live_one_is_not_taken(
    engine: EngineServer, short_dir: Path
) -> None:
    assert engine.journal is not None and engine.local_socket is not None
    assert stat.S_IMODE(os.stat(engine.local_socket.path).st_mode) == 0o600
    table = methods(engine.journal)

    async def start(path: Path) -> LocalListener:
        return await LocalListener.start(path, table, ServerSecurity().admission)

    with pytest.raises(errors.Unavailable, match="another server listens"):
        await start(engine.local_socket.path)
    not_a_socket = short_dir / "file"
    not_a_socket.write_text("keep me")
    with pytest.raises(errors.InvalidArgument, match="not a socket"):
        await start(not_a_socket)
    assert not_a_socket.read_text() == "keep me"
    with pytest.raises(errors.InvalidArgument, match="at most 107 bytes"):
        await start(short_dir / ("x" * 120))
    stale = short_dir / "stale.sock"
    left = await start(stale)
    await left.close()
    stale_server = await asyncio.get_running_loop().create_unix_server(asyncio.Protocol, stale)
    stale_server.close()  # a server that died: its file stays, and nothing answers on it
    await stale_server.wait_closed()
    assert stale.exists()
    replaced = await start(stale)
    try:
        answer = await _call(str(stale), None)
        assert answer.field == "token.run_id"
    finally:
        await replaced.close()


async def test_a_worker_told_of_a_missing_socket_warns_and_its_retries_say_why(
    engine: EngineServer, short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong path would keep journal calls retrying for as long as the
    heartbeats keep the lease: the worker says so at start, and a call still
    retrying after LOUD_AFTER seconds is logged as a warning with its reason."""
    missing = str(short_dir / "missing.sock")
    caplog.set_level(logging.INFO, logger="dagnats.sdk")

    def warned() -> bool:
        return any(
            r.levelno == logging.WARNING and missing in r.getMessage() for r in caplog.records
        )

    async with Worker(engine.target, handlers={"unused": _never}, local_socket=missing):
        await wait_for(warned, timeout=10)
    assert any(
        "No such file" in r.getMessage() for r in caplog.records if missing in r.getMessage()
    )

    failure = TransportError(grpc.StatusCode.UNAVAILABLE, f"local socket {missing}: no such file")
    outcome = SimpleNamespace(exception=lambda: failure)
    caplog.clear()
    for since in (0.5, rpc.LOUD_AFTER + 1):
        state = SimpleNamespace(outcome=outcome, seconds_since_start=since, attempt_number=3)
        rpc._log_retry("Session", state)  # type: ignore[arg-type]
    levels = [(r.levelno, missing in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.INFO, True), (logging.WARNING, True)]


async def _never(tc: object) -> None:
    raise AssertionError("no task of this type is started")


def test_dev_makes_its_socket_in_the_data_directory_when_the_path_fits(short_dir: Path) -> None:
    assert dev._local_socket(short_dir) == short_dir / "local.sock"
    assert dev._local_socket(short_dir / ("d" * 100)) is None  # gRPC only, and it says so
