"""An engine process -- the engine, journal and inputs services on one gRPC
port -- for tests that kill or freeze a service, not a worker.

usage: engine_process.py NATS_URL PORT READY_FILE [REPLICAS]

It serves on 127.0.0.1:PORT with the matrix's short leases (each setting can
be changed with its ``DAGNATS_*`` variable) and writes its target to
READY_FILE once it serves; SIGTERM stops it.

Production (``dagnats serve engine``) installs no seam hook, and neither does
this launcher unless ``DAGNATS_TEST_SEAM_ARM`` names a file. That file holds
``<seam> <kill|stall>``; the first process to reach that seam takes the file
(a rename, so exactly one process does even when several share it), writes
``<pid> <seam>`` to the file named by ``DAGNATS_TEST_SEAM_HIT``, and stops
itself right there: SIGKILL, or SIGSTOP until the test sends SIGCONT, after
which it goes on from the seam as a zombie.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from dagnats.core import seam
from dagnats.core.jetstream import Topology
from dagnats.engine.config import EngineConfig
from dagnats.engine.server import start_engine
from tests.matrix import MATRIX

ARM = "DAGNATS_TEST_SEAM_ARM"
HIT = "DAGNATS_TEST_SEAM_HIT"


def seam_hook(arm: Path, hit: Path) -> seam.Hook:
    async def hook(name: str) -> None:
        try:
            wanted, mode = arm.read_text().split()
        except (FileNotFoundError, ValueError):
            return
        if name != wanted:
            return
        try:
            arm.rename(arm.with_name(f"{arm.name}.taken-{os.getpid()}"))
        except FileNotFoundError:
            return  # another process took it first
        taken = hit.with_name(f"{hit.name}.tmp-{os.getpid()}")
        taken.write_text(f"{os.getpid()} {name}")
        taken.rename(hit)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)

    return hook


async def serve(nats_url: str, port: int, ready: Path, replicas: int) -> None:
    if os.environ.get(ARM):
        seam.install(seam_hook(Path(os.environ[ARM]), Path(os.environ[HIT])))
    socket = os.environ.get("DAGNATS_LOCAL_SOCKET")  # as `dagnats serve` reads it
    server = await start_engine(
        nats_url,
        port=port,
        config=EngineConfig.from_env(MATRIX),
        topology=Topology(replicas=replicas),
        local_socket=Path(socket) if socket else None,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    partial = ready.with_name(f"{ready.name}.tmp")
    partial.write_text(server.target)
    partial.rename(ready)
    try:
        await stop.wait()
    finally:
        await server.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    replicas = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), replicas))
