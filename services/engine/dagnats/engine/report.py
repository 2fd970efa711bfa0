"""A step's outcome on its way in: the lifecycle event on the run's history,
then the acknowledgement of the task's lease.

The engine's ``Report`` and a journal commit that settles its own task both
publish here, so one outcome has one Msg-Id whoever sends it, and a second
send (a retry, a claim that republishes a stored commit) is a duplicate the
HISTORY stream drops.

A stored journal commit's event takes one route, chosen in one place
(``commit_event_route``): a call to the engine of the journal service's own
process, when it takes commits' events and owns the run's partition (ADR 36),
else core NATS to one engine of the queue group on the run's slot subject,
served by the engines owning its partition (ADR 33). A route that does not answer within a
third of the commit's wait ends on the history, naming a notice inbox: the
stored commit is the durable fact, and the task message, still leased, stays
in the queue until the engine has applied the event or the event is on the
history.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, assert_never

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

# The share of the commit wait spent on the answer of the event's route
# before the event goes to the history; the rest waits for the history's
# engine. A route's answer takes one run write (milliseconds); the history's
# path takes a publish, a pull and the write, and keeps the larger share. The
# whole stays within the wait, plus the publish, as when every event went to
# the history (before the event to one engine, ADR 33).
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
    event = outcome_event(
        run_id=commit.run_id,
        step_id=commit.step_id,
        iteration=commit.iteration,
        attempt=commit.attempt,
        journal_seq=commit.seq,
        outcome=outcome,
        now=now,
    )
    event.build_id = commit.commit.build_id  # the step's build (pinned)
    return event


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
    def takes_commit_events(self) -> bool: ...

    def owns_run(self, run_id: str) -> bool: ...

    async def take_commit_event(self, event: ipb.HistoryEvent, *, wait: float) -> bytes | None: ...


# ---- the route of a commit's event ------------------------------------------------


@dataclass(frozen=True, slots=True)
class InProcess:
    """A call to ``engine``, the engine of this process, which takes
    commits' events now (ADR 36). Unanswered in its share of the wait: the
    history, without core NATS (the engine it would reach may be this one)."""

    engine: LocalEngine


@dataclass(frozen=True, slots=True)
class ToOneEngine:
    """Core NATS to one engine of the queue group (ADR 33), which tells the
    notice inbox its decision. Unanswered in its share of the wait (no engine
    subscribes, the send failed, or the engine was late): the history, naming
    the same inbox."""


CommitEventRoute = InProcess | ToOneEngine


def commit_event_route(local: LocalEngine | None, *, owned: bool) -> CommitEventRoute:
    """The route a stored commit's event takes first, ``local`` being the
    engine of this process, if any, and ``owned`` whether it owns the run's
    partition (else an engine that does, on the run's slot subject). Every
    route that does not answer within ``DIRECT_SHARE`` of the wait ends on
    the history, where the owner's engine reads: published there, naming a
    notice inbox the engine that applies it tells."""
    if local is not None and owned and local.takes_commit_events:
        return InProcess(local)
    return ToOneEngine()


class TaskSettler:
    """Settling the task of a stored journal commit, for the journal service
    (``dagnats.journal.peers.Tasks``): the commit's event, stamped by the
    engine's clock, then the lease released. ``local``: the engine of this
    process, which takes the events while it serves them (ADR 36)."""

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
        """Send the stored ``commit``'s event by its route, and publish it on
        the history when no engine answered within ``DIRECT_SHARE`` of
        ``wait``; then release the task: its outcome is in the run, or on the
        history, before the task goes.

        Raises:
            Exception: the event could not be published on the history.
        """
        told = await self._send(self._event(commit), wait * DIRECT_SHARE)
        told.cancel()
        await self._store.release(lease)

    async def keep(self, lease: str, commit: jpb.Record, *, wait: float) -> pb.Task | None:
        """Send the stored continue ``commit``'s event, its task message kept
        for the next iteration (ADR 31), by its route, and wait for the
        engine's decision: the next dispatch the message now carries, or
        None. When none came within ``DIRECT_SHARE`` of ``wait``, the event is
        published on the history, and the rest of ``wait`` is waited for the
        decision of the engine that applies it (or of the first one, late).
        None with the message released when it carries no current dispatch;
        None with the lease left to run out when no decision came (the
        message is then delivered again, carrying what the run says).

        Raises:
            Exception: the event could not be published on the history (the
                stored commit's event may be nowhere durable).
        """
        event = self._event(commit)
        event.kept_seq = lease_position(lease)[1]
        share = wait * DIRECT_SHARE
        told = await self._send(event, share)
        try:
            if not told.done():
                await asyncio.wait_for(asyncio.shield(told), wait - share)
        except TimeoutError:
            return None
        finally:
            told.cancel()
        decision = ipb.EventDecision.FromString(told.result())
        if decision.HasField("next"):
            return decision.next
        await self._store.release(lease)
        return None

    async def _send(self, event: ipb.HistoryEvent, share: float) -> asyncio.Future[bytes]:
        """Send ``event`` by its route (``commit_event_route``). The future of
        the engine's decision: done when it came within ``share`` seconds.
        Else the event is on the history, naming the notice inbox the future
        waits on (the caller cancels it when it stops waiting)."""
        local = self._local
        owned = local is not None and local.owns_run(event.run_id)
        match commit_event_route(local, owned=owned):
            case InProcess(engine=engine):
                # The decision is the call's answer: an inbox is needed only
                # if the history takes the event.
                await seam("after_commit_event_sent")
                decision = await engine.take_commit_event(event, wait=share)
                if decision is not None:
                    told: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
                    told.set_result(decision)
                    return told
                event.notify, told = await self._store.expect_notice()
            case ToOneEngine():
                event.notify, told = await self._store.expect_notice()
                try:
                    answered = await self._told_by_one_engine(event, told, share)
                except BaseException:
                    told.cancel()
                    raise
                if answered:
                    return told
            case unreachable:
                assert_never(unreachable)
        try:
            await self._store.publish_event(event, outcome_msg_id(event))
        except BaseException:
            told.cancel()
            raise
        return told

    async def _told_by_one_engine(
        self, event: ipb.HistoryEvent, told: asyncio.Future[bytes], share: float
    ) -> bool:
        """Send ``event`` to one engine over core NATS; whether its decision
        came on ``told`` within ``share`` seconds. False at once when no
        engine subscribes."""
        try:
            refused = await self._store.send_commit_event(event)
        except Exception as err:  # the connection is reconnecting: the history it is
            log.warning(
                "%s/%s: a commit's event was not sent: %r", event.run_id, event.step_id, err
            )
            return False
        try:
            await seam("after_commit_event_sent")
            await asyncio.wait({told, refused}, timeout=share, return_when=FIRST_COMPLETED)
        finally:
            refused.cancel()
        return told.done()

    async def release(self, lease: str) -> None:
        await self._store.release(lease)

    async def redeliver(self, lease: str) -> None:
        await self._store.redeliver(lease)
