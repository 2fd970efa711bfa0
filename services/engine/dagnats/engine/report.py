"""A step's outcome on its way in: the lifecycle event on the run's history,
then the acknowledgement of the task's lease.

The engine's ``Report`` and a journal commit that settles its own task both
publish here, so one outcome has one Msg-Id whoever sends it, and a second
send (a retry, a claim that republishes a stored commit) is a duplicate the
HISTORY stream drops.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from dagnats.core import tracing
from dagnats.core.outcomes import outcome_of
from dagnats.core.timestamps import timestamp
from dagnats.engine import convert
from dagnats.engine.store import EngineStore
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb

Outcome = pb.Continue | pb.Complete | pb.Fail | pb.Pause


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


class TaskSettler:
    """Settling the task of a stored journal commit, for the journal service
    (``dagnats.journal.peers.Tasks``): the commit's event, stamped by the
    engine's clock, then the lease released."""

    def __init__(self, store: EngineStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock

    def _event(self, commit: jpb.Record) -> ipb.HistoryEvent:
        """The lifecycle event of a stored commit, stamped by the engine's clock."""
        _, outcome = outcome_of(commit.commit)
        return outcome_event(
            run_id=commit.run_id,
            step_id=commit.step_id,
            iteration=commit.iteration,
            attempt=commit.attempt,
            journal_seq=commit.seq,
            outcome=outcome,
            now=self._clock(),
        )

    async def settle(self, lease: str, commit: jpb.Record) -> None:
        await publish_outcome(self._store, lease, self._event(commit))

    async def hold(self, lease: str, commit: jpb.Record, *, wait: float) -> pb.Task | None:
        """Publish the stored continue ``commit``'s event with its task message
        kept for the next iteration (ADR 31), and wait up to ``wait`` seconds
        for the engine's decision: the next dispatch the message now carries,
        or None. None with the message released when it carries no current
        dispatch; None with the lease left to run out when no decision came
        (the message is then delivered again, carrying what the run says)."""
        event = self._event(commit)
        event.held_seq = lease_position(lease)[1]
        event.notify, told = await self._store.expect_notice()
        try:
            await self._store.publish_event(event, outcome_msg_id(event))
            data = await asyncio.wait_for(told, wait)
        except TimeoutError:
            return None
        finally:
            told.cancel()
        decision = ipb.HeldDecision.FromString(data)
        if decision.HasField("next"):
            return decision.next
        await self._store.release(lease)
        return None

    async def release(self, lease: str) -> None:
        await self._store.release(lease)

    async def redeliver(self, lease: str) -> None:
        await self._store.redeliver(lease)
