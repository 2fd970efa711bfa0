"""A replica for the chaos soak: the engine, journal and inputs services in a
process of their own, as ``dagnats serve all`` runs them, so the soak can kill
(SIGKILL), freeze (SIGSTOP) and stop it (SIGTERM: it hands its partitions
over) like any process.

usage: replica.py NATS_URL PORT READY OUT SEED STREAM_REPLICAS LOST_ACK_RATE [SOCKET]

Its settings are the soak's (each can be changed with its ``DAGNATS_*``
variable: the soak sets ``DAGNATS_PARTITIONS``, ``DAGNATS_PARTITION_LEASE``
and ``DAGNATS_REPLICA_ID``); with SOCKET it also serves a local socket there.
The soak's in-process faults run inside it: its journal, engine and inputs
writes sometimes lose their ack (:mod:`tests.chaos.faults`), until SIGUSR1
turns that off. Twice a second, and once more when SIGTERM stops it, it adds
to OUT-<pid>.acks (JSON lines) the sequences its journal store acknowledged
and how each append that returned none ended, and writes OUT-<pid>.json: its
lost acks by subject, its engine's counters and what its local socket
carried. A replica killed loses at most the last half second of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from dagnats.core.jetstream import Topology
from dagnats.engine.config import EngineConfig
from dagnats.engine.server import EngineServer, start_services
from tests.chaos.faults import JournalTap, LossyPublish, instrumented_journal
from tests.stack import FAST

# The soak's engine settings: the suite's fast ones, reconciling once a second.
SOAK = dataclasses.replace(FAST, reconcile_interval=1.0)
DUMP_EVERY = 0.5


class Dump:
    """What the soak reads of this process once it is gone."""

    def __init__(self, out: Path, tap: JournalTap, faults: Counter[str]) -> None:
        pid = os.getpid()
        self.acks = out.with_name(f"{out.name}-{pid}.acks")
        self.summary = out.with_name(f"{out.name}-{pid}.json")
        self.tap = tap
        self.faults = faults
        self.lossy: list[LossyPublish] = []
        self.server: EngineServer | None = None
        self.written = 0
        self.failed: set[str] = set()

    def write(self) -> None:
        lines = [
            json.dumps({"ack": [a.subject, a.msg_id, a.kind, a.seq]})
            for a in self.tap.acks[self.written :]
        ]
        self.written = len(self.tap.acks)
        for msg_id, ended in list(self.tap.failed.items()):
            if msg_id not in self.failed:
                self.failed.add(msg_id)
                lines.append(json.dumps({"failed": [msg_id, ended]}))
        if lines:
            with open(self.acks, "a") as f:
                f.write("\n".join(lines) + "\n")
        lost: Counter[str] = Counter()
        for publisher in [*self.tap.publishers, *self.lossy]:
            lost.update(publisher.subjects)
        summary: dict[str, Any] = {"faults": dict(self.faults), "lost": dict(lost)}
        if self.server is not None:
            summary["engine"] = dict(self.server.engine.counters)
            sockets = self.server.local_socket
            if sockets is not None:
                summary["socket"] = {
                    "connections": sockets.accepted,
                    "polls": sockets.polled,
                    "watches": sockets.watched,
                }
        partial = self.summary.with_name(self.summary.name + ".tmp")
        partial.write_text(json.dumps(summary))
        partial.rename(self.summary)


async def serve(argv: list[str]) -> None:
    nats_url, port, ready, out = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    seed, stream_replicas, rate = argv[4], int(argv[5]), float(argv[6])
    socket = Path(argv[7]) if len(argv) > 7 else None
    name = os.environ.get("DAGNATS_REPLICA_ID", "replica")
    faults: Counter[str] = Counter()
    rng = random.Random(f"{seed}/acks/{name}/{os.getpid()}")
    with instrumented_journal(rng, faults, rate) as tap:
        dump = Dump(out, tap, faults)
        server = await start_services(
            nats_url,
            port=port,
            config=EngineConfig.from_env(SOAK),
            topology=Topology(replicas=stream_replicas),
            local_socket=socket,
        )
        assert isinstance(server, EngineServer)
        dump.server = server
        dump.lossy = lossy_services(server, rng, rng, faults, rate / 2)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)

        def heal() -> None:
            for publisher in [*tap.publishers, *dump.lossy]:
                publisher.active = False

        loop.add_signal_handler(signal.SIGUSR1, heal)
        partial = ready.with_name(f"{ready.name}.tmp")
        partial.write_text(server.target)
        partial.rename(ready)
        try:
            while not stop.is_set():
                dump.write()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), DUMP_EVERY)
        finally:
            await server.stop()
            dump.write()


def lossy_services(
    server: EngineServer,
    engine_rng: random.Random,
    inputs_rng: random.Random,
    faults: Counter[str],
    rate: float,
) -> list[LossyPublish]:
    """The engine's writes to its streams and the inputs bucket's writes
    (claims, withdrawals, closes) sometimes land without an ack, as when a
    leader steps down mid-write."""
    store = server.engine.store
    engine = LossyPublish(store.js, engine_rng, faults, rate)
    store.js = engine  # type: ignore[assignment]
    assert server.journal is not None and server.journal.inputs is not None
    bucket = server.journal.inputs._inputs
    inputs = LossyPublish(bucket._js, inputs_rng, faults, rate)
    bucket._js = inputs  # type: ignore[assignment]
    return [engine, inputs]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(sys.argv[1:]))
