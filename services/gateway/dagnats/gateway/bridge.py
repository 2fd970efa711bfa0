"""The worker bridge: poll, heartbeat, the journal and resolve over HTTP.

A worker in any language polls for tasks, claims the task's journal with its
first journal action, makes its model and tool calls through the server-side
replay actions (or appends the records itself), and resolves the task. The
semantics are the Python SDK's: the same RPCs in the same order.

Invariants:

- Stateless: each call carries the task token (``bridge_token``) and each
  journal action answers with the next one, so any gateway replica can serve
  any call. A worker makes one call at a time per task and sends the latest
  token.
- The first journal action (read, append, or a replay action) claims. A claim
  the journal settles (``stale``, ``committed``, ``restart_limit``) is
  settled with the engine here, as the SDK does, and answers 410.
- Once claimed, resolve commits first and reports with the commit's
  sequence; a heartbeat first checks with the journal that the worker still
  holds the step, so a zombie never extends its successor's lease.
- A write the journal refuses (``Fenced``) never reaches the engine: the
  bridge neither reports nor acknowledges for a fenced worker. The answer
  says why: 409 ``cancelled`` (the run was cancelled), 410 ``committed`` or
  ``stale`` (the dispatch was finished by a successor, or the step moved
  on), else 409 ``fenced`` (a successor holds the step).
- A record too large for the journal fails the step for good at once, and
  answers 413 ``record_too_large`` saying so: every delivery would be refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_token
from dagnats.core.outcomes import Outcome
from dagnats.core.payload import encode
from dagnats.core.timestamps import duration
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import bridge_journal
from dagnats.gateway import bridge_models as bm
from dagnats.gateway import bridge_ops as ops
from dagnats.gateway.auth import bridge_auth
from dagnats.gateway.backend import Backend, BackendDep
from dagnats.gateway.bridge_token import BridgeToken
from dagnats.gateway.errors import ApiError
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.sdk.views import decode_payload

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid request or token; `field` names the problem"},
    401: {"description": "missing or wrong bridge bearer token"},
    409: {
        "description": "`fenced`: a successor holds the step; `cancelled`: the run was "
        "cancelled; `replay_mismatch`: another call was recorded at this position; "
        "`inputs_queued`: place the queued inputs instead of waiting for one"
    },
    410: {"description": "`stale`, `committed` or `restart_limit`: the task is finished"},
    413: {
        "description": "`too_large`: the body is larger than the gateway takes; "
        "`record_too_large`: a record larger than the journal stores, and the step failed"
    },
    503: {"description": "`not_provisioned`: the journal stream is missing; or `unavailable`"},
}

router = APIRouter(
    prefix="/bridge", dependencies=[Depends(bridge_auth)], tags=["bridge"], responses=ERRORS
)


# ---- tasks ----------------------------------------------------------------------------


@router.post("/poll", summary="Lease tasks, waiting up to `wait` for one")
async def poll(b: BackendDep, body: bm.PollBody) -> bm.PollResult:
    if body.wait > bm.MAX_POLL_WAIT:
        raise InvalidArgument(f"wait is at most {bm.MAX_POLL_WAIT:.0f}s", field="wait")
    for i, task_type in enumerate(body.task_types):
        check_token(task_type, field=f"task_types.{i}")
    wait = duration(body.wait)
    request = pb.PollTasksRequest(
        task_types=body.task_types,
        max_tasks=body.max_tasks,
        wait=wait,
        worker_id=body.worker_id,
        build_id=body.build_id,
    )
    # Never repeated on a timeout (EngineRpc): a poll that timed out on our
    # side may have leased tasks, and a second poll would lease more.
    response = await b.rpc.poll_tasks(request, deadline=body.wait + b.rpc.timeout)
    return bm.PollResult(tasks=[_leased(leased, body) for leased in response.tasks])


def _leased(leased: pb.LeasedTask, body: bm.PollBody) -> bm.LeasedTaskView:
    task = leased.task
    token = BridgeToken(
        lease=leased.lease,
        run_id=task.run_id,
        step_id=task.step_id,
        iteration=task.iteration,
        attempt=task.attempt,
        delivery=leased.delivery or 1,
        worker_id=body.worker_id,
        restart_limit=body.restart_limit,
        budget=task.budget if task.HasField("budget") else None,
        build_id=body.build_id,
    )
    view = bm.TaskView(
        run_id=task.run_id,
        step_id=task.step_id,
        task_type=task.task_type,
        iteration=task.iteration,
        attempt=task.attempt,
        workflow=task.workflow,
        input=decode_payload(task.input),
        trace_context=dict(task.trace_context),
        settings=dict(task.settings),
    )
    return bm.LeasedTaskView(
        task=view,
        token=token.encode(),
        delivery=token.delivery,
        lease_seconds=leased.lease_duration.ToTimedelta().total_seconds(),
    )


@router.post("/heartbeat", summary="Keep the task's lease; 409 when fenced or cancelled")
async def heartbeat(b: BackendDep, body: bm.TokenBody) -> bm.TokenResult:
    t = BridgeToken.decode(body.token)
    if t.writer is not None:
        await ops.holding(b, t)
    heartbeat = b.rpc.heartbeat(pb.HeartbeatRequest(lease=t.lease, run_id=t.run_id))
    response = await ops.refused_as_fenced(heartbeat)
    if response.cancelled:
        raise await ops.ended(b, t)
    return bm.TokenResult(token=body.token)


@router.post("/resolve", summary="Settle the task: commit (once claimed), then report")
async def resolve(b: BackendDep, body: bm.ResolveBody) -> bm.ResolveResult:
    t = BridgeToken.decode(body.token)
    field, outcome = _outcome(body)
    if body.wait is not None and body.wait.until_input and await _inputs_queued(b, t):
        raise ApiError(
            409, "inputs_queued", "inputs are queued for the step: place them and run a turn"
        )
    state = None
    if t.writer is not None:
        given = "state" in body.model_fields_set
        state = encode(body.state, field="state") if given else await ops.state_of(b, t)
    response, journal_seq = await ops.settle(b, t, field, outcome, state)
    if response.cancelled:
        raise ops.cancelled(t)
    if response.stale:
        raise ApiError(410, "stale", "the task is finished: the step has moved on")
    return bm.ResolveResult(outcome=body.outcome, journal_seq=journal_seq)


def _outcome(body: bm.ResolveBody) -> tuple[str, Outcome]:
    if body.wait is not None and body.outcome != "continue":
        raise InvalidArgument("wait goes with outcome continue", field="wait")
    if body.pause is not None and body.outcome != "pause":
        raise InvalidArgument("pause goes with outcome pause", field="pause")
    if body.pause is None and body.outcome == "pause":
        raise InvalidArgument("outcome pause needs pause (a duration)", field="pause")
    match body.outcome:
        case "continue":
            cont = pb.Continue(output=encode(body.output, field="output"))
            if body.wait is not None:
                cont.wait.CopyFrom(_wait(body.wait))
            return "continue", cont
        case "complete":
            return "complete", pb.Complete(output=encode(body.output, field="output"))
        case "pause":
            assert body.pause is not None
            if body.pause <= 0:
                raise InvalidArgument("pause must be positive", field="pause")
            return "pause", pb.Pause(duration=duration(body.pause))
        case _:
            permanent = body.outcome == "fail_permanent"
            kind = pb.FAILURE_KIND_PERMANENT if permanent else pb.FAILURE_KIND_RETRIABLE
            error = body.error or "the worker reported a failure"
            return "fail", pb.Fail(error=error, kind=kind, reason=body.reason)


def _wait(body: bm.WaitBody) -> pb.Wait:
    wait = pb.Wait(until_input=body.until_input)
    if body.delay is not None:
        wait.delay.CopyFrom(duration(body.delay))
    if body.until is not None:
        try:
            wait.until.FromDatetime(body.until)
        except (OverflowError, ValueError):
            raise InvalidArgument("wait.until is out of range", field="wait.until") from None
    return wait


async def _inputs_queued(b: Backend, t: BridgeToken) -> bool:
    queued = await b.rpc.list_inputs(
        ipb.ListRequest(run_id=t.run_id, step_id=t.step_id, status=ipb.STATUS_QUEUED)
    )
    return bool(queued.inputs)


# ---- checkpoints ------------------------------------------------------------------------


@router.post("/checkpoint/load", summary="The task's state and where it came from")
async def load_checkpoint(b: BackendDep, body: bm.TokenBody) -> bm.CheckpointLoadResult:
    t = BridgeToken.decode(body.token)
    if t.writer is not None:
        state = await ops.state_of(b, t)
        if state is None:
            return bm.CheckpointLoadResult(state=None, source="none")
        return bm.CheckpointLoadResult(state=decode_payload(state), source="journal")
    found = await b.rpc.load_checkpoint(
        pb.LoadCheckpointRequest(run_id=t.run_id, step_id=t.step_id)
    )
    if not found.found:
        return bm.CheckpointLoadResult(state=None, source="none")
    return bm.CheckpointLoadResult(state=decode_payload(found.state), source="checkpoint")


@router.post(
    "/checkpoint/save",
    summary="Save the task's state: in the token until the commit (journaled), or the store",
)
async def save_checkpoint(b: BackendDep, body: bm.CheckpointSaveBody) -> bm.CheckpointSaveResult:
    t = BridgeToken.decode(body.token)
    data = encode(body.state, field="state")
    if t.writer is not None:
        # Saved by the commit that ends the task, as the SDK does; a large
        # state is better sent with resolve than carried in every token.
        return bm.CheckpointSaveResult(token=replace(t, state=data).encode(), journaled=True)
    await b.rpc.save_checkpoint(
        pb.SaveCheckpointRequest(run_id=t.run_id, step_id=t.step_id, state=data, lease=t.lease)
    )
    return bm.CheckpointSaveResult(token=body.token, journaled=False)


# Last, so that the journal's routes follow these in the OpenAPI document.
router.include_router(bridge_journal.router)
