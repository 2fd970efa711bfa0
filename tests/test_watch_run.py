"""Waiting for a run without polling: ``WatchRun``, ``wait_for_run`` and ``Client.run``.

Handlers here wait on gates the test opens (``tests.gates``), so each change
of the run is one the test caused and can expect in order. ``GetRun`` calls are counted at
the engine: a wait makes none.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import nats
import pytest
import pytest_asyncio
from nats.aio.msg import Msg
from nats.js.api import ConsumerInfo

from dagnats.core.natsserver import NatsServer
from dagnats.engine import watch
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.engine.watch import BUFFER, Watcher
from dagnats.sdk import (
    Client,
    InvalidArgument,
    NotFound,
    RunFailed,
    Unavailable,
    Worker,
)
from tests.gates import Gates, engine_counting_get_runs, two_steps
from tests.helpers import trailing, wait_for
from tests.matrix import EngineProcess
from tests.stack import FAST, unique

# GetRun calls the module's engine served, by run id; StartRun and WatchRun by name.
GET_RUNS: Counter[str] = Counter()
CALLS: Counter[str] = Counter()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    """The module's engine, counting the GetRun calls it serves in GET_RUNS
    and its StartRun and WatchRun calls in CALLS."""
    async with engine_counting_get_runs(nats_server.url, GET_RUNS, CALLS) as server:
        yield server


RUNNING, COMPLETED = pb.STEP_STATUS_RUNNING, pb.STEP_STATUS_COMPLETED


def statuses(run: pb.Run) -> tuple[int, ...]:
    return (run.status, *(s.status for s in run.steps))


async def watch_opening_gates(client: Client, run_id: str, gates: Gates) -> list[tuple[int, ...]]:
    """Watch every change of a gated two-step run to its end, opening each
    step's gate once it runs; the statuses seen."""
    seen = []
    async for state in client.watch_run(run_id):
        seen.append(statuses(state))
        steps = {s.step_id: s.status for s in state.steps}
        for step in ("first", "second"):
            if steps[step] == RUNNING:
                gates.open(step)
    return seen


async def test_a_watcher_gets_each_change_in_order_then_the_end(
    client: Client, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run = await client.start_run(name, {"ask": 1})
    seen: list[pb.Run] = []
    async for state in client.watch_run(run.run_id):
        seen.append(state)
        steps = {s.step_id: s.status for s in state.steps}
        if steps["first"] == RUNNING:
            gates.open("first")
        if steps["second"] == RUNNING:
            gates.open("second")

    # Each change the run went through, in order, once; nothing after the end.
    changes = [statuses(r) for r in seen]
    assert [c for i, c in enumerate(changes) if i == 0 or c != changes[i - 1]] == [
        (pb.RUN_STATUS_RUNNING, RUNNING, pb.STEP_STATUS_PENDING),
        (pb.RUN_STATUS_RUNNING, COMPLETED, RUNNING),
        (pb.RUN_STATUS_COMPLETED, COMPLETED, COMPLETED),
    ]
    assert all(a != b for a, b in itertools.pairwise(seen)), "a state sent twice"
    assert seen[-1].output == b'{"step":"second"}'


async def test_a_watcher_of_the_end_only_gets_the_run_as_it_is_then_its_end(
    engine: EngineServer, client: Client, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run = await client.start_run(name)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        call = pb_grpc.EngineServiceStub(channel).WatchRun(
            pb.WatchRunRequest(run_id=run.run_id, ended_only=True)
        )
        first = await call.read()
        seen = await watch_opening_gates(client, run.run_id, gates)
        rest: list[pb.WatchRunResponse] = []
        while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            assert isinstance(message, pb.WatchRunResponse)
            rest.append(message)
    assert isinstance(first, pb.WatchRunResponse)
    assert statuses(first.run)[0] == pb.RUN_STATUS_RUNNING
    assert len(set(seen)) >= 3, "the run changed between its start and its end"
    assert [statuses(m.run) for m in rest] == [(pb.RUN_STATUS_COMPLETED, COMPLETED, COMPLETED)]
    assert rest[0].run.output == b'{"step":"second"}'


async def test_wait_for_run_answers_on_the_end_without_polling(
    engine: EngineServer, client: Client, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run = await client.start_run(name)
    waiting = asyncio.create_task(client.wait_for_run(run.run_id, timeout=30))
    watches = engine.watches
    assert watches is not None
    await wait_for(lambda: run.run_id in watches, message="the run is watched")
    gates.open("first", "second")

    done = await waiting
    assert done.status == pb.RUN_STATUS_COMPLETED
    assert [s.status for s in done.steps] == [COMPLETED, COMPLETED]
    assert GET_RUNS[run.run_id] == 0, "the wait polled GetRun"
    await wait_for(lambda: run.run_id not in watches, message="the watch is stopped")


async def test_many_watchers_of_a_run_share_one_consumer(
    engine: EngineServer, client: Client, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    run = await client.start_run(name)
    waits = [asyncio.create_task(client.wait_for_run(run.run_id, timeout=30)) for _ in range(20)]
    assert engine.watches is not None
    watches = engine.watches
    await wait_for(lambda: watches.watchers(run.run_id) == 20, message="20 watchers")

    async def on_the_run() -> list[ConsumerInfo]:
        consumers = await engine.nc.jetstream().consumers_info("KV_RUNS")
        return [c for c in consumers if c.config.filter_subject == f"$KV.RUNS.{run.run_id}"]

    # The run is long: its watch starts once WATCH_AFTER has passed.
    assert len(await wait_for(on_the_run, message="the run's watch")) == 1
    gates.open("first", "second")
    ends = await asyncio.gather(*waits)
    assert {r.status for r in ends} == {pb.RUN_STATUS_COMPLETED}


@pytest_asyncio.fixture(loop_scope="module")
async def consumers_created(nats_server: NatsServer) -> AsyncIterator[list[bytes]]:
    """The requests that create a consumer on the runs bucket, as sent."""
    created: list[bytes] = []
    nc = await nats.connect(nats_server.url)

    async def seen(msg: Msg) -> None:
        created.append(msg.data)

    for subject in ("$JS.API.CONSUMER.CREATE.KV_RUNS", "$JS.API.CONSUMER.CREATE.KV_RUNS.>"):
        await nc.subscribe(subject, cb=seen)
    await nc.flush()
    yield created
    await nc.close()


async def test_a_run_this_engine_writes_is_watched_without_a_consumer(
    client: Client,
    gated: tuple[str, Gates],
    consumers_created: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine hands its watches each state of the run as it stores it
    # (its own writes told); the watch of the bucket waits, here longer than the run.
    monkeypatch.setattr(watch, "WATCH_AFTER", 60.0)
    name, gates = gated
    run = await client.start_run(name)
    seen = await watch_opening_gates(client, run.run_id, gates)
    assert seen[-1] == (pb.RUN_STATUS_COMPLETED, COMPLETED, COMPLETED)
    assert (pb.RUN_STATUS_RUNNING, COMPLETED, RUNNING) in seen
    key = f"$KV.RUNS.{run.run_id}".encode()
    assert [c for c in consumers_created if key in c] == []


async def test_a_watch_starts_at_once_when_another_engine_writes_its_run(
    nats_server: NatsServer,
    engine: EngineServer,
    client: Client,
    gated: tuple[str, Gates],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On one server the engine hears the other engine's write (heard writes) and
    # watches the bucket at once, rather than after WATCH_AFTER.
    monkeypatch.setattr(watch, "WATCH_AFTER", 60.0)
    name, _ = gated
    run = await client.start_run(name)
    waiting = asyncio.create_task(client.wait_for_run(run.run_id, timeout=20))
    assert engine.watches is not None
    watches = engine.watches
    await wait_for(lambda: run.run_id in watches, message="the run is watched")
    other = await start_engine(nats_server.url, config=FAST, with_journal=False)
    try:
        async with Client(other.target) as elsewhere:
            await elsewhere.cancel_run(run.run_id, reason="from elsewhere")
        done = await waiting
    finally:
        await other.stop()
    assert done.status == pb.RUN_STATUS_CANCELLED


async def test_a_finished_run_is_answered_at_once(client: Client, gated: tuple[str, Gates]) -> None:
    name, gates = gated
    gates.open("first", "second")
    run = await client.start_run(name)
    done = await client.wait_for_run(run.run_id, timeout=30)
    assert [r.status async for r in client.watch_run(run.run_id)] == [pb.RUN_STATUS_COMPLETED]
    assert (await client.wait_for_run(run.run_id, timeout=30)) == done


async def test_run_returns_the_output_of_a_completed_run(
    client: Client, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    gates.open("first", "second")
    assert await client.run(name, {"ask": 2}, timeout=30) == {"step": "second"}


async def test_run_starts_its_run_with_the_watch_it_waits_on(
    client: Client, gated: tuple[str, Gates]
) -> None:
    name, gates = gated
    gates.open("first", "second")
    before = CALLS.copy()
    assert await client.run(name, {"ask": 3}, timeout=30) == {"step": "second"}
    assert CALLS - before == Counter({"WatchRun": 1}), "one call: no StartRun, one watch"


async def test_a_watch_that_starts_a_run_refuses_bad_input_as_start_run_does(
    engine: EngineServer, client: Client
) -> None:
    with pytest.raises(NotFound) as unknown:
        await client.run(unique("nowf"), timeout=5)
    assert unknown.value.field == "workflow"
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        for request, status, field in [
            (pb.StartRunRequest(workflow="bad name"), grpc.StatusCode.INVALID_ARGUMENT, "workflow"),
            (
                pb.StartRunRequest(workflow="w", input=b"{"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "input",
            ),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.WatchRun(pb.WatchRunRequest(start=request)):
                    pass
            assert failed.value.code() == status
            assert trailing(failed.value)["dagnats-error-field"] == field
        both = pb.WatchRunRequest(run_id="ab" * 16, start=pb.StartRunRequest(workflow="w"))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stub.WatchRun(both):
                pass
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert trailing(failed.value)["dagnats-error-field"] == "run_id"


async def test_run_raises_for_a_failed_run(client: Client, gated: tuple[str, Gates]) -> None:
    name, gates = gated
    gates.failing.add("first")
    gates.open("first")
    with pytest.raises(RunFailed) as raised:
        await client.run(name, timeout=30)
    assert raised.value.status == "failed"
    assert "told to fail" in raised.value.error
    assert raised.value.run.status == pb.RUN_STATUS_FAILED


async def test_run_raises_for_a_cancelled_run(client: Client, gated: tuple[str, Gates]) -> None:
    name, _ = gated
    key = unique("key")
    waiting = asyncio.create_task(client.run(name, timeout=30, idempotency_key=key))
    started = await client.start_run(name, idempotency_key=key)  # the same run
    await client.cancel_run(started.run_id, "not needed")
    with pytest.raises(RunFailed) as raised:
        await waiting
    assert raised.value.status == "cancelled"
    assert raised.value.run_id == started.run_id
    assert "not needed" in str(raised.value)


async def test_bad_and_unknown_run_ids(engine: EngineServer, client: Client) -> None:
    with pytest.raises(InvalidArgument) as bad:
        await client.wait_for_run("not-a-run", timeout=5)
    assert bad.value.field == "run_id"
    with pytest.raises(NotFound):
        await client.wait_for_run("ab" * 16, timeout=5)

    # On the wire: the status, and the error trailers every dagnats call carries.
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        for run_id, status, code in [
            ("../x", grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
            ("ab" * 16, grpc.StatusCode.NOT_FOUND, "not_found"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.WatchRun(pb.WatchRunRequest(run_id=run_id)):
                    pass
            assert failed.value.code() == status
            trailers = trailing(failed.value)
            assert trailers["dagnats-error-code"] == code
            assert trailers["dagnats-error-field"] == "run_id"


# ---- restarts ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def gated_run(target: str) -> AsyncIterator[tuple[Client, str, Gates]]:
    """A client, a started run of a gated two-step workflow, and its gates."""
    name, task, gates = unique("gated"), unique("gated-task"), Gates()
    async with (
        Client(target) as client,
        Worker(target, handlers={task: gates.handle}, poll_wait=1.0),
    ):
        await client.register_workflow(two_steps(name, task))
        run = await client.start_run(name)
        yield client, run.run_id, gates


@pytest.mark.slow
async def test_a_watch_rides_out_an_engine_restart(nats_server: NatsServer, tmp_path: Path) -> None:
    """The engine process is SIGKILLed while a run is watched and started
    again on its port: the watch opens again and gets the run's end."""
    engine = EngineProcess(nats_server.url, tmp_path, "engine")
    await engine.start()
    try:
        async with gated_run(engine.target) as (client, run_id, gates):
            watch = client.watch_run(run_id)
            first = await anext(watch)
            assert first.status == pb.RUN_STATUS_RUNNING
            engine.kill()
            await engine.start()
            gates.open("first", "second")
            rest = [state async for state in watch]
        assert engine.starts == 2
        assert rest[-1].status == pb.RUN_STATUS_COMPLETED
        assert all(r.status == pb.RUN_STATUS_RUNNING for r in rest[:-1])
    finally:
        await engine.stop()


class _Broke(logging.Handler):
    """Counts the SDK's log lines that say a WatchRun stream broke."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "WatchRun stream broke" in record.getMessage():
            self.count += 1


@contextlib.contextmanager
def watch_breaks() -> Iterator[_Broke]:
    handler = _Broke()
    sdk_log = logging.getLogger("dagnats.sdk")
    level = sdk_log.level
    sdk_log.addHandler(handler)
    sdk_log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        sdk_log.removeHandler(handler)
        sdk_log.setLevel(level)


@pytest.mark.slow
async def test_a_watch_of_a_frozen_engine_gives_up_instead_of_hanging(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine process is frozen (SIGSTOP: its socket stays open, nothing
    answers) under a watched run. The connection's keepalive ping goes
    unanswered, the stream breaks, and the watch gives up as Unavailable once
    its retry budget is spent, instead of waiting for the caller's timeout."""
    monkeypatch.setenv("DAGNATS_GRPC_KEEPALIVE", "0.3")
    engine = EngineProcess(nats_server.url, tmp_path, "engine")
    await engine.start()
    try:
        async with Client(engine.target, retry_for=2.0, timeout=2.0) as client:
            name = unique("frozen")
            await client.register_workflow(two_steps(name, unique("frozen-task")))
            run = await client.start_run(name)
            engine.freeze()
            with pytest.raises(Unavailable, match="WatchRun"):
                await client.wait_for_run(run.run_id, timeout=120)
    finally:
        engine.thaw()
        await engine.stop()


@pytest.mark.slow
async def test_a_watch_carries_on_when_a_frozen_engine_wakes(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is frozen long enough for the keepalive to break the
    watch's stream, then wakes within the retry budget: the watch opens
    again and gets the run's end."""
    monkeypatch.setenv("DAGNATS_GRPC_KEEPALIVE", "0.3")
    engine = EngineProcess(nats_server.url, tmp_path, "engine")
    await engine.start()
    try:
        with watch_breaks() as broke:
            async with gated_run(engine.target) as (client, run_id, gates):
                watch = client.watch_run(run_id)
                first = await anext(watch)
                assert first.status == pb.RUN_STATUS_RUNNING
                engine.freeze()
                rest = asyncio.create_task(_collect(watch))
                await wait_for(lambda: broke.count > 0, message="the frozen stream broke")
                engine.thaw()
                gates.open("first", "second")
                states = await asyncio.wait_for(rest, 60)
        assert states[-1].status == pb.RUN_STATUS_COMPLETED
    finally:
        engine.thaw()
        await engine.stop()


async def _collect(watch: AsyncIterator[pb.Run]) -> list[pb.Run]:
    return [state async for state in watch]


@pytest.mark.slow
async def test_a_watch_that_started_its_run_watches_it_again_by_id_after_a_restart(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A watch that started its run (``Client.run``'s) broken by an engine
    SIGKILL after its first message opens again on the run's id: one run."""
    engine = EngineProcess(nats_server.url, tmp_path, "engine")
    await engine.start()
    name, task, gates = unique("gated"), unique("gated-task"), Gates()
    try:
        async with (
            Client(engine.target) as client,
            Worker(engine.target, handlers={task: gates.handle}, poll_wait=1.0),
        ):
            await client.register_workflow(two_steps(name, task))
            start = pb.StartRunRequest(workflow=name)
            watch = client._rpc.watch_run(pb.WatchRunRequest(start=start))
            first = (await anext(watch)).run
            engine.kill()
            await engine.start()
            gates.open("first", "second")
            rest = [response.run async for response in watch]
            runs = await client.list_runs(workflow=name)
        assert engine.starts == 2
        assert rest[-1].status == pb.RUN_STATUS_COMPLETED
        assert {r.run_id for r in rest} == {first.run_id}
        assert [r.run_id for r in runs] == [first.run_id]
    finally:
        await engine.stop()


@pytest.mark.slow
async def test_a_watch_rides_out_a_nats_server_restart(tmp_path: Path) -> None:
    """nats-server restarts under an engine with a watched run: the engine's
    watch of the run starts over after the last write it saw."""
    server = await NatsServer.start(tmp_path / "nats")
    engine = await start_engine(server.url, config=FAST)
    assert engine.watches is not None
    watches = engine.watches
    try:
        async with gated_run(engine.target) as (client, run_id, gates):
            waiting = asyncio.create_task(client.wait_for_run(run_id, timeout=60))
            await wait_for(lambda: run_id in watches, message="the run is watched")
            await server.restart()
            gates.open("first", "second")
            done = await waiting
        assert done.status == pb.RUN_STATUS_COMPLETED
    finally:
        await engine.stop()
        await server.stop()


async def test_a_watcher_far_behind_skips_the_oldest_states_never_the_last() -> None:
    def state(revision: int, status: pb.RunStatus.ValueType = pb.RUN_STATUS_RUNNING) -> StoredRun:
        output = str(min(revision, 1000)).encode()
        run = pb.Run(run_id="ab" * 16, status=status, output=output)
        return StoredRun(ipb.RunRecord(run=run), revision)

    watcher = Watcher(state(1))
    for revision in range(2, 1000):
        watcher.offer(state(revision))
    watcher.offer(state(1000, pb.RUN_STATUS_COMPLETED))
    watcher.offer(state(1001, pb.RUN_STATUS_COMPLETED))  # an outbox cleared: no news

    sent = [s.revision async for s in watcher.changes()]
    # It holds the last BUFFER offers, and sends none after the final state.
    assert sent == list(range(1001 - BUFFER + 1, 1001))
