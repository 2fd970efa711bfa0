"""How many fsyncs nats-server makes for what the product asks of it.

``python -m bench.jetstream_fsyncs [N]`` (``make jetstream-facts``) starts a
nats-server of the pinned version with ``sync_interval: always`` and another
with the default, attaches ``strace -f -c`` to it, and for N messages (200)
counts the sync calls of: a publish to a limits stream (the journal,
history), a publish to a work-queue stream (tasks, timers), an
acknowledgement on a limits stream's consumer (history), and an
acknowledgement on a work-queue consumer (a task: its removal). It prints
them per message. The figures ``docs/architecture.md`` states come from it:
under ``always`` every stored message costs one fsync before its ack, and so
does every work-queue acknowledgement (the removal is a write), while an
acknowledgement on a limits stream costs none; under the default nothing is
fsynced before the ack.

Needs ``strace`` and permission to attach to a child process.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from bench.bench_turn import Strace, sync_calls
from dagnats.core.natsserver import NatsServer


async def counted(server: NatsServer, out: Path, work: Callable[[], Awaitable[None]]) -> int:
    """The sync calls nats-server makes while ``work`` runs."""
    async with Strace(server.pid, out) as trace:
        await work()
    return sync_calls(trace.counts)


async def publish(js: JetStreamContext, stream: str, n: int) -> None:
    for i in range(n):
        await js.publish(f"{stream}.run.{i}", b"x" * 512)


async def acknowledge(msgs: list[Msg]) -> None:
    for msg in msgs:
        await msg.ack_sync()


async def probe(nc: NATS, server: NatsServer, out: Path, n: int) -> dict[str, float]:
    js = nc.jetstream()
    found: dict[str, float] = {}
    kinds = (("limits", RetentionPolicy.LIMITS), ("work queue", RetentionPolicy.WORK_QUEUE))
    for kind, retention in kinds:
        name = kind.replace(" ", "_").upper()
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"], retention=retention))
        config = ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, max_ack_pending=-1)
        await js.add_consumer(name, config)
        stored = await counted(server, out, functools.partial(publish, js, name, n))
        found[f"publish, {kind} stream"] = stored / n
        sub = await js.pull_subscribe_bind("c", stream=name)
        msgs: list[Msg] = []
        while len(msgs) < n:
            msgs += await sub.fetch(n - len(msgs), timeout=5)
        acked = await counted(server, out, functools.partial(acknowledge, msgs))
        found[f"ack, {kind} consumer"] = acked / n
    return found


async def main(n: int) -> None:
    for always in (True, False):
        with tempfile.TemporaryDirectory(prefix="dagnats-fsyncs-") as tmp:
            server = await NatsServer.start(Path(tmp) / "store", sync_always=always)
            nc = await nats.connect(server.url)
            try:
                found = await probe(nc, server, Path(tmp) / "strace.txt", n)
            finally:
                await nc.close()
                await server.stop()
        print(f"sync_interval: {'always' if always else 'default (2 minutes)'}, {n} messages")
        for what, per in found.items():
            print(f"  {what:28s} {per:5.2f} fsyncs each")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
