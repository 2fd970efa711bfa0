"""A step's outcome on its way in: the lifecycle event on the run's history,
then the acknowledgement of the task's lease.

The engine's ``Report`` and a journal commit that settles its own task both
publish here, so one outcome has one Msg-Id whoever sends it, and a second
send (a retry, a claim that republishes a stored commit) is a duplicate the
HISTORY stream drops.
"""

from __future__ import annotations

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


async def publish_outcome(store: EngineStore, lease: str, event: ipb.HistoryEvent) -> None:
    """Publish ``event`` on its run's history, then acknowledge the task."""
    kind = event.WhichOneof("kind")
    if event.attempt > 0:
        msg_id = f"{event.run_id}.{event.step_id}.{event.iteration}.{event.attempt}.{kind}"
    else:  # a legacy report, without a dispatch identity
        msg_id = f"{event.run_id}.{event.step_id}.legacy.{secrets.token_hex(8)}"
    await store.publish_event(event, msg_id)
    # The outcome is durable on the run's history: only now may the task go.
    await store.release(lease)


class TaskSettler:
    """Settling the task of a stored journal commit, for the journal service
    (``dagnats.journal.peers.Tasks``): the commit's event, stamped by the
    engine's clock, then the lease released."""

    def __init__(self, store: EngineStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock

    async def settle(self, lease: str, commit: jpb.Record) -> None:
        _, outcome = outcome_of(commit.commit)
        event = outcome_event(
            run_id=commit.run_id,
            step_id=commit.step_id,
            iteration=commit.iteration,
            attempt=commit.attempt,
            journal_seq=commit.seq,
            outcome=outcome,
            now=self._clock(),
        )
        await publish_outcome(self._store, lease, event)

    async def release(self, lease: str) -> None:
        await self._store.release(lease)

    async def redeliver(self, lease: str) -> None:
        await self._store.redeliver(lease)
