"""No request dropped under load: the gateway keeps an idle connection longer
than a client keeps it for reuse, and its keep-alive timer never closes a
connection that a request has reached (ADR 57)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from dagnats.core.errors import InvalidArgument
from dagnats.engine.server import EngineServer
from dagnats.gateway import GatewayConfig, GatewayServer, start_gateway
from dagnats.sdk import Client
from tests.test_inputs import running_step

# How long httpx's default pool keeps an idle connection for reuse.
HTTPX_KEEPALIVE_EXPIRY = 5.0


async def test_two_rounds_of_200_submits_over_one_pool_get_400_answers(
    gateway: GatewayServer, client: Client
) -> None:
    """The second round goes out when the pool's kept connections are as old as
    httpx lets them get: a gateway that closed idle connections as early
    (uvicorn's 5 s) reset some of them under the requests sent over them."""
    run_id = await running_step(client)
    path = f"/runs/{run_id}/steps/agent/inputs"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:

        async def submit(n: int) -> Any:
            body = {"request_id": f"r-{n}", "mode": "follow_up", "content": {"n": n}}
            try:
                return (await http.post(path, json=body)).status_code
            except httpx.TransportError as err:
                return repr(err)

        first = Counter(await asyncio.gather(*(submit(n) for n in range(200))))
        assert first == {201: 200}
        # The idle time is the scenario, not a wait for something to happen.
        await asyncio.sleep(HTTPX_KEEPALIVE_EXPIRY - 0.1)
        again = Counter(await asyncio.gather(*(submit(n) for n in range(200))))
        assert again == {200: 200}, "requests lost on kept-alive connections"


async def test_a_request_that_reached_the_gateway_as_its_keep_alive_ends_is_answered(
    engine: EngineServer,
) -> None:
    """The keep-alive timer fires in a loop iteration busy past its time, and a
    request arrives after that iteration's poll: the request is answered, the
    connection not reset under it."""
    config = GatewayConfig(engine_target=engine.target, port=0, keep_alive=1)
    gateway = await start_gateway(config)
    loop = asyncio.get_running_loop()
    host, _, port = gateway.url.removeprefix("http://").rpartition(":")
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.setblocking(False)
            await loop.sock_sendall(sock, request)
            assert (await loop.sock_recv(sock, 65536)).startswith(b"HTTP/1.1 200")
            (connection,) = gateway._server.server_state.connections
            assert isinstance(connection, H11Protocol)
            timer = connection.timeout_keep_alive_task
            assert timer is not None, "the connection's keep-alive timer is not armed"
            await asyncio.sleep(timer.when() - loop.time() - 0.05)
            _hold_the_loop(until=timer.when() + 0.05, loop=loop)
            await asyncio.sleep(0)  # resumed in the iteration that runs the timer, before it
            sock.send(request)
            answer = await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout=10)
            assert answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        await gateway.stop()


def _hold_the_loop(*, until: float, loop: asyncio.AbstractEventLoop) -> None:
    """Keep the event loop busy until ``until`` (its clock), as a loop iteration
    that handles hundreds of requests does."""
    while loop.time() < until:
        time.sleep(0.001)


async def test_the_gateway_says_how_long_it_keeps_an_idle_connection(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (await http.get("/healthz")).headers["keep-alive"] == "timeout=120"
    with pytest.raises(InvalidArgument) as bad:
        GatewayConfig(engine_target="127.0.0.1:1", keep_alive=0)
    assert bad.value.field == "keep_alive"
    monkeypatch.setenv("DAGNATS_GATEWAY_KEEP_ALIVE", "forever")
    with pytest.raises(InvalidArgument) as bad_variable:
        GatewayConfig.from_env("127.0.0.1:1", host="127.0.0.1", port=0)
    assert bad_variable.value.field == "DAGNATS_GATEWAY_KEEP_ALIVE"
