"""A real nats-server from the venv: start, JetStream, durability settings, restart, cluster."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from dagnats.core.jetstream import publish
from dagnats.core.natsserver import (
    NatsCluster,
    NatsServer,
    NatsServerError,
    check_sync_always,
    free_port,
    server_binary,
)
from tests.helpers import created


@asynccontextmanager
async def connected(servers: str | list[str]) -> AsyncIterator[Client]:
    nc = await nats.connect(servers, max_reconnect_attempts=0)
    try:
        yield nc
    finally:
        await nc.close()


def test_server_binary_is_the_venv_one() -> None:
    path = Path(server_binary())
    assert path.name == "nats-server"
    assert os.access(path, os.X_OK)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


async def test_jetstream_stores_and_returns_a_message(nats_server: NatsServer) -> None:
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        await js.add_stream(name="SINGLE", subjects=["single.>"])
        ack = await js.publish("single.a", b"hello")
        msg = await js.get_msg("SINGLE", ack.seq)
    assert (msg.subject, msg.data) == ("single.a", b"hello")


async def test_varz_reports_sync_always(nats_server: NatsServer) -> None:
    varz = await nats_server.varz()
    assert varz["jetstream"]["config"]["sync_always"] is True
    assert varz["max_payload"] == 8 * 1024 * 1024
    assert await check_sync_always(nats_server.monitor_url) is True


async def test_sync_always_can_be_turned_off(tmp_path: Path) -> None:
    server = await NatsServer.start(tmp_path, sync_always=False)
    try:
        assert await check_sync_always(server.monitor_url) is False
    finally:
        await server.stop()


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "kill"])
async def test_restart_keeps_stored_messages(tmp_path: Path, crash: bool) -> None:
    server = await NatsServer.start(tmp_path)
    try:
        async with connected(server.url) as nc:
            js = nc.jetstream()
            await js.add_stream(name="DURABLE", subjects=["durable.>"])
            ack = await js.publish("durable.a", b"kept")
        old_pid, port = server.pid, server.port
        if crash:
            server.kill()
        await server.restart()
        assert server.pid != old_pid
        assert server.port == port
        async with connected(server.url) as nc:
            msg = await nc.jetstream().get_msg("DURABLE", ack.seq)
        assert msg.data == b"kept"
    finally:
        await server.stop()


async def test_start_fails_clearly_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(NatsServerError, match="exited") as failure:
            await NatsServer.start(tmp_path, port=port)
    assert "address already in use" in str(failure.value)


async def test_cluster_replicates_an_r3_stream(nats_cluster: NatsCluster) -> None:
    assert len(nats_cluster.servers) == 3
    assert nats_cluster.url == ",".join(nats_cluster.urls)
    assert all([await check_sync_always(s.monitor_url) for s in nats_cluster.servers])
    async with connected(nats_cluster.urls) as nc:
        js = nc.jetstream()
        # A cluster still forming may not answer a create in time: sent again,
        # as the services' provisioning does.
        info = await created(
            lambda: js.add_stream(name="R3", subjects=["r3.>"], num_replicas=3), "R3"
        )
        # A new R3 stream may still be electing its leader: publish as the
        # services do, retrying by time with the same Msg-Id.
        seq = await publish(js, "r3.a", b"replicated", msg_id="r3-a")
        msg = await js.get_msg("R3", seq)
    assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    assert msg.data == b"replicated"


async def test_cluster_member_restarts_after_a_crash(nats_cluster: NatsCluster) -> None:
    leader = await nats_cluster.wait_for_meta_leader()
    follower = next(i for i, s in enumerate(nats_cluster.servers) if s.config.server_name != leader)
    nats_cluster.kill(follower)
    await nats_cluster.restart(follower)
    async with connected(nats_cluster.servers[follower].url) as nc:
        js = nc.jetstream()
        await js.add_stream(name="AFTER", subjects=["after.>"], num_replicas=3)
        seq = await publish(js, "after.a", b"ok", msg_id="after-a")
        assert (await js.get_msg("AFTER", seq)).data == b"ok"


async def test_engine_warns_when_the_server_does_not_fsync_every_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dagnats.engine.server import start_engine
    from tests.stack import FAST

    server = await NatsServer.start(tmp_path / "lazy", sync_always=False)
    try:
        with caplog.at_level(logging.WARNING, logger="dagnats.engine.server"):
            engine = await start_engine(server.url, config=FAST, monitor_url=server.monitor_url)
            await engine.stop()
    finally:
        await server.stop()
    assert any("sync_interval: always" in r.getMessage() for r in caplog.records)
