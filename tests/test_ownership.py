"""Partition leases on a real nats-server: replicas share the partitions,
take a stopped one's, and the number of partitions is fixed at provisioning."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import grpc
import nats
import nats.js.errors
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration
from nats.aio.client import Client as NATS

from dagnats.core import jetstream as jsx
from dagnats.core.errors import InvalidArgument
from dagnats.core.natsserver import NatsServer
from dagnats.engine.config import ReplicaConfig
from dagnats.engine.ownership import Ownership
from dagnats.engine.server import EngineServer, start_engine, start_services
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.sdk import Client
from tests.helpers import wait_for
from tests.matrix import child_env

P = 6


@pytest_asyncio.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """A connection to a server whose PARTITIONS bucket starts empty."""
    conn = await jsx.connect(nats_server.url, name="test-ownership")
    js = conn.jetstream()
    with contextlib.suppress(nats.js.errors.NotFoundError):  # the first test finds none
        await js.delete_key_value(jsx.KV_PARTITIONS)
    await jsx.provision(js)
    yield conn
    await conn.close()


async def replicas(nc: NATS, *ids: str, lease: float = 1.0) -> list[Ownership]:
    started = []
    for rid in ids:
        own = Ownership(nc, replica_id=rid, partitions=P, lease=lease)
        await own.start()
        started.append(own)
    return started


def split(*owners: Ownership) -> list[int] | None:
    """The sizes of the owned sets when they cover every partition once."""
    sets = [o.owned() for o in owners]
    every = sorted(k for s in sets for k in s)
    return [len(s) for s in sets] if every == list(range(P)) else None


async def engine_replica(nats_server: NatsServer, replica_id: str) -> EngineServer:
    """An engine alone in its process, one replica of two partitions, whose
    partition lease (30 s) never runs out within a test."""
    return await start_engine(
        nats_server.url,
        with_journal=False,
        with_inputs=False,
        replica=ReplicaConfig(partitions=2, lease=30.0, replica_id=replica_id),
    )


async def test_replicas_join_split_evenly_and_take_a_killed_ones_share(nc: NATS) -> None:
    a, b, c = await replicas(nc, "a", "b", "c")
    try:
        # Each started alone and took what was free; they converge to 2/2/2.
        await wait_for(lambda: split(a, b, c) == [2, 2, 2], message="a 2/2/2 split")
        kept = {o.replica_id: o.owned() for o in (a, b)}
        await c.stop()  # as kill -9: no renewal, nothing deleted
        await wait_for(lambda: split(a, b) == [3, 3], timeout=10, message="c's share taken")
        assert kept["a"] <= a.owned() and kept["b"] <= b.owned()  # only c's moved
        (d,) = await replicas(nc, "d")  # a new replica joins and gets its share
        await wait_for(lambda: split(a, b, d) == [2, 2, 2], message="d's share")
        await d.stop()
    finally:
        for o in (a, b, c):
            await o.stop()


async def test_a_replica_slow_to_follow_a_change_still_beats(nc: NATS) -> None:
    # The engine follows a change by making a partition's consumers, which a
    # loaded cluster can take seconds over: the replica must not go silent
    # meanwhile, or the others take its partitions while it still consumes.
    (a,) = await replicas(nc, "a")
    held = asyncio.Event()
    go_on = asyncio.Event()

    async def slow(now: frozenset[int]) -> None:
        if len(now) < P:  # the give-up to the newcomer
            held.set()
            await go_on.wait()

    a.on_change(slow)
    (b,) = await replicas(nc, "b")
    try:
        await wait_for(held.is_set, message="a following its give-up")
        # Three leases with a's settle held: b keeps hearing a.
        with pytest.raises(AssertionError):
            await wait_for(lambda: len(b.owned()) > P // 2, timeout=3.0)
        go_on.set()
        await wait_for(lambda: split(a, b) == [3, 3], message="a 3/3 split")
    finally:
        go_on.set()
        await a.stop()
        await b.stop()


async def test_release_hands_over_well_under_the_lease(nc: NATS) -> None:
    a, b = await replicas(nc, "a", "b", lease=30.0)
    changes: list[frozenset[int]] = []
    a.on_change(changes.append)
    try:
        await wait_for(lambda: split(a, b) == [3, 3], message="a 3/3 split")
        await b.release()
        assert b.owned() == frozenset()
        # Well under the 30 s lease: nothing waited for it to run out.
        await wait_for(lambda: split(a) == [P], timeout=10, message="a owns all")
        assert changes[-1] == frozenset(range(P))
    finally:
        await a.stop()
        await b.stop()


async def test_a_stopping_server_whose_hand_over_fails_still_ends_its_calls_as_unavailable(
    nats_server: NatsServer, nc: NATS
) -> None:
    """The gRPC server stops whatever the release meets: its open calls end
    as its stop ends them (UNAVAILABLE after the grace), not left open until
    the process's exit cuts them off."""
    server = await engine_replica(nats_server, "failing")

    async def hand_over_fails() -> None:
        raise RuntimeError("the hand-over failed")

    server.ownership.release = hand_over_fails  # type: ignore[method-assign]
    async with grpc.aio.insecure_channel(server.target) as channel:
        poll = pb_grpc.EngineServiceStub(channel).PollTasks(
            pb.PollTasksRequest(task_types=["t"], wait=Duration(seconds=20))
        )
        await wait_for(lambda: server.pulls.polls_waiting == 1, message="the poll waiting")
        with pytest.raises(RuntimeError, match="the hand-over failed"):
            await server.stop()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await poll
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_calls_that_meet_a_replicas_stop_go_on_at_the_other_one(
    nats_server: NatsServer, nc: NATS
) -> None:
    """A stopping gRPC server ends a call it accepted but had not begun with
    CANCELLED (several a stop, with callers busy): the client tries it again
    as after UNAVAILABLE, so a replica stopping costs its callers nothing."""
    running = [await engine_replica(nats_server, rid) for rid in ("first", "second")]
    failed: list[BaseException] = []
    answered = 0
    done = asyncio.Event()

    async def call_on(client: Client) -> None:
        nonlocal answered
        while not done.is_set():
            try:
                await client.list_runs(limit=1)
                answered += 1
            except Exception as err:
                failed.append(err)

    # One address after the other: every call goes to the first while it serves.
    target = "ipv4:" + ",".join(s.target for s in running)
    try:
        async with Client(target) as client:
            callers = [asyncio.create_task(call_on(client)) for _ in range(20)]
            await wait_for(lambda: answered >= 200, message="calls answered")
            await running.pop(0).stop()
            after = answered
            await wait_for(lambda: answered >= after + 200, message="calls after the stop")
            done.set()
            await asyncio.gather(*callers)
        assert failed == []
    finally:
        done.set()
        for server in running:
            await server.stop()


async def test_a_stopped_engine_server_hands_its_partitions_over_at_once(
    nats_server: NatsServer, nc: NATS
) -> None:
    """The serve CLI's SIGTERM path (``EngineServer.stop``) releases first."""
    servers = [await engine_replica(nats_server, rid) for rid in ("one", "two")]
    one, two = (s.ownership for s in servers)
    assert servers[0].engine.ownership is one
    try:
        await wait_for(lambda: [len(one.owned()), len(two.owned())] == [1, 1])
        await servers[0].stop()
        # Well under the 30 s lease.
        await wait_for(lambda: two.owned() == {0, 1}, timeout=10, message="two owns both")
    finally:
        for server in servers:
            await server.stop()


async def test_a_replica_cut_off_from_nats_stops_owning_after_its_lease(
    nats_server: NatsServer, nc: NATS
) -> None:
    own_nc = await jsx.connect(nats_server.url, name="test-ownership-cut-off")
    (a,) = await replicas(own_nc, "a")
    try:
        await wait_for(lambda: split(a) == [P], message="a owns all")
        await own_nc.close()  # renewals fail from now on
        await wait_for(lambda: a.owned() == frozenset(), timeout=10, message="a gives up")
    finally:
        await a.stop()


async def test_owns_run_is_the_runs_partition(nc: NATS) -> None:
    (a,) = await replicas(nc, "a")
    try:
        await wait_for(lambda: split(a) == [P])
        assert a.owns_run("0123456789abcdef0123456789abcdef")
        whole = Ownership.whole(4)
        assert whole.owned() == frozenset(range(4)) and whole.owns_run("x" * 32)
    finally:
        await a.stop()


async def test_partitions_recorded_once_and_a_different_number_refused(
    nats_server: NatsServer, nc: NATS
) -> None:
    js = nc.jetstream()
    assert await jsx.record_partitions(js, 6) == 6
    assert await jsx.record_partitions(js, None) == 6  # a later process reads it
    assert await jsx.record_partitions(js, 6) == 6
    with pytest.raises(InvalidArgument) as caught:
        await start_services(
            nats_server.url, services=["engine"], replica=ReplicaConfig(partitions=4)
        )
    assert "DAGNATS_PARTITIONS is 4" in caught.value.message
    assert "6 partitions" in caught.value.message


async def test_two_first_provisionings_at_once_record_one_number(nc: NATS) -> None:
    js = nc.jetstream()
    four, six = await asyncio.gather(
        jsx.record_partitions(js, 4), jsx.record_partitions(js, 6), return_exceptions=True
    )
    recorded = await jsx.record_partitions(js, None)
    assert recorded in (4, 6)
    # The one that lost the race with a different number refuses; the winner got its own.
    winner, loser = (four, six) if recorded == 4 else (six, four)
    assert winner == recorded
    assert isinstance(loser, InvalidArgument)


async def test_serve_refuses_a_different_number_of_partitions_in_one_line(
    nats_server: NatsServer, nc: NATS
) -> None:
    assert await jsx.record_partitions(nc.jetstream(), 6) == 6
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "dagnats.cli.main", "serve", "engine", "--nats", nats_server.url),
        *("--port", "0", "--partitions", "4"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, (out, err)
    assert err.decode().strip().splitlines() == [
        "error: DAGNATS_PARTITIONS is 4 but this deployment has 6 partitions, "
        "fixed when it was provisioned"
    ]
    assert await jsx.record_partitions(nc.jetstream(), None) == 6  # unchanged


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("DAGNATS_PARTITIONS", "0", "from 1 to 64"),
        ("DAGNATS_PARTITIONS", "65", "from 1 to 64"),
        ("DAGNATS_PARTITIONS", "many", "whole number"),
        ("DAGNATS_PARTITION_LEASE", "0.5", "at least 1"),
        ("DAGNATS_PARTITION_LEASE", "2.5", "whole number"),
        ("DAGNATS_PARTITION_LEASE", "soon", "positive number"),
        ("DAGNATS_REPLICA_ID", "a.b", "DAGNATS_REPLICA_ID must be"),
        ("DAGNATS_REPLICA_ID", "*", "DAGNATS_REPLICA_ID must be"),
    ],
)
def test_bad_replica_settings_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, says: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument) as caught:
        ReplicaConfig.from_env()
    assert caught.value.field == name
    assert says in caught.value.message


def test_replica_settings_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ReplicaConfig.from_env().partitions is None  # unset: the recorded number
    monkeypatch.setenv("DAGNATS_PARTITIONS", "8")
    monkeypatch.setenv("DAGNATS_PARTITION_LEASE", "3")
    monkeypatch.setenv("DAGNATS_REPLICA_ID", "engine-1")
    config = ReplicaConfig.from_env()
    assert (config.partitions, config.lease, config.replica_id) == (8, 3.0, "engine-1")
    assert ReplicaConfig.from_env(partitions=2).partitions == 2  # a flag over the variable
    with pytest.raises(InvalidArgument, match="from 1 to 64, not 0"):
        ReplicaConfig.from_env(partitions=0)  # a flag is checked as the variable is
