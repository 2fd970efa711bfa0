"""A step's outcome on its way in: the lifecycle event on the run's history,
then the acknowledgement of the task's lease.

The engine's ``Report`` and a journal commit that settles its own task both
publish here, so one outcome has one Msg-Id whoever sends it, and a second
send (a retry, a claim that republishes a stored commit) is a duplicate the
HISTORY stream drops.
"""

from __future__ import annotations

import re
import secrets

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from dagnats.core import errors, tracing
from dagnats.core import jetstream as jsx
from dagnats.core.subjects import history_subject
from dagnats.core.timestamps import timestamp
from dagnats.engine import convert
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb

Outcome = pb.Continue | pb.Complete | pb.Fail | pb.Pause

# $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>, optionally
# with <domain>.<account hash> after ACK and a trailing random token.
_LEASE = re.compile(
    r"\$JS\.ACK\.(?:[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.)?TASKS\.tasks-[A-Za-z0-9_-]{1,64}"
    r"(?:\.[0-9]+){5}(?:\.[A-Za-z0-9_-]+)?"
)


def check_lease(lease: str) -> str:
    if not _LEASE.fullmatch(lease):
        raise errors.InvalidArgument("lease is not a task lease from PollTasks", field="lease")
    return lease


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


async def publish_outcome(
    js: JetStreamContext, nc: NATS, lease: str, event: ipb.HistoryEvent
) -> None:
    """Publish ``event`` on its run's history, then acknowledge the task."""
    kind = event.WhichOneof("kind")
    if event.attempt > 0:
        msg_id = f"{event.run_id}.{event.step_id}.{event.iteration}.{event.attempt}.{kind}"
    else:  # a legacy report, without a dispatch identity
        msg_id = f"{event.run_id}.{event.step_id}.legacy.{secrets.token_hex(8)}"
    await jsx.publish(
        js,
        history_subject(event.run_id),
        event.SerializeToString(),
        msg_id=msg_id,
        headers=dict(event.trace_context),
    )
    # The outcome is durable on the run's history: only now may the task go.
    await nc.publish(lease, b"+ACK")
