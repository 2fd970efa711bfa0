"""Serving the gateway with uvicorn inside the caller's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dagnats.core.credentials import keep_credentials_out_of_logs
from dagnats.core.errors import InvalidArgument, Unavailable
from dagnats.core.settings import host_port, is_loopback
from dagnats.gateway.app import create_app
from dagnats.gateway.config import GatewayConfig

log = logging.getLogger("dagnats.gateway")

# How long a stop waits for open requests (event streams included) before
# cancelling them.
GRACE_SECONDS = 1
STARTUP_SECONDS = 10.0


class _Http11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, whose keep-alive timer does not close a
    connection that a request has reached.

    The timer runs after the poll of its loop iteration; on a loop busy with
    many requests a request can arrive between that poll and the timer.
    Closing a socket with unread bytes resets the connection: the client loses
    its request with no answer (``httpx.ReadError``) and nothing is logged.
    With bytes waiting the connection stays, its request is read in the next
    iteration, and the timer is armed again in case they were only the
    client's end of the connection.
    """

    def timeout_keep_alive_handler(self) -> None:
        if _bytes_waiting(self.transport):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()


def _bytes_waiting(transport: asyncio.Transport) -> bool:
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return False
    poll = select.poll()  # not select(): descriptors above 1023 are common here
    poll.register(sock.fileno(), select.POLLIN)
    return bool(poll.poll(0))


class _Server(uvicorn.Server):
    # The process that embeds the gateway owns its signals (``dagnats dev``
    # stops everything on Ctrl-C), so uvicorn installs no handlers.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(slots=True)
class GatewayServer:
    """A running gateway; ``url`` is where it listens."""

    url: str
    _server: _Server
    _task: asyncio.Task[None]

    async def stop(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def start_gateway(config: GatewayConfig) -> GatewayServer:
    """Bind, start serving, and return once the gateway answers.

    Raises:
        InvalidArgument: a non-loopback address without both tokens.
        Unavailable: the gateway did not start.
    """
    keep_credentials_out_of_logs()
    open_parts = config.open_endpoints
    if open_parts and not is_loopback(config.host):
        raise InvalidArgument(
            f"refusing to serve {' and '.join(open_parts)} without a token on {config.host}: "
            "set DAGNATS_API_TOKEN and DAGNATS_BRIDGE_TOKEN, or bind to 127.0.0.1",
            field="host",
        )
    if open_parts:
        log.warning(
            "%s accept requests without a token; serving on loopback only",
            " and ".join(open_parts),
        )
    if config.tls_cert is None and not is_loopback(config.host):
        log.warning(
            "serving plain HTTP on %s: tokens travel in the clear; set "
            "DAGNATS_GATEWAY_TLS_CERT and DAGNATS_GATEWAY_TLS_KEY, or end TLS in front of it",
            config.host,
        )
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    keep_alive = math.ceil(config.keep_alive)
    uv_config = uvicorn.Config(
        create_app(config),
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=GRACE_SECONDS,
        http=_Http11,
        timeout_keep_alive=keep_alive,
        # Clients that read it (Node's fetch) give a connection up before then.
        headers=[("keep-alive", f"timeout={keep_alive}")],
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
    )
    try:
        uv_config.load()  # reads the certificate and key: refuse a bad pair here
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
        sock.close()
        raise InvalidArgument(
            f"DAGNATS_GATEWAY_TLS_CERT/KEY: cannot serve TLS with them: {err}",
            field="DAGNATS_GATEWAY_TLS_CERT",
        ) from None
    server = _Server(uv_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="dagnats-gateway")
    deadline = asyncio.get_running_loop().time() + STARTUP_SECONDS
    while not server.started:  # uvicorn offers no event for "started"; poll its flag
        if task.done() or asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await task
            raise Unavailable(f"the gateway did not start on {host}:{port}")
        await asyncio.sleep(0.01)
    scheme = "https" if config.tls_cert is not None else "http"
    return GatewayServer(url=f"{scheme}://{host_port(host, port)}", _server=server, _task=task)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    # only on connections whose socket says so, and an accepted socket takes
    # the listener's protocol. With proto 0 a response's body waited behind
    # its headers for the client's delayed ACK, 40 ms on every request of a
    # kept-alive connection after its first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise Unavailable(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock
