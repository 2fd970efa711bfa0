"""Running the engine: NATS connection, provisioning, consumer loops and the
gRPC server, started and stopped as one."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
import nats.errors
from grpc_health.v1 import _async as health_aio  # health.aio, the asyncio servicer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from dagnats.core import jetstream as jsx
from dagnats.core import tracing
from dagnats.core.errors import InvalidArgument
from dagnats.core.natsauth import NatsSettings
from dagnats.core.natsserver import check_sync_always
from dagnats.core.settings import is_loopback
from dagnats.engine.access import missing_for_open_host
from dagnats.engine.config import EngineConfig
from dagnats.engine.processor import Engine
from dagnats.engine.run_feed import RunFeed
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


@dataclass
class EngineServer:
    """A running engine; ``target`` is what clients and workers dial."""

    engine: Engine
    server: grpc.aio.Server
    nc: NATS
    host: str
    port: int
    # The api.inputs.* endpoints; stop() ends them with nc.drain().
    subscriptions: list[Subscription] = field(default_factory=list)
    journal: JournalServicer | None = None
    watches: RunWatches | None = None
    feed: RunFeed | None = None
    health: health_aio.HealthServicer | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        if self.health is not None:
            await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING
        await self.server.stop(grace)
        if self.watches is not None:
            await self.watches.close()  # the run watches of WatchRun calls
        if self.feed is not None:
            await self.feed.close()  # the runs watch of WatchRuns calls
        if self.journal is not None:
            await self.journal.close()  # the settles of commits it answered
        await self.engine.stop()
        try:
            await self.nc.drain()
        except nats.errors.Error:  # the server went first: nothing left to drain
            await self.nc.close()


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
) -> EngineServer:
    """Connect, provision streams and buckets, start the loops and serve gRPC.

    Args:
        nats_url: one or more comma-separated NATS URLs.
        host: interface to bind.
        port: port to bind; 0 picks a free one.
        config: engine settings; defaults from the environment.
        topology: stream replication.
        with_journal: serve the journal service on the same port.
        with_inputs: serve the inputs service on the same port and as the
            NATS endpoints ``api.inputs.*`` (``nc.drain()`` in ``stop`` ends them).
        monitor_url: nats-server's monitoring address; when given, the engine
            warns at start-up unless the server fsyncs every write.
        security: TLS and the credentials every call needs; None serves
            plaintext to anyone, which only a loopback ``host`` allows.
        nats_settings: NATS credentials and TLS; by default the
            ``DAGNATS_NATS_*`` environment.

    Raises:
        InvalidArgument: a non-loopback ``host`` without both TLS and
            authentication (naming the missing settings), settings that do
            not fit together, or unreadable certificate, key or tokens files;
            a NATS setting that is malformed, or refused by nats-server.
    """
    security = security or ServerSecurity()
    security.check()
    _refuse_open(host, security)
    credentials = security.server_credentials()  # files read before anything starts
    guard = security.interceptor()
    config = config or EngineConfig.from_env()
    await _check_durability(monitor_url)
    nc = await jsx.connect(nats_url, name="dagnats-engine", settings=nats_settings)
    await jsx.provision(nc.jetstream(), topology)
    input_store = await InputStore.open(nc)
    engine = Engine(await EngineStore.open(nc), config, inputs=input_store)
    await engine.start()
    interceptors = tracing.server_interceptors() + ([guard] if guard is not None else [])
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    servicer = EngineServicer(engine)
    pb_grpc.add_EngineServiceServicer_to_server(servicer, server)
    services = [pb.DESCRIPTOR.services_by_name["EngineService"].full_name]
    journal: JournalServicer | None = None
    if with_journal:
        journal = JournalServicer(JournalStore(nc), input_store, clock=engine.clock)
        journal_grpc.add_JournalServiceServicer_to_server(journal, server)
        services.append(journal_pb.DESCRIPTOR.services_by_name["JournalService"].full_name)
    subscriptions: list[Subscription] = []
    if with_inputs:
        inputs = Inputs(input_store)
        inputs_grpc.add_InputsServiceServicer_to_server(InputsServicer(inputs), server)
        services.append(inputs_pb.DESCRIPTOR.services_by_name["InputsService"].full_name)
        subscriptions = await serve_nats_api(nc, inputs)
    served = await _add_health_and_reflection(server, services)
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    await server.start()
    log.info(
        "engine serving on %s:%d (%s, %s)",
        host,
        bound,
        "TLS" if credentials is not None else "plaintext",
        "credentials required" if guard is not None else "no credentials",
    )
    return EngineServer(
        engine=engine,
        server=server,
        nc=nc,
        host=host,
        port=bound,
        subscriptions=subscriptions,
        journal=journal,
        watches=servicer.watches,
        feed=servicer.feed,
        health=served,
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
            "writes can be lost in a power failure (DESIGN.md §10.10)",
            monitor_url,
        )
