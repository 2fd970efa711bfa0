"""Which partitions this replica owns: partition leases, owners in the ``PARTITIONS`` bucket.

Each replica (a process that serves the engine) beats on the core NATS
subject ``dagnats.replicas.<id>`` every third of the partition lease, and
hears the others' beats there; a replica not heard for a lease is absent
(killed, frozen or cut off). Presence is judged by each replica on its own
clock, from when it last heard a beat: never by comparing clocks across
machines. The beats store nothing (an idle deployment writes nothing), and a
replica beats at once when it hears a new one, so a newcomer learns who is
there within a round trip. ``owner.<k>`` in the bucket names partition
``k``'s owner and changes only by compare-and-swap on its revision; every
replica watches the bucket. At each change, beat and renewal (the periodic
check, in case a change was missed or an action failed) it asks the pure rule
of ``dagnats.engine.partition_rules`` what to take and what to give up, and
does it.

Ownership is advisory, for speed only: the journal's fence, the run's
compare-and-swap, the work-queue acknowledgements and the reconciler keep two
replicas that both consume a partition for a moment safe. So a take and a
give-up need no order between them, and a replica that cannot reach NATS
keeps what it owns only until its own lease would have expired (timed from
before its last beat that nats-server acknowledged), then owns nothing until
it beats again: by then the others, which have not heard it for at least as
long, may have taken its partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import assert_never

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from dagnats.core import jetstream as jsx
from dagnats.core.errors import Unavailable
from dagnats.core.ids import check_token
from dagnats.core.partitions import check_partitions, partition_of
from dagnats.engine.partition_rules import GiveUp, Owner, Take, View, decide, owned, release

log = logging.getLogger(__name__)

__all__ = ["PRESENCE", "Ownership"]

PRESENCE = "dagnats.replicas"
"""Core NATS subject of the replicas' beats: ``dagnats.replicas.<id>``."""
_ALIVE, _GONE_BEAT = b"alive", b"gone"
_GONE = ("DEL", "PURGE")
WRONG_LAST_SEQUENCE = 10071  # the key moved on since the revision a change expected

OnChange = Callable[[frozenset[int]], Awaitable[None] | None]


class Ownership:
    """The partitions this replica owns, kept by partition leases.

    ``owned()`` is what the engine consumes; ``on_change`` callbacks hear each
    change of it, in order, from the ownership's own task.
    """

    def __init__(self, nc: NATS | None, *, replica_id: str, partitions: int, lease: float) -> None:
        self.partitions = check_partitions(partitions)
        self.replica_id = check_token(replica_id, field="replica_id")
        self.lease = lease
        self._nc: NATS | None = nc
        self._kv: KeyValue | None = None
        self._owned: frozenset[int] = frozenset()
        self._callbacks: list[OnChange] = []
        self._heard: dict[str, float] = {}  # replica -> monotonic time of its last beat
        self._gone: set[str] = set()  # replicas that said they stopped
        self._owners: dict[int, Owner] = {}
        self._synced = asyncio.Event()
        self._lock = asyncio.Lock()
        self._started_at = time.monotonic()
        self._renewed_at: float | None = None  # monotonic, before the last acknowledged beat
        self._tasks: list[asyncio.Task[None]] = []
        self._watch: asyncio.Task[None] | None = None
        self._beats: Subscription | None = None
        self._settling: set[asyncio.Task[None]] = set()  # settles a beat heard started

    @classmethod
    def whole(cls, partitions: int = 1) -> Ownership:
        """A stand-in that owns every partition, with no leases: for one engine
        alone (and the tests that run one). ``start``, ``release`` and ``stop``
        do nothing."""
        stand_in = cls(None, replica_id="whole", partitions=partitions, lease=math.inf)
        stand_in._owned = frozenset(range(stand_in.partitions))
        return stand_in

    def owned(self) -> frozenset[int]:
        """The partitions this replica owns now."""
        return self._owned

    def owns_run(self, run_id: str) -> bool:
        """Whether the run's partition is among those this replica owns."""
        return partition_of(run_id, self.partitions) in self._owned

    def on_change(self, callback: OnChange) -> None:
        """Call ``callback`` with the new owned set at each change (awaited
        when it returns an awaitable)."""
        self._callbacks.append(callback)

    async def start(self) -> None:
        """Beat, read the bucket, and take this replica's share of what is free.

        Raises:
            Unavailable: NATS or the bucket could not be reached.
        """
        if self._nc is None:
            return
        js = self._nc.jetstream()
        self._kv = await jsx.open_bucket(js, jsx.KV_PARTITIONS)
        self._started_at = time.monotonic()
        self._beats = await self._nc.subscribe(f"{PRESENCE}.*", cb=self._heard_beat)
        await jsx.retry_transient(self._beat, "announce this replica")
        self._watch = asyncio.create_task(self._watching(), name="ownership-watch")
        self._tasks = [
            asyncio.create_task(self._beating(), name="ownership-beat"),
            asyncio.create_task(self._renewing(), name="ownership-renew"),
        ]
        try:
            async with asyncio.timeout(jsx.RETRY_BUDGET):
                await self._synced.wait()
        except TimeoutError:
            await self.stop()
            raise Unavailable("could not read the partitions bucket's owners") from None

    async def release(self) -> None:
        """Give up what it owns at once (a graceful stop): the others take
        over without waiting out the lease. What it gives up is the rule's
        (``partition_rules.release``), from the owner keys as last seen. Best
        effort, within a third of a lease; nothing is tried on a connection
        that is down (the others take over when the lease runs out, as after
        a kill)."""
        if self._nc is None or self._kv is None:
            return
        await self.stop()
        view = View(
            me=self.replica_id,
            partitions=self.partitions,
            replicas=frozenset(),
            owners=dict(self._owners),
        )
        given = release(view)
        if self._nc.is_connected:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.lease / 3):
                    await self._give_all_up(self._kv, given)
        log.info("replica %s released partitions %s", self.replica_id, [g.partition for g in given])
        await self._publish(frozenset())

    async def _give_all_up(self, kv: KeyValue, given: tuple[GiveUp, ...]) -> None:
        for up in given:
            with contextlib.suppress(nats.js.errors.APIError):  # another took it
                await kv.delete(f"owner.{up.partition}", last=up.revision)
        assert self._nc is not None
        await self._nc.publish(f"{PRESENCE}.{self.replica_id}", _GONE_BEAT)
        await self._nc.flush(timeout=self.lease / 3)  # type: ignore[arg-type]  # a float works

    async def stop(self) -> None:
        """Stop beating and watching, deleting nothing: the others take its
        partitions when they have not heard it for a lease."""
        tasks = [*self._tasks, *self._settling, *([self._watch] if self._watch else [])]
        self._tasks, self._watch = [], None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        beats, self._beats = self._beats, None
        if beats is not None:
            with contextlib.suppress(nats.errors.Error):
                await beats.unsubscribe()

    # Presence.

    async def _beating(self) -> None:
        """Beat every third of a lease. Beats wait on nothing else: a settle
        that is slow (the engine taking a partition's consumers on a loaded
        cluster) must not make this replica look gone to the others."""
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                await self._beat()
            except Exception as err:
                log.warning("replica %s could not beat: %r", self.replica_id, err)

    async def _renewing(self) -> None:
        """Every third of a lease, open a watch that ended again and settle,
        in case a change was missed or an action failed."""
        while True:
            await asyncio.sleep(self.lease / 3)
            if self._watch is not None and self._watch.done():
                self._watch = asyncio.create_task(self._watching(), name="ownership-watch")
            try:
                await self._settle()
            except Exception:
                log.exception("replica %s could not settle its partitions", self.replica_id)

    async def _beat(self) -> None:
        """Beat; the lease runs from before the beat once nats-server has it."""
        assert self._nc is not None
        sent = time.monotonic()
        await self._nc.publish(f"{PRESENCE}.{self.replica_id}", _ALIVE)
        await self._nc.flush(timeout=self.lease / 3)  # type: ignore[arg-type]  # a float works
        self._renewed_at = sent

    async def _heard_beat(self, msg: Msg) -> None:
        replica = msg.subject[len(PRESENCE) + 1 :]
        if replica == self.replica_id:
            return
        if msg.data == _GONE_BEAT:
            self._heard.pop(replica, None)
            self._gone.add(replica)
        else:
            new = replica not in self._present(time.monotonic())
            self._heard[replica] = time.monotonic()
            self._gone.discard(replica)
            if not new:
                return
            with contextlib.suppress(nats.errors.Error):  # a newcomer hears us at once
                await self._nc.publish(f"{PRESENCE}.{self.replica_id}", _ALIVE)  # type: ignore[union-attr]
        if self._synced.is_set():  # the lock orders it after any settle under way
            settling = asyncio.create_task(self._settle())
            self._settling.add(settling)
            settling.add_done_callback(self._settling.discard)

    def _present(self, now: float) -> frozenset[str]:
        """The replicas heard within a lease, this one, and, for the first
        third of a lease after it started, the owners it has not heard from
        at all. A live replica beats that often, and at once when it hears a
        newcomer; one that has not by then is taken for gone (its partitions
        taken early from a replica merely slow is safe: ownership is advisory),
        so a replica restarted under a new id after a kill does not wait out
        its predecessor's lease."""
        present = {r for r, at in self._heard.items() if now - at <= self.lease}
        if now - self._started_at <= self.lease / 3:
            named = {o.replica for o in self._owners.values() if o.replica is not None}
            present |= named - self._heard.keys() - self._gone
        return frozenset(present | {self.replica_id})

    # The bucket.

    async def _watching(self) -> None:
        """Follow the owner keys; a watch that fails is opened again, from the
        bucket's current state."""
        assert self._kv is not None
        while True:
            watcher = None
            try:
                watcher = await self._kv.watch("owner.*")
                self._synced.clear()  # decide again only on the whole bucket
                self._owners = {}
                async for entry in watcher:
                    if entry is None:
                        self._synced.set()
                    else:
                        self._apply(entry)
                    if self._synced.is_set():
                        await self._settle()
            except (nats.errors.Error, nats.js.errors.Error, OSError) as err:
                log.warning("replica %s lost its watch of partitions: %r", self.replica_id, err)
                await asyncio.sleep(self.lease / 3)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]

    def _apply(self, entry: KeyValue.Entry) -> None:
        name = entry.key.removeprefix("owner.")
        if not name.isdigit() or int(name) >= self.partitions:
            return
        k, revision = int(name), entry.revision or 0
        if revision >= self._owners.get(k, Owner(replica=None, revision=0)).revision:
            gone = entry.operation in _GONE or not entry.value
            replica = None if gone else (entry.value or b"").decode()
            self._owners[k] = Owner(replica=replica, revision=revision)

    # Deciding and acting.

    def _lapsed(self) -> bool:
        return self._renewed_at is None or time.monotonic() - self._renewed_at > self.lease

    async def _settle(self) -> None:
        """Act on the rule's decision, then publish what this replica owns."""
        if not self._synced.is_set():
            return
        async with self._lock:
            if self._lapsed():  # others may have taken them: consume nothing
                await self._publish(frozenset())
                return
            view = View(
                me=self.replica_id,
                partitions=self.partitions,
                replicas=self._present(time.monotonic()),
                owners=dict(self._owners),
            )
            for action in decide(view):
                match action:
                    case Take(partition, revision):
                        await self._cas(partition, revision, self.replica_id)
                    case GiveUp(partition, revision):
                        await self._cas(partition, revision, None)
                    case _:
                        assert_never(action)
            await self._publish(owned(dataclasses.replace(view, owners=self._owners)))

    async def _cas(self, partition: int, revision: int, replica: str | None) -> None:
        """Set ``owner.<partition>`` to ``replica`` (None: delete it) if it is
        still at ``revision``; a lost race is no error (the watch brings the
        winner)."""
        assert self._kv is not None
        key = f"owner.{partition}"
        try:
            if replica is None:
                await self._kv.delete(key, last=revision)
                self._owners[partition] = Owner(replica=None, revision=revision)
            else:
                new = await self._kv.update(key, replica.encode(), last=revision)
                self._owners[partition] = Owner(replica=replica, revision=new)
        except nats.js.errors.KeyWrongLastSequenceError:
            return
        except nats.js.errors.APIError as err:
            if err.err_code != WRONG_LAST_SEQUENCE:  # a delete's lost race is not converted
                log.warning("replica %s could not change %s: %s", self.replica_id, key, err)
        except (nats.errors.Error, nats.js.errors.Error) as err:
            log.warning("replica %s could not change %s: %r", self.replica_id, key, err)

    async def _publish(self, now: frozenset[int]) -> None:
        if now == self._owned:
            return
        self._owned = now
        log.info(
            "replica %s owns partitions %s of %d", self.replica_id, sorted(now), self.partitions
        )
        for callback in self._callbacks:
            try:
                result = callback(now)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("a callback of the partitions this replica owns failed")
