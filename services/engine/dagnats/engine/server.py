"""The server process: any of the three services on one gRPC port.

The engine, the journal and the inputs services each run alone or together
(``dagnats serve engine|journal|inputs|all``). Each process connects to NATS
once, provisions every stream and bucket (an idempotent update, so the first
process of a deployment creates them), serves its services' gRPC methods with
health and reflection, and stops them in order. What each one needs:

- engine: the history, timer and reconciler loops and the ``EngineService``;
  it reads the journal (a report or a heartbeat is checked against it) and
  closes a finished step's inputs, through the journal's and the inputs'
  stores.
- journal: the ``JournalService``; it reads runs (a claim of iteration 0
  checks that the run has not ended) and settles the tasks of the commits it
  answered through the engine's outcome publishing, and places inputs
  through the inputs' store.
- inputs: the ``InputsService`` and the ``api.inputs.*`` NATS endpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import nats.errors
from grpc_health.v1 import _async as health_aio  # health.aio, the asyncio servicer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from dagnats.core import jetstream as jsx
from dagnats.core import tracing
from dagnats.core.credentials import keep_credentials_out_of_logs
from dagnats.core.errors import InvalidArgument
from dagnats.core.natsauth import NatsSettings
from dagnats.core.natsserver import check_sync_always
from dagnats.core.settings import SERVICES, host_port, is_loopback
from dagnats.engine import local_transport
from dagnats.engine.access import Role, missing_for_open_host, tokens_of
from dagnats.engine.cancels import CancelWatch
from dagnats.engine.config import EngineConfig, ReplicaConfig
from dagnats.engine.local_transport import LocalListener, LocalSession, Method
from dagnats.engine.open_pulls import OpenPulls
from dagnats.engine.ownership import Ownership
from dagnats.engine.processor import Engine
from dagnats.engine.report import TaskSettler
from dagnats.engine.run_feed import RunFeed
from dagnats.engine.runs import Runs
from dagnats.engine.security import ServerSecurity
from dagnats.engine.service import EngineServicer
from dagnats.engine.store import EngineStore
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.watch import RunWatches
from dagnats.inputs.natsapi import serve_nats_api
from dagnats.inputs.service import Inputs, InputsServicer
from dagnats.inputs.store import InputStore
from dagnats.inputs.v1 import inputs_pb2 as inputs_pb
from dagnats.inputs.v1 import inputs_pb2_grpc as inputs_grpc
from dagnats.journal.service import JournalServicer
from dagnats.journal.store import JournalStore
from dagnats.journal.v1 import journal_pb2 as journal_pb
from dagnats.journal.v1 import journal_pb2_grpc as journal_grpc

log = logging.getLogger(__name__)

_NAMES = {
    "engine": pb.DESCRIPTOR.services_by_name["EngineService"].full_name,
    "journal": journal_pb.DESCRIPTOR.services_by_name["JournalService"].full_name,
    "inputs": inputs_pb.DESCRIPTOR.services_by_name["InputsService"].full_name,
}


@dataclass(frozen=True, slots=True)
class OwnPort:
    """Where this process's own clients (the handlers it runs in the process) dial
    it, in plaintext on loopback, and the worker token minted for them when
    the server needs credentials (None when it does not)."""

    target: str
    token: str | None


@dataclass(kw_only=True)
class ServiceServer:
    """A running server of some of the services; ``target`` is what clients dial."""

    server: grpc.aio.Server
    nc: NATS
    host: str
    port: int
    services: tuple[str, ...]
    # The api.inputs.* endpoints; stop() ends them with nc.drain().
    subscriptions: list[Subscription] = field(default_factory=list)
    journal: JournalServicer | None = None
    health: health_aio.HealthServicer | None = None
    own: OwnPort | None = None
    local_socket: LocalListener | None = None
    # What the local socket, and the handlers run in this process, may call.
    local_methods: dict[str, Method] = field(default_factory=dict)

    def local_session(self) -> LocalSession:
        """A journal session answered in this process by the method table,
        for the handlers the services run."""
        return LocalSession(self.local_methods)

    @property
    def target(self) -> str:
        return host_port(self.host, self.port)

    async def stop(self, grace: float = 1.0) -> None:
        if self.health is not None:
            await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING
        await self.server.stop(grace)
        if self.local_socket is not None:
            await self.local_socket.close()
        await self._stop_work()
        if self.journal is not None:
            await self.journal.close()  # the settles of commits it answered
        try:
            await self.nc.drain()
        except nats.errors.Error:  # the server went first: nothing left to drain
            await self.nc.close()

    async def _stop_work(self) -> None:
        """Stop what runs besides the gRPC methods (the engine's loops)."""


@dataclass(kw_only=True)
class EngineServer(ServiceServer):
    """A running server of the engine, alone or with the other services."""

    engine: Engine
    watches: RunWatches
    feed: RunFeed
    cancels: CancelWatch
    pulls: OpenPulls
    ownership: Ownership

    async def stop(self, grace: float = 1.0) -> None:
        # Its partitions first, so the other replicas take them over at once
        # rather than after the partition lease; the gRPC server stops
        # whatever the hand-over met, so the calls under way finish within
        # its grace rather than being cut off by the process's exit.
        try:
            await self.ownership.release()
        finally:
            await super().stop(grace)

    async def _stop_work(self) -> None:
        await self.cancels.close()  # the cancels that polls watch for
        await self.pulls.close()  # the task pulls that polls wait on
        await self.watches.close()  # the run watches of WatchRun calls
        await self.feed.close()  # the runs watch of WatchRuns calls
        await self.engine.stop()


# Requests up to 16 MiB reach the services, so a journal record over its
# maximum is refused with the error's code rather than by gRPC's 4 MiB cap.
# Clients ping a silent connection that has calls open (``DAGNATS_GRPC_KEEPALIVE``,
# 20 s by default, down to a tenth of a second in tests); the server answers
# every ping rather than closing the connection of a client that pings more
# often than gRPC's default of once in five minutes.
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
)


async def start_engine(
    nats_url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: EngineConfig | None = None,
    topology: jsx.Topology | None = None,
    with_journal: bool = True,
    with_inputs: bool = True,
    monitor_url: str | None = None,
    security: ServerSecurity | None = None,
    nats_settings: NatsSettings | None = None,
    local_socket: Path | None = None,
    replica: ReplicaConfig | None = None,
) -> EngineServer:
    """Serve the engine, and by default the journal and inputs services with
    it on the same port (``dagnats serve all``); see :func:`start_services`.

    Args:
        with_journal: serve the journal service on the same port.
        with_inputs: serve the inputs service on the same port and as the
            NATS endpoints ``api.inputs.*``.
    """
    served = [
        "engine",
        *(["journal"] if with_journal else []),
        *(["inputs"] if with_inputs else []),
    ]
    server = await start_services(
        nats_url,
        services=served,
        host=host,
        port=port,
        config=config,
        topology=topology,
        monitor_url=monitor_url,
        security=security,
        nats_settings=nats_settings,
        local_socket=local_socket,
        replica=replica,
    )
    assert isinstance(server, EngineServer)
    return server


async def start_services(
    nats_url: str,
    *,
    services: Collection[str] = SERVICES,
    host: str = "127.0.0.1",
    port: int = 0,
    config: EngineConfig | None = None,
    topology: jsx.Topology | None = None,
    monitor_url: str | None = None,
    security: ServerSecurity | None = None,
    nats_settings: NatsSettings | None = None,
    own_port: bool = False,
    local_socket: Path | None = None,
    ownership: Ownership | None = None,
    replica: ReplicaConfig | None = None,
) -> ServiceServer:
    """Connect, provision streams and buckets, and serve ``services`` on one port.

    Args:
        nats_url: one or more comma-separated NATS URLs.
        services: which of ``engine``, ``journal`` and ``inputs`` to serve.
        host: interface to bind.
        port: port to bind; 0 picks a free one.
        config: engine settings; defaults from the environment.
        topology: stream replication.
        monitor_url: nats-server's monitoring address; when given, the server
            warns at start-up unless nats-server fsyncs every write.
        security: TLS and the credentials every call needs; None serves
            plaintext to anyone, which only a loopback ``host`` allows.
        nats_settings: NATS credentials and TLS; by default the
            ``DAGNATS_NATS_*`` environment.
        own_port: where the server needs TLS or credentials, also serve on a
            loopback port for the process's own clients (``ServiceServer.own``),
            so that the handlers it runs need no certificate or token of the
            operator's: the port takes a worker token that exists only in this
            process's memory, and any other credential the server takes.
            Loopback only, so plaintext. An open server (loopback, plaintext,
            no credentials) is its own clients' port as it is.
        local_socket: with the journal, also take its Session calls, and the
            engine's PollTasks and WatchRun when it serves the engine, on a
            Unix socket at this path for clients on this host
            (``dagnats.engine.local_transport``); with the engine, each
            poll's and watch's answer names it.
        ownership: the partitions the engine consumes; by default every one.
        replica: the number of partitions, the partition lease and this
            replica's id; by default the ``DAGNATS_*`` environment. A process
            that serves the engine is a replica: it owns a share of the
            partitions (``dagnats.engine.ownership``).

    Returns:
        An :class:`EngineServer` when the engine is among ``services``.

    Raises:
        InvalidArgument: no service, or one that is not known; a non-loopback
            ``host`` without both TLS and authentication (naming the missing
            settings), settings that do not fit together, or unreadable
            certificate, key or tokens files; a NATS setting that is
            malformed, or refused by nats-server; a number of partitions
            that differs from the one the deployment was provisioned with.
    """
    served = tuple(s for s in SERVICES if s in services)
    unknown = set(services) - set(SERVICES)
    if unknown or not served:
        raise InvalidArgument(
            f"services must be some of {', '.join(SERVICES)}; got {sorted(services)}",
            field="services",
        )
    keep_credentials_out_of_logs()
    security = security or ServerSecurity()
    security.check()
    _refuse_open(host, security)
    if local_socket is not None:
        if "journal" not in served:
            raise InvalidArgument("a local socket needs the journal service", field="services")
        local_transport.check_path(local_socket)  # before anything starts
    own_token = secrets.token_urlsafe(32) if own_port and security.authenticated else None
    if own_token is not None:
        minted = tokens_of(Role.WORKER, [own_token])
        security = dataclasses.replace(security, tokens=security.tokens.merged(minted))
    credentials = security.server_credentials()  # files read before anything starts
    guard = security.interceptor()
    config = config or EngineConfig.from_env()
    replica = replica or ReplicaConfig.from_env()
    await _check_durability(monitor_url)
    # Named after its first service: dagnats-engine, -journal or -inputs in /connz.
    nc = await jsx.connect(nats_url, name=f"dagnats-{served[0]}", settings=nats_settings)
    await jsx.provision(nc.jetstream(), topology)
    try:
        partitions = await jsx.record_partitions(nc.jetstream(), replica.partitions)
    except InvalidArgument:
        await nc.close()
        raise
    interceptors = tracing.server_interceptors() + ([guard] if guard is not None else [])
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    engine_store = await EngineStore.open(nc)  # runs, history, tasks: every service reads them
    journal_store = JournalStore(nc)
    # The run now, caught up with the journal: what every service reads of a run.
    runs = Runs(engine_store, journal_store, options=config.rule_options())
    input_store = await InputStore.open(nc, runs, dedupe_window=config.input_dedupe_window)
    engine: Engine | None = None
    clock: Callable[[], float] = time.time
    if "engine" in served:
        if ownership is None:  # a given one (a test's fixed split) was started by its maker
            ownership = Ownership(
                nc,
                replica_id=replica.replica_id,
                partitions=partitions,
                lease=replica.lease,
            )
            await ownership.start()
        engine = Engine(
            engine_store,
            config,
            inputs=input_store,
            journal=journal_store,
            runs=runs,
            ownership=ownership,
        )
        await engine.start()
        clock = engine.clock
    journal: JournalServicer | None = None
    if "journal" in served:
        # The clock stamps the events of the commits it settles: the engine's when both run.
        # Its commits' events go to this process's engine, when it serves one:
        # the event by a call (ADR 36).
        tasks = TaskSettler(engine_store, clock, local=engine)
        journal = JournalServicer(journal_store, runs, input_store, tasks=tasks, clock=clock)
        journal_grpc.add_JournalServiceServicer_to_server(journal, server)
    subscriptions: list[Subscription] = []
    if "inputs" in served:
        inputs = Inputs(input_store)
        inputs_grpc.add_InputsServiceServicer_to_server(InputsServicer(inputs), server)
        subscriptions = await serve_nats_api(nc, inputs)
    servicer = None
    if engine is not None:
        # The claim with the lease (ADR 42).
        claims = journal.claim_with_lease if journal is not None else None
        servicer = EngineServicer(engine, journal_store, claims=claims, ownership=ownership)
        await servicer.cancels.start()  # the cancels its workers' polls watch for
        pb_grpc.add_EngineServiceServicer_to_server(servicer, server)
    served_health = await _add_health_and_reflection(server, [_NAMES[s] for s in served])
    address = host_port(host, port)
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    own = None
    if credentials is None and guard is None:  # open, so on loopback: its port is its own
        own = OwnPort(target=host_port(host, bound), token=None)
    elif own_port:
        own_bound = server.add_insecure_port("127.0.0.1:0")
        own = OwnPort(target=f"127.0.0.1:{own_bound}", token=own_token)
    sockets = None
    table = local_transport.methods(journal, servicer)
    if local_socket is not None and journal is not None:
        sockets = await LocalListener.start(local_socket, table, security.admission)
        path = local_transport.address(local_socket)
        if servicer is not None and path is not None:  # polls and watches name it
            servicer.local_socket = pb.LocalSocket(path=path, instance=sockets.instance)
    await server.start()
    log.info(
        "%s serving on %s:%d (%s, %s)",
        " and ".join(served),
        host,
        bound,
        "TLS" if credentials is not None else "plaintext",
        "credentials required" if guard is not None else "no credentials",
    )
    parts = ServiceServer(
        server=server,
        nc=nc,
        host=host,
        port=bound,
        services=served,
        subscriptions=subscriptions,
        journal=journal,
        health=served_health,
        own=own,
        local_socket=sockets,
        local_methods=table,
    )
    if engine is None or servicer is None or ownership is None:
        return parts
    return EngineServer(
        **vars(parts),
        ownership=ownership,
        engine=engine,
        watches=servicer.watches,
        feed=servicer.feed,
        cancels=servicer.cancels,
        pulls=servicer.pulls,
    )


def _refuse_open(host: str, security: ServerSecurity) -> None:
    """A port beyond loopback needs TLS and authentication both."""
    if is_loopback(host):
        return
    missing = missing_for_open_host(tls=security.tls, authenticated=security.authenticated)
    if missing:
        raise InvalidArgument(
            f"refusing to serve gRPC on {host} without {' and '.join(missing)}; "
            "or bind to 127.0.0.1",
            field="host",
        )


async def _add_health_and_reflection(
    server: grpc.aio.Server, services: list[str]
) -> health_aio.HealthServicer:
    """grpc.health.v1 (open to anyone; SERVING for the server as a whole and
    for each service) and server reflection (admin's, see ``access``)."""
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *services]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return servicer


async def _check_durability(monitor_url: str | None) -> None:
    """Warn unless nats-server runs with ``sync_interval: always``: by default it
    acknowledges writes up to two minutes before they reach the disk."""
    if monitor_url is None:
        log.info("no NATS monitoring address given; sync_interval not checked")
        return
    try:
        always = await check_sync_always(monitor_url)
    except Exception as err:
        log.warning("could not read %s/varz to check sync_interval: %s", monitor_url, err)
        return
    if not always:
        log.warning(
            "nats-server at %s does not run with sync_interval: always; acknowledged "
            "writes can be lost in a power failure (docs/architecture.md, durability)",
            monitor_url,
        )
