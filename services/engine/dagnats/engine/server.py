"""Running the engine: NATS connection, provisioning, consumer loops and the
gRPC server, started and stopped as one."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from dagnats.core import jetstream as jsx
from dagnats.core import tracing
from dagnats.core.natsserver import check_sync_always
from dagnats.engine.config import EngineConfig
from dagnats.engine.processor import Engine
from dagnats.engine.service import EngineServicer
from dagnats.engine.store import EngineStore
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.watch import RunWatches
from dagnats.inputs.natsapi import serve_nats_api
from dagnats.inputs.service import Inputs, InputsServicer
from dagnats.inputs.store import InputStore
from dagnats.inputs.v1 import inputs_pb2_grpc as inputs_grpc
from dagnats.journal.service import JournalServicer
from dagnats.journal.store import JournalStore
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

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        if self.watches is not None:
            await self.watches.close()  # the run watches of WatchRun calls
        if self.journal is not None:
            await self.journal.close()  # the settles of commits it answered
        await self.engine.stop()
        await self.nc.drain()


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
    """
    config = config or EngineConfig.from_env()
    await _check_durability(monitor_url)
    nc = await jsx.connect(nats_url, name="dagnats-engine")
    await jsx.provision(nc.jetstream(), topology)
    input_store = await InputStore.open(nc)
    engine = Engine(await EngineStore.open(nc), config, inputs=input_store)
    await engine.start()
    # Requests up to 16 MiB reach the services, so a journal record over its
    # maximum is refused with the error's code rather than by gRPC's 4 MiB cap.
    server = grpc.aio.server(
        interceptors=tracing.server_interceptors(),
        options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
    )
    servicer = EngineServicer(engine)
    pb_grpc.add_EngineServiceServicer_to_server(servicer, server)
    journal: JournalServicer | None = None
    if with_journal:
        runs = await nc.jetstream().key_value(jsx.KV_RUNS)
        journal = JournalServicer(JournalStore(nc), runs, input_store, clock=engine.clock)
        journal_grpc.add_JournalServiceServicer_to_server(journal, server)
    subscriptions: list[Subscription] = []
    if with_inputs:
        inputs = Inputs(input_store)
        inputs_grpc.add_InputsServiceServicer_to_server(InputsServicer(inputs), server)
        subscriptions = await serve_nats_api(nc, inputs)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    log.info("engine serving on %s:%d", host, bound)
    return EngineServer(
        engine=engine,
        server=server,
        nc=nc,
        host=host,
        port=bound,
        subscriptions=subscriptions,
        journal=journal,
        watches=servicer.watches,
    )


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
