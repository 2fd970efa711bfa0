"""The journal claim of a leased task, built once for both of its senders: a
worker's ``Claim`` (``dagnats.sdk``) and the engine that claims a first
delivery with its lease (ADR 42)."""

from __future__ import annotations

from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.journal.v1 import journal_pb2 as jpb


def lease_claim(
    leased: epb.LeasedTask, *, worker_id: str, restart_limit: int, build_id: str = ""
) -> jpb.ClaimRequest:
    """The claim of ``leased``'s dispatch and delivery by ``worker_id``, a
    worker of ``build_id`` ("": unversioned) whose records carry it, to be
    stored with the holder's first record where it fences nothing (ADR 40);
    a claim the service settles is settled under ``leased.lease``."""
    task = leased.task
    return jpb.ClaimRequest(
        run_id=task.run_id,
        step_id=task.step_id,
        iteration=task.iteration,
        attempt=task.attempt,
        delivery=leased.delivery,
        worker_id=worker_id,
        restart_limit=restart_limit,
        lease=leased.lease,
        may_ride=True,
        build_id=build_id,
    )
