"""How to hold partitions: JetStream priority groups (pinned client) against
partition leases (``dagnats.engine.ownership``), measured on one nats-server.

Run with ``python -m bench.exp_ownership`` (the repo's nats-server binary, a
store in a temporary directory, a monitoring port for ``/varz``). Both ways
hold P = 6 partitions among clients started one after the other:

- pinned: one pull consumer per partition with ``priority_groups`` and
  ``priority_policy: pinned_client`` (nats-py has no API for them, so the
  consumer is made by a raw ``$JS.API.CONSUMER.CREATE`` request and pulled
  with ``{"batch", "expires", "group", "id"}`` on ``$JS.API.CONSUMER.MSG.NEXT``;
  a graceful stop sends ``$JS.API.CONSUMER.UNPIN``). Every client pulls every
  partition: the server delivers to the pinned one.
- leases: an :class:`~dagnats.engine.ownership.Ownership` per client; each
  client pulls only the partitions it owns.

What it prints: (a) how the partitions spread over 2 and 3 clients, (b) the
time from a client killed (its connection closed, nothing said) to every
partition delivering to another, with the smallest pinned TTL the server
takes against the smallest lease, (c) the same after a graceful stop (unpin
against ``release()``), (d) messages into nats-server per second at rest
(``/varz`` ``in_msgs``) with 3 clients. Nothing asserts; numbers go to ADR 73.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import nats
from nats.aio.client import Client as NATS
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.engine.ownership import Ownership

P = 6
STREAM = "EXP"
GROUP = "own"
EXPIRES = 5.0  # a pull's long poll, as the engine's
REST = 15.0  # seconds of each at-rest window


def consumer(k: int) -> str:
    return f"part-{k}"


async def create_pinned(nc: NATS, k: int, pinned_ttl: float) -> dict[str, object]:
    config = {
        "durable_name": consumer(k),
        "ack_policy": "explicit",
        "filter_subject": f"exp.{k}",
        "priority_groups": [GROUP],
        "priority_policy": "pinned_client",
        "priority_timeout": int(pinned_ttl * 1e9),
    }
    msg = await nc.request(
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{consumer(k)}",
        json.dumps({"stream_name": STREAM, "config": config}).encode(),
        timeout=5,
    )
    answer: dict[str, object] = json.loads(msg.data)
    return answer


class PinClient:
    """Pulls every partition's consumer in its group; the server delivers to the pinned."""

    def __init__(self, name: str, nc: NATS, partitions: range) -> None:
        self.name, self.nc = name, nc
        self.pins: dict[int, str] = {}
        self.got: list[tuple[int, float]] = []
        self.tasks = [asyncio.create_task(self._pull(k)) for k in partitions]

    async def _pull(self, k: int) -> None:
        # An inbox of its own: nats-py's request() does not see a pinned
        # consumer's deliveries.
        inbox = await self.nc.subscribe(self.nc.new_inbox())
        while True:
            ask: dict[str, object] = {"batch": 1, "expires": int(EXPIRES * 1e9), "group": GROUP}
            if k in self.pins:
                ask["id"] = self.pins[k]
            await self.nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{consumer(k)}",
                json.dumps(ask).encode(),
                reply=inbox.subject,
            )
            try:
                msg = await inbox.next_msg(timeout=EXPIRES + 2)
            except nats.errors.TimeoutError:
                continue
            status = (msg.headers or {}).get("Status")
            if status is None:
                self.pins[k] = (msg.headers or {}).get("Nats-Pin-Id", "")
                self.got.append((k, time.monotonic()))
                await self.nc.publish(msg.reply, b"+ACK")
            elif status == "423":  # another client holds the pin
                self.pins.pop(k, None)

    async def stop(self, *, unpin: bool = False) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if unpin:
            for k in self.pins:
                await self.nc.request(
                    f"$JS.API.CONSUMER.UNPIN.{STREAM}.{consumer(k)}",
                    json.dumps({"group": GROUP}).encode(),
                    timeout=5,
                )
        await self.nc.close()


async def publish_round(nc: NATS) -> float:
    js = nc.jetstream()
    sent = time.monotonic()
    for k in range(P):
        await js.publish(f"exp.{k}", b"x")
    return sent


async def delivered_after(clients: list[PinClient], since: float, within: float) -> float:
    """Seconds from ``since`` until every partition delivered to one of ``clients``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done = {k for c in clients for k, at in c.got if at >= since}
        if done == set(range(P)):
            return max(at for c in clients for _, at in c.got if at >= since) - since
        await asyncio.sleep(0.01)
    return float("nan")


def holders(clients: list[PinClient], since: float) -> list[int]:
    counts = Counter(c.name for c in clients for _, at in c.got if at >= since)
    return [counts.get(c.name, 0) for c in clients]


async def smallest_pinned_ttl(nc: NATS) -> float:
    for ttl in (0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0):
        answer = await create_pinned(nc, 99, ttl)
        await nc.request(f"$JS.API.CONSUMER.DELETE.{STREAM}.{consumer(99)}", b"", timeout=5)
        if "error" not in answer:
            return ttl
    return float("nan")


async def pinned(server: NatsServer, ttl: float) -> dict[str, object]:
    admin = await nats.connect(server.url)
    for k in range(P):
        await admin.request(f"$JS.API.CONSUMER.DELETE.{STREAM}.{consumer(k)}", b"", timeout=5)
        await create_pinned(admin, k, ttl)
    out: dict[str, object] = {"pinned_ttl": ttl}
    clients: list[PinClient] = []
    spread = {}
    for n in (1, 2, 3):
        clients.append(PinClient(f"c{n}", await nats.connect(server.url), range(P)))
        await asyncio.sleep(0.3)  # its pulls are waiting
        since = await publish_round(admin)
        await delivered_after(clients, since, 10)
        spread[n] = holders(clients, since)
    out["(a) spread over 1, 2, 3 clients"] = spread
    # (b) c1 holds the pins: kill it, then see how long until others deliver.
    killed = clients.pop(0)
    await killed.stop()
    since = await publish_round(admin)
    out["(b) kill -> all delivered again (s)"] = round(await delivered_after(clients, since, 30), 2)
    out["(b) spread after"] = holders(clients, since)
    # (c) the pinned one stops gracefully: stops pulling, unpins.
    pinned_one = max(clients, key=lambda c: len(c.pins))
    clients.remove(pinned_one)
    began = time.monotonic()
    await pinned_one.stop(unpin=True)
    await publish_round(admin)
    out["(c) unpin -> all delivered again (s)"] = round(
        await delivered_after(clients, began, 30), 2
    )
    for c in clients:
        await c.stop()
    # (d) at rest: 3 clients, every one pulling every partition.
    rest = [PinClient(f"r{n}", await nats.connect(server.url), range(P)) for n in range(3)]
    out["(d) in_msgs/s at rest, 3 clients"] = await in_rate(server)
    for c in rest:
        await c.stop()
    await admin.close()
    return out


CONNECTIONS: list[NATS] = []  # the replicas', closed at the end


async def owners(server: NatsServer, lease: float, ids: list[str]) -> list[Ownership]:
    started = []
    for rid in ids:
        nc = await nats.connect(server.url)
        CONNECTIONS.append(nc)
        own = Ownership(nc, replica_id=rid, partitions=P, lease=lease)
        await own.start()
        started.append(own)
    return started


async def until(predicate: Callable[[], bool], within: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < within:
        if predicate():
            return time.monotonic() - began
        await asyncio.sleep(0.005)
    return float("nan")


def covered(*os: Ownership) -> bool:
    return sorted(k for o in os for k in o.owned()) == list(range(P))


async def leases(server: NatsServer, lease: float) -> dict[str, object]:
    admin = await jsx.connect(server.url, name="exp-admin")
    js = admin.jetstream()
    await js.delete_key_value(jsx.KV_PARTITIONS)
    await jsx.provision(js)
    out: dict[str, object] = {"lease": lease}
    spread = {}
    running: list[Ownership] = []
    for rid in ("a", "b", "c"):
        running += await owners(server, lease, [rid])
        await until(functools.partial(spread_evenly, running), 10)
        spread[len(running)] = [len(o.owned()) for o in running]
    out["(a) spread over 1, 2, 3 replicas"] = spread
    a, b, c = running
    await a.stop()  # as kill -9
    out["(b) kill -> others own all (s)"] = round(await until(lambda: covered(b, c), 30), 2)
    await b.release()
    out["(c) release -> the other owns all (s)"] = round(await until(lambda: covered(c), 30), 2)
    await c.stop()
    await admin.close()
    return out


def spread_evenly(running: list[Ownership]) -> bool:
    sizes = [len(o.owned()) for o in running]
    return covered(*running) and max(sizes) - min(sizes) <= 1


async def leases_at_rest(server: NatsServer, lease: float) -> float:
    """3 replicas, each pulling (as PinClient does, without a group) only what it owns."""
    admin = await nats.connect(server.url)
    js = admin.jetstream()
    await js.delete_key_value(jsx.KV_PARTITIONS)
    await jsx.provision(js)
    for k in range(P):
        await admin.request(f"$JS.API.CONSUMER.DELETE.{STREAM}.{consumer(k)}", b"", timeout=5)
        await js.add_consumer(STREAM, durable_name=consumer(k), filter_subject=f"exp.{k}")
    running = await owners(server, lease, ["a", "b", "c"])
    await until(lambda: spread_evenly(running), 10)
    pullers = [PlainPuller(await nats.connect(server.url), sorted(o.owned())) for o in running]
    rate = await in_rate(server)
    for p in pullers:
        await p.stop()
    for o in running:
        await o.stop()
    await admin.close()
    return rate


class PlainPuller(PinClient):
    def __init__(self, nc: NATS, partitions: list[int]) -> None:
        self.name, self.nc, self.pins, self.got = "plain", nc, {}, []
        self.tasks = [asyncio.create_task(self._plain(k)) for k in partitions]

    async def _plain(self, k: int) -> None:
        inbox = await self.nc.subscribe(self.nc.new_inbox())
        ask = json.dumps({"batch": 1, "expires": int(EXPIRES * 1e9)}).encode()
        while True:
            subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{consumer(k)}"
            await self.nc.publish(subject, ask, reply=inbox.subject)
            with contextlib.suppress(nats.errors.TimeoutError):
                await inbox.next_msg(timeout=EXPIRES + 2)


async def in_rate(server: NatsServer) -> float:
    await asyncio.sleep(EXPIRES)  # settled: every pull made once
    before = (await server.varz())["in_msgs"]
    began = time.monotonic()
    await asyncio.sleep(REST)
    after = (await server.varz())["in_msgs"]
    return round((after - before) / (time.monotonic() - began), 2)


async def main() -> None:
    store = Path(tempfile.mkdtemp(prefix="exp-ownership-"))
    async with await NatsServer.start(store, sync_always=True) as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=STREAM,
                subjects=["exp.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
            )
        )
        await jsx.provision(js)
        await nc.close()
        admin = await nats.connect(server.url)
        print("smallest pinned_ttl taken:", await smallest_pinned_ttl(admin), flush=True)
        await admin.close()
        for ttl in (1.0, 5.0):
            print("pinned client:", json.dumps(await pinned(server, ttl)), flush=True)
        for lease in (1.0, 5.0):
            print("leases:", json.dumps(await leases(server, lease)), flush=True)
        rest = await leases_at_rest(server, 5.0)
        print("leases: (d) in_msgs/s at rest, 3 replicas, lease 5 s:", rest, flush=True)
        for conn in CONNECTIONS:
            await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
