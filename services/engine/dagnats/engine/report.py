"""A step's outcome on its way in: the lifecycle event on the run's history,
then the acknowledgement of the task's lease.

The engine's ``Report`` and a journal commit that settles its own task both
publish here, so one outcome has one Msg-Id whoever sends it, and a second
send (a retry, a claim that republishes a stored commit) is a duplicate the
HISTORY stream drops.

A journal commit sends its event to one engine over core NATS first, and
publishes it on the history only when no engine answered within a third of
its wait (ADR 33): the stored commit is the durable fact, and the task
message, still leased, stays in the queue until the engine has applied the
event or the event is on the history. When an engine serves reports in the
journal service's own process, that engine is the one: it is handed the
event by a call, not over NATS (ADR 36).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from typing import Protocol

from dagnats.core import tracing
from dagnats.core.outcomes import outcome_of
from dagnats.core.seam import seam
from dagnats.core.timestamps import timestamp
from dagnats.engine import convert
from dagnats.engine.store import EngineStore
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

Outcome = pb.Continue | pb.Complete | pb.Fail | pb.Pause

# The share of a commit's wait spent on the engine's direct answer before
# the event goes to the history; the rest waits for the history's engine. A
# direct answer takes one run write (milliseconds); the history's path takes
# a publish, a pull and the write, and keeps the larger share. The whole stays
# within the wait, plus the publish, as before ADR 33.
DIRECT_SHARE = 1 / 3


def lease_position(lease: str) -> tuple[int, int]:
    """The delivery count of a (checked) lease, and the stream sequence of its task."""
    tokens = lease.split(".")
    at = tokens.index("TASKS")  # then the consumer, the delivery count, the stream sequence
    return int(tokens[at + 2]), int(tokens[at + 3])


def outcome_event(
    *,
    run_id: str,
    step_id: str,
    iteration: int,
    attempt: int,
    journal_seq: int,
    outcome: Outcome,
    now: float,
) -> ipb.HistoryEvent:
    """The lifecycle event of ``outcome``, in the current trace."""
    event = ipb.HistoryEvent(
        run_id=run_id,
        step_id=step_id,
        iteration=iteration,
        attempt=attempt,
        journal_seq=journal_seq,
    )
    event.time.CopyFrom(timestamp(now))
    headers: dict[str, str] = {}
    tracing.inject(headers)
    event.trace_context.update(headers)
    convert.outcome_to_event(outcome, event)
    return event


def commit_event(commit: jpb.Record, now: float) -> ipb.HistoryEvent:
    """The lifecycle event of a stored journal commit (``commit.seq`` set)."""
    _, outcome = outcome_of(commit.commit)
    return outcome_event(
        run_id=commit.run_id,
        step_id=commit.step_id,
        iteration=commit.iteration,
        attempt=commit.attempt,
        journal_seq=commit.seq,
        outcome=outcome,
        now=now,
    )


def outcome_msg_id(event: ipb.HistoryEvent) -> str:
    """The Msg-Id of an outcome's event: one per dispatch and kind, so a
    second send of the same outcome is dropped as a duplicate."""
    kind = event.WhichOneof("kind")
    if event.attempt > 0:
        return f"{event.run_id}.{event.step_id}.{event.iteration}.{event.attempt}.{kind}"
    # a legacy report, without a dispatch identity
    return f"{event.run_id}.{event.step_id}.legacy.{secrets.token_hex(8)}"


async def publish_outcome(store: EngineStore, lease: str, event: ipb.HistoryEvent) -> None:
    """Publish ``event`` on its run's history, then acknowledge the task."""
    await store.publish_event(event, outcome_msg_id(event))
    # The outcome is durable on the run's history: only now may the task go.
    await store.release(lease)


class LocalEngine(Protocol):
    """The engine of the journal service's own process, as a taker of
    commits' events (``dagnats.engine.processor.Engine``)."""

    @property
    def takes_reports(self) -> bool: ...

    async def take_report(self, event: ipb.HistoryEvent, *, wait: float) -> bytes | None: ...


class TaskSettler:
    """Settling the task of a stored journal commit, for the journal service
    (``dagnats.journal.peers.Tasks``): the commit's event, stamped by the
    engine's clock, then the lease released. ``local``: the engine of this
    process, which takes the events while it serves reports (ADR 36)."""

    def __init__(
        self, store: EngineStore, clock: Callable[[], float], local: LocalEngine | None = None
    ) -> None:
        self._store = store
        self._clock = clock
        self._local = local

    def _event(self, commit: jpb.Record) -> ipb.HistoryEvent:
        """The lifecycle event of a stored commit, stamped by the engine's clock."""
        return commit_event(commit, self._clock())

    async def settle(self, lease: str, commit: jpb.Record, *, wait: float) -> None:
        """Send the stored ``commit``'s event to one engine (ADR 33), and
        publish it on the history only when none answered within
        ``DIRECT_SHARE`` of ``wait``; then release the task: its outcome is in
        the run, or on the history, before the task goes.

        Raises:
            Exception: the event could not be published on the history.
        """
        told = await self._reported(self._event(commit), wait * DIRECT_SHARE)
        told.cancel()
        await self._store.release(lease)

    async def hold(self, lease: str, commit: jpb.Record, *, wait: float) -> pb.Task | None:
        """Send the stored continue ``commit``'s event, its task message kept
        for the next iteration (ADR 31), to one engine (ADR 33), and wait for
        the engine's decision: the next dispatch the message now carries, or
        None. When none came within ``DIRECT_SHARE`` of ``wait`` (or no engine
        takes such events), the event is published on the history, and the
        rest of ``wait`` is waited for the decision of the engine that
        applies it (or of the first one, late). None with the message
        released when it carries no current dispatch; None with the lease
        left to run out when no decision came (the message is then delivered
        again, carrying what the run says).

        Raises:
            Exception: the event could not be published on the history (the
                stored commit's event may be nowhere durable).
        """
        event = self._event(commit)
        event.held_seq = lease_position(lease)[1]
        direct = wait * DIRECT_SHARE
        told = await self._reported(event, direct)
        try:
            if not told.done():
                await asyncio.wait_for(asyncio.shield(told), wait - direct)
        except TimeoutError:
            return None
        finally:
            told.cancel()
        decision = ipb.EventDecision.FromString(told.result())
        if decision.HasField("next"):
            return decision.next
        await self._store.release(lease)
        return None

    async def _reported(self, event: ipb.HistoryEvent, wait: float) -> asyncio.Future[bytes]:
        """Send ``event`` to one engine: this process's, when it takes
        reports, else one over core NATS. The future of its decision: done
        when the decision came within ``wait`` seconds. Else the event goes
        where every engine reads: it is published on the history, naming a
        notice subject the engine that applies it tells (the future waits on
        it; the caller cancels it when it stops waiting)."""
        local = self._local if self._local is not None and self._local.takes_reports else None
        decision = None
        if local is not None:
            # Handed over by a call: the decision is its answer, and the
            # notice subject is needed only if the history takes the event.
            await seam("after_report_sent")
            decision = await local.take_report(event, wait=wait)
        if decision is not None:
            told: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            told.set_result(decision)
            return told
        event.notify, told = await self._store.expect_notice()
        try:
            if local is None and await self._told_directly(event, told, wait):
                return told
            await self._store.publish_event(event, outcome_msg_id(event))
        except BaseException:
            told.cancel()
            raise
        return told

    async def _told_directly(
        self, event: ipb.HistoryEvent, told: asyncio.Future[bytes], wait: float
    ) -> bool:
        """Send ``event`` to one engine over core NATS; whether its decision
        came on ``told`` within ``wait`` seconds. False at once when no engine
        subscribes."""
        try:
            refused = await self._store.send_report(event)
        except Exception as err:  # the connection is reconnecting: the history it is
            log.warning(
                "%s/%s: a commit's event was not sent: %r", event.run_id, event.step_id, err
            )
            return False
        try:
            await seam("after_report_sent")
            await asyncio.wait({told, refused}, timeout=wait, return_when=FIRST_COMPLETED)
        finally:
            refused.cancel()
        return told.done()

    async def release(self, lease: str) -> None:
        await self._store.release(lease)

    async def redeliver(self, lease: str) -> None:
        await self._store.redeliver(lease)
