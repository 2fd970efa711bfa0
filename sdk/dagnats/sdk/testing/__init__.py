"""Helpers for testing handlers: a real local stack, and a scripted model.

``LocalStack`` starts nats-server (a temporary store, a free port,
``sync_interval: always``), the engine on a free port and, if asked, the HTTP
gateway, all on loopback and open, and stops them at the end::

    async with LocalStack() as stack:
        output = await stack.run(handler, {"question": "hi"})

It needs the ``server`` extra (``pip install 'dagnats[server]'``).

``ScriptedModel`` stands in for a model client: it answers each request with
the next response of a script and remembers every request, so a test can tell
a response replayed from the journal (no new request) from a new model call.

``replay`` runs new handler code against recorded journals (``dagnats journal
export`` files, or a deployment's runs) without calling any model or tool,
and reports each call or commit that differs from the recording::

    report = await replay("exports/", {"agent": new_handler})
    assert report.ok, "\n".join(report.lines())
"""

from __future__ import annotations

import copy
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from dagnats.sdk._client import Client
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._worker import Handler, Worker
from dagnats.sdk.testing._recorded import Divergence
from dagnats.sdk.testing._replay import Deployment, ReplayReport, replay

if TYPE_CHECKING:
    from dagnats.core.natsserver import NatsServer
    from dagnats.engine.config import EngineConfig
    from dagnats.engine.server import EngineServer
    from dagnats.engine.v1 import engine_pb2 as pb
    from dagnats.gateway import GatewayConfig, GatewayServer

__all__ = [
    "Deployment",
    "Divergence",
    "LocalStack",
    "ReplayReport",
    "ScriptExhausted",
    "ScriptedModel",
    "replay",
]

T = TypeVar("T")

# The stack listens on loopback in plaintext and takes calls without a token.
OPEN = Credentials()


class LocalStack:
    """nats-server, the engine and optionally the gateway, on this machine.

    Use it as ``async with LocalStack() as stack:``; everything it started
    stops at the end, and a temporary store is removed.

    Args:
        gateway: Start the HTTP gateway too (:attr:`gateway_url`).
        store_dir: nats-server's JetStream store; by default a temporary
            directory, removed at the end. A store kept between stacks keeps
            its runs.
        nats_port: nats-server's client port; 0 picks a free one.
        engine_port: The engine's gRPC port; 0 picks a free one.
        gateway_port: The gateway's HTTP port; 0 picks a free one.
        engine_config: The engine's settings; by default from the environment.
        local_socket: Also take the journal's calls, polls and watches on a
            Unix socket at this path; :meth:`worker` puts its workers'
            journal calls there.

    Raises:
        MissingExtra: (an ``ImportError``, on entering) the ``server`` extra
            is not installed; the message says how to install it.
    """

    def __init__(
        self,
        *,
        gateway: bool = False,
        store_dir: Path | str | None = None,
        nats_port: int = 0,
        engine_port: int = 0,
        gateway_port: int = 0,
        engine_config: EngineConfig | None = None,
        local_socket: Path | None = None,
    ) -> None:
        self._want_gateway = gateway
        self._store_dir = Path(store_dir) if store_dir is not None else None
        self._nats_port = nats_port
        self._engine_port = engine_port
        self._gateway_port = gateway_port
        self._engine_config = engine_config
        self._local_socket = local_socket
        self._temp: Path | None = None
        self._nats: NatsServer | None = None
        self._engine: EngineServer | None = None
        self._gateway: GatewayServer | None = None
        self._client: Client | None = None

    @property
    def nats(self) -> NatsServer:
        """The running nats-server (``.url``, ``.monitor_url``)."""
        return _started(self._nats)

    @property
    def engine(self) -> EngineServer:
        """The running engine, with the journal and inputs services."""
        return _started(self._engine)

    @property
    def target(self) -> str:
        """The engine's gRPC address, ``host:port``, for a ``Worker`` or ``Client``."""
        return self.engine.target

    @property
    def client(self) -> Client:
        """A client of the engine, closed at the end."""
        return _started(self._client)

    @property
    def gateway(self) -> GatewayServer:
        """The running gateway; started by ``gateway=True`` or :meth:`start_gateway`."""
        return _started(self._gateway, "no gateway: LocalStack(gateway=True) starts one")

    @property
    def gateway_url(self) -> str:
        """The gateway's base URL, ``http://127.0.0.1:port``."""
        return self.gateway.url

    async def __aenter__(self) -> Self:
        return await self.start()

    async def start(self) -> Self:
        """Start everything (``async with`` does); :meth:`stop` stops it.

        Raises:
            MissingExtra: the ``server`` extra is not installed.
            NatsServerError: nats-server is missing or did not start.
        """
        from dagnats.core.extras import require_server

        require_server("LocalStack")
        from dagnats.core.natsauth import NatsSettings
        from dagnats.core.natsserver import NatsServer
        from dagnats.engine.server import start_engine

        if self._store_dir is None:
            self._temp = Path(tempfile.mkdtemp(prefix="dagnats-stack-"))
        store = self._store_dir or self._temp
        assert store is not None
        try:
            self._nats = await NatsServer.start(store, port=self._nats_port)
            # Its own server on loopback, open: NATS settings meant for a
            # deployment in the shell do not apply to it.
            self._engine = await start_engine(
                self._nats.url,
                port=self._engine_port,
                config=self._engine_config,
                monitor_url=self._nats.monitor_url,
                nats_settings=NatsSettings(),
                local_socket=self._local_socket,
            )
            if self._want_gateway:
                await self.start_gateway()
            self._client = Client(self._engine.target, credentials=OPEN)
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start_gateway(self, config: GatewayConfig | None = None) -> GatewayServer:
        """Start the gateway in front of the engine (stopped with the stack).

        Args:
            config: Its settings; by default on loopback, open, on the
                ``gateway_port`` given.
        """
        from dagnats.gateway import GatewayConfig, start_gateway

        if self._gateway is not None:
            raise RuntimeError("the gateway is running already")
        if config is None:
            config = GatewayConfig(
                engine_target=self.target,
                host="127.0.0.1",
                port=self._gateway_port,
                client_credentials=OPEN,
                worker_credentials=OPEN,
            )
        self._gateway = await start_gateway(config)
        return self._gateway

    async def stop(self) -> None:
        """Stop what was started, the last started first; remove a temporary store."""
        client, self._client = self._client, None
        gateway, self._gateway = self._gateway, None
        engine, self._engine = self._engine, None
        nats, self._nats = self._nats, None
        try:
            if client is not None:
                await client.close()
            if gateway is not None:
                await gateway.stop()
            if engine is not None:
                await engine.stop()
        finally:
            if nats is not None:
                await nats.stop()
            if self._temp is not None:
                shutil.rmtree(self._temp, ignore_errors=True)
                self._temp = None

    def worker(self, handlers: Mapping[str, Handler], **options: Any) -> Worker:
        """A worker of this engine for ``handlers`` (task type -> handler), to
        use as ``async with stack.worker({...}):``; ``options`` go to ``Worker``.
        Its journal calls find the stack's local socket when it has one."""
        return Worker(self.target, handlers=handlers, credentials=OPEN, **options)

    async def register(self, workflow: str | Mapping[str, Any]) -> pb.Workflow:
        """Register a workflow (YAML or JSON text, or a mapping); the stored definition."""
        return await self.client.register_workflow(workflow)

    async def run(
        self,
        handler: Handler,
        input: Any = None,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109 - the run's, passed to Client.run
        max_iterations: int = 20,
        max_duration: str = "5m",
    ) -> Any:
        """Run ``handler`` as the one ``agent_loop`` step of a new workflow,
        with a worker of its own, and return the run's output.

        Args:
            handler: ``async def handler(tc)``, e.g. ``durable_agent(agent)``.
            input: The run's input (JSON-serialisable).
            timeout: Seconds to wait for the run to finish.
            max_iterations: The step's ``agent_loop.max_iterations``.
            max_duration: The step's ``agent_loop.max_duration``.

        Returns:
            The output of the completed run, JSON-decoded.

        Raises:
            RunFailed: the run failed or was cancelled; it carries the run.
            DeadlineExceeded: the run had not finished after ``timeout`` seconds.
        """
        name = f"local-{secrets.token_hex(6)}"
        await self.register(
            {
                "name": name,
                "steps": [
                    {
                        "id": "agent",
                        "type": "agent_loop",
                        "task": name,
                        "agent_loop": {
                            "max_iterations": max_iterations,
                            "max_duration": max_duration,
                        },
                    }
                ],
            }
        )
        async with self.worker({name: handler}, poll_wait=1.0):
            return await self.client.run(name, input, timeout=timeout)


def _started(value: T | None, missing: str = "the stack is not running") -> T:
    if value is None:
        raise RuntimeError(missing)
    return value


class ScriptExhausted(AssertionError):
    """The scripted model got more requests than it has responses.

    Attributes:
        request: The request that found no response.
        calls: Requests received, this one included.
    """

    def __init__(self, request: Any, calls: int, responses: int | None = None) -> None:
        scripted = calls - 1 if responses is None else responses
        super().__init__(
            f"scripted model has {scripted} response(s) but got request {calls}: {request!r}"
        )
        self.request = request
        self.calls = calls


class ScriptedModel:
    """An async model that answers with scripted responses, in order.

    ``await model(request)`` records a copy of ``request`` in :attr:`requests`
    and returns a deep copy of the next response, so a handler that mutates a
    response cannot change the script. A response that is an exception
    instance is raised instead, to script a failed model call.

    Args:
        responses: The answers, one per expected request.

    Attributes:
        requests: Every request received, in order (copied when received).
    """

    def __init__(self, responses: Sequence[Any]) -> None:
        self._responses = list(responses)
        self.requests: list[Any] = []

    @property
    def calls(self) -> int:
        """Requests received so far."""
        return len(self.requests)

    @property
    def remaining(self) -> int:
        """Scripted responses not yet used."""
        return max(len(self._responses) - self.calls, 0)

    async def __call__(self, request: Any) -> Any:
        """Answer ``request`` with the next scripted response.

        Raises:
            ScriptExhausted: every scripted response was already used.
            BaseException: the scripted response, when it is an exception.
        """
        self.requests.append(copy.deepcopy(request))
        index = self.calls - 1
        if index >= len(self._responses):
            raise ScriptExhausted(request, self.calls, len(self._responses))
        response = self._responses[index]
        if isinstance(response, BaseException):
            raise response
        return copy.deepcopy(response)
