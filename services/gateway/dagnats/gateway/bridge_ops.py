"""What the bridge's routes share: claiming, settling a task the journal
settled, and turning a fenced journal call into the answer that says why.

A journal refusal (``Fenced``) is explained from the records that follow the
writer's last seen one by the pure rule ``dagnats.journal.replay.why_fenced``:
410 ``stale`` or ``committed`` when the task is finished, 409 ``fenced`` when a
successor holds it, and no refusal when the token was only behind a write of
its own. A cancelled run is 409 ``cancelled`` whatever the journal says, and
so is a journal call the journal refused because the run was cancelled
(``RunCancelled``: nothing was written).

A record too large for the journal (``RecordTooLarge``) would be refused on
every delivery: the step fails for good at once, and the answer, 413
``record_too_large``, says so. A replay mismatch stays a 409 the worker can
act on (the replay rules are the bridge client's own): it writes nothing.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Literal, TypeVar, cast

from dagnats.core.errors import Fenced, RecordTooLarge, RunCancelled
from dagnats.core.outcomes import Outcome, commit_of
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway.backend import Backend
from dagnats.gateway.bridge_token import BridgeToken
from dagnats.gateway.errors import ApiError, status_of
from dagnats.journal import convert, replay
from dagnats.journal.replay import FenceReason
from dagnats.journal.v1 import journal_pb2 as jpb

T = TypeVar("T")


async def claim(b: Backend, t: BridgeToken) -> tuple[BridgeToken, jpb.Claimed | None]:
    """Claim the task's journal unless ``t`` holds it already.

    Returns:
        The token that holds the journal, and the claim when this call made it.

    Raises:
        ApiError: 410 ``stale``, ``committed`` or ``restart_limit`` when the
            journal settled the task (it is then settled with the engine
            here); 409 ``cancelled`` when the run was cancelled.
    """
    if t.writer is not None:
        return t, None
    # A claim that loses to a concurrent claim is fenced: 409, like any write.
    response = await _unless_cancelled(
        t,
        b.rpc.claim(
            jpb.ClaimRequest(
                run_id=t.run_id,
                step_id=t.step_id,
                iteration=t.iteration,
                attempt=t.attempt,
                delivery=t.delivery,
                worker_id=t.worker_id,
                restart_limit=t.restart_limit,
                lease=t.lease,
                build_id=t.build_id,
            )
        ),
    )
    if response.HasField("settled"):
        raise await _settle(b, t, response.settled)
    claimed = response.claimed
    return replace(t, writer=claimed.token, has_state=claimed.has_state, position=0), claimed


async def _settle(b: Backend, t: BridgeToken, settled: jpb.Settled) -> ApiError:
    # The claim carried the lease: the journal service settles the task.
    run = (await b.rpc.get_run(pb.GetRunRequest(run_id=t.run_id))).run
    if run.status == pb.RUN_STATUS_CANCELLED:
        return cancelled(t)
    return _settled_answer(settled)


def _settled_answer(settled: jpb.Settled) -> ApiError:
    reason = settled.reason if settled.reason in ("stale", "committed") else "restart_limit"
    return ApiError(410, reason, settled.detail or f"the task is settled: {reason}")


async def writing(b: Backend, t: BridgeToken, call: Awaitable[T], *, intent_seq: int = 0) -> T:
    """Await a journal write; a refusal becomes the answer that says why.
    ``intent_seq``: the intent the write answers, if it is a tool's result."""
    try:
        return await call
    except RunCancelled:
        raise cancelled(t) from None
    except Fenced as err:
        reason = await why_fenced(b, t)
        if reason == "own":
            raise ApiError(
                409, "fenced", "the token is behind the journal: send the latest token"
            ) from None
        raise _explained(t, reason, err) from None
    except RecordTooLarge as err:
        raise await _failed_for_good(b, t, err, intent_seq or t.intent_seq) from None


async def _failed_for_good(
    b: Backend, t: BridgeToken, err: RecordTooLarge, intent_seq: int
) -> ApiError:
    """Fail the step for a record too large for the journal: every delivery
    and attempt would be refused the same way, so it fails now, with the
    refusal's message, as the SDK's worker fails it. A running tool's intent
    is answered first with that error, as the SDK answers it; the failure
    carries no state, so it fits any record."""
    assert t.writer is not None  # only a holder writes records
    t = replace(t, intent_seq=0)
    message = f"{type(err).__name__}: {err.message}"
    if intent_seq:
        error = f"tool result not recorded: {err.message}"
        finish = jpb.FinishToolRequest(token=t.writer, intent_seq=intent_seq, error=error)
        t = replace(t, writer=(await writing(b, t, b.rpc.finish_tool(finish))).token)
    failure = pb.Fail(error=message, kind=pb.FAILURE_KIND_PERMANENT, reason=err.code)
    await settle(b, t, "fail", failure, None)
    return ApiError(status_of(err), err.code, f"{err.message}; the step failed", field=err.field)


async def settle(
    b: Backend, t: BridgeToken, field: str, outcome: Outcome, state: bytes | None
) -> tuple[pb.ReportResponse, int]:
    """Report ``outcome`` (the ``ReportRequest`` field ``field``) of ``t``'s
    dispatch. A holder commits it first, with ``state``, and the report
    names the commit; a commit the journal refused because the run was
    cancelled stored nothing, and the task is let go. Returns the engine's
    answer and the commit's sequence (0 without a journal)."""
    request = pb.ReportRequest(
        lease=t.lease,
        run_id=t.run_id,
        step_id=t.step_id,
        iteration=t.iteration,
        attempt=t.attempt,
    )
    getattr(request, field).CopyFrom(outcome)
    if t.writer is not None:
        commit = jpb.CommitRequest(token=t.writer, commit=commit_of(outcome, state))
        commit.commit.build_id = t.build_id  # the engine pins the step to it
        try:
            done = await writing(b, t, b.rpc.commit(commit))
        except ApiError as refused:
            if refused.code == "cancelled":
                await let_go(b, t)
            raise
        request.journal_seq = done.commit_seq
    return await refused_as_fenced(b.rpc.report(request)), request.journal_seq


async def holding(b: Backend, t: BridgeToken) -> None:
    """Check that ``t`` still holds the step. A token behind only this
    worker's own writes (a heartbeat that raced a write) still holds it."""
    assert t.writer is not None
    try:
        await b.rpc.check_tail(jpb.CheckTailRequest(token=t.writer))
    except RunCancelled:
        raise cancelled(t) from None
    except Fenced as err:
        reason = await why_fenced(b, t)
        if reason != "own":
            raise _explained(t, reason, err) from None


async def why_fenced(b: Backend, t: BridgeToken) -> FenceReason | Literal["cancelled"]:
    """Why the journal refused ``t``'s writer (see the module docstring)."""
    run = (await b.rpc.get_run(pb.GetRunRequest(run_id=t.run_id))).run
    if run.status == pb.RUN_STATUS_CANCELLED:
        return "cancelled"
    assert t.writer is not None
    writer = t.writer
    async with records_from(b, t, writer.last_seq + 1) as records:
        entries = convert.all_entries([record async for record in records])
    return replay.why_fenced(
        entries, writer=writer.writer, dispatch=(writer.iteration, writer.attempt)
    )


def _explained(t: BridgeToken, reason: str, err: Fenced) -> ApiError:
    if reason == "cancelled":
        return cancelled(t)
    if reason == "stale":
        return ApiError(410, "stale", "the task is finished: the step has moved on")
    if reason == "committed":
        return ApiError(410, "committed", "the task is finished: a successor committed it")
    return fenced(err)


def fenced(err: Fenced) -> ApiError:
    """The answer to a write or a report the journal or the engine refused."""
    return ApiError(409, "fenced", err.message)


async def refused_as_fenced(call: Awaitable[T]) -> T:
    """Await an engine call that refuses a fenced holder (``Report``,
    ``Heartbeat``): its refusal is the bridge's 409 ``fenced``."""
    try:
        return await call
    except Fenced as err:
        raise fenced(err) from None


async def _unless_cancelled(t: BridgeToken, call: Awaitable[T]) -> T:
    """Await a journal call; its refusal of a cancelled run is 409 ``cancelled``,
    a fenced one 409 ``fenced``."""
    try:
        return await refused_as_fenced(call)
    except RunCancelled:
        raise cancelled(t) from None


@asynccontextmanager
async def records_from(
    b: Backend, t: BridgeToken, from_seq: int, *, limit: int = 0
) -> AsyncIterator[AsyncIterator[jpb.Record]]:
    """The step's records from ``from_seq`` on (at most ``limit`` when
    positive); leaving early ends the read."""
    stream = b.journal.read(t.run_id, t.step_id, from_seq=from_seq, limit=limit)
    try:
        yield stream
    finally:
        # JournalClient.read is an async generator: closing it cancels the RPC.
        await cast(AsyncGenerator[jpb.Record, None], stream).aclose()


async def let_go(b: Backend, t: BridgeToken) -> None:
    """Acknowledge the task of a cancelled run, whose journal refused its
    commit: the run drops any outcome, and the task would wait out its lease."""
    request = pb.ReportRequest(lease=t.lease, run_id=t.run_id, step_id=t.step_id)
    request.acknowledge.SetInParent()
    await refused_as_fenced(b.rpc.report(request))


def cancelled(t: BridgeToken) -> ApiError:
    """The answer for a task whose run was cancelled."""
    return ApiError(409, "cancelled", f"run {t.run_id} was cancelled")


async def ended(b: Backend, t: BridgeToken) -> ApiError:
    """The answer for a task whose run is no longer running. (Heartbeat and an
    acknowledging report say ``cancelled`` for any run that is not running.)"""
    run = (await b.rpc.get_run(pb.GetRunRequest(run_id=t.run_id))).run
    if run.status == pb.RUN_STATUS_CANCELLED:
        return cancelled(t)
    return ApiError(410, "stale", f"the task is finished: run {t.run_id} has ended")


async def state_of(b: Backend, t: BridgeToken) -> bytes | None:
    """The state a commit of ``t`` carries unless told otherwise: one saved
    since the claim, else the one the claim loaded (the last commit's).

    Every commit carries the state forward, because a claim loads the state
    of the commit right before its iteration only.
    """
    if t.state is not None:
        return t.state
    if t.writer is None or not t.has_state:
        return None
    # Rebuilt from its chain: the base commit may store it as a delta.
    return await b.journal.state(t.run_id, t.step_id, at_seq=t.writer.base_seq)
