"""The REST API: workflows, runs, inputs and the journal.

Every route needs the API token (when one is configured). Every id and
number is validated here first, with the rules the gRPC services apply
(``dagnats.core.ids``), so a bad one is a 400 naming the field before any
service is called, and an id the API accepts can be addressed again. Bodies
are JSON, whatever content type they are sent with; the JSON shapes of the
answers are ``dagnats.sdk.views``, the same as ``dagnats ... --json``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dagnats.core.budget_wire import budget_to_proto
from dagnats.core.durations import parse_duration
from dagnats.core.errors import InvalidArgument, NotFound
from dagnats.core.ids import (
    MAX_SEQ,
    check_request_id,
    check_run_id,
    check_seq,
    check_token,
    parse_seq,
)
from dagnats.core.payload import encode
from dagnats.core.run_settings import check_settings
from dagnats.core.usage import parse_budget
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import approvals, journal_stream, live_stream, run_watch, runs_stream
from dagnats.gateway.auth import api_auth
from dagnats.gateway.backend import BackendDep
from dagnats.gateway.rundiff import run_diff
from dagnats.inputs.rules import MAX_WAIT
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.sdk import InputMode
from dagnats.sdk.export import MEDIA_TYPE, open_export
from dagnats.sdk.views import (
    check_dict,
    decode_payload,
    input_dict,
    record_dict,
    run_dict,
    usage_dict,
    workflow_dict,
)

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid request; `field` names the problem"},
    401: {"description": "missing or wrong bearer token"},
    404: {"description": "no such workflow, run, step or input"},
    409: {"description": "the request contradicts the current state"},
    413: {"description": "the body is too large"},
    503: {"description": "a backend service cannot be reached"},
}

router = APIRouter(dependencies=[Depends(api_auth)], responses=ERRORS)

# The page sizes of the journal.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
# The most runs a live list holds (the engine's WatchRuns limit).
MAX_LIVE_RUNS = 1000


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartRun(_Body):
    workflow: str = Field(min_length=1, max_length=64, description="a registered workflow")
    input: Any = Field(default=None, description="the run's input, any JSON value")
    idempotency_key: str = Field(
        default="", max_length=256, description="a repeat with the same key returns the first run"
    )
    settings: dict[str, str] = Field(
        default_factory=dict,
        description="settings its handlers read (`tc.settings`): at most 32 names of 1-64 "
        "characters of A-Z a-z 0-9 _ -, each value at most 1024 bytes",
    )
    budget: dict[str, Any] | None = Field(
        default=None,
        description=(
            'what the run\'s model calls may spend: {"tokens": N, "cost": X, "policy": '
            '"fail" | "pause"}; the workflow\'s budget when unset'
        ),
    )


class ForkRun(_Body):
    step_id: str = Field(min_length=1, max_length=64, description="the step whose journal to copy")
    at_seq: int = Field(ge=1, le=MAX_SEQ, description="the last record copied: its sequence")
    input: Any = Field(default=None, description="the new run's input (null: the source's)")
    settings: dict[str, str] = Field(
        default_factory=dict,
        description="settings set on top of the source's; an empty value removes one",
    )
    steer: Any = Field(default=None, description="a steering input the forked step places")
    idempotency_key: str = Field(
        default="", max_length=256, description="a repeat with the same key answers the same run"
    )


class CancelRun(_Body):
    reason: str = Field(default="", max_length=1024)


class UpgradeRun(_Body):
    build_id: str = Field(
        min_length=1,
        max_length=64,
        description="the worker build to move the run to: A-Z, a-z, 0-9, '_' or '-'",
    )


class SubmitInput(_Body):
    request_id: str = Field(
        min_length=1, max_length=256, description="the caller's id; a repeat returns the original"
    )
    mode: Literal["steer", "follow_up", "budget"] = "steer"
    content: Any = Field(
        description='any JSON value; for `budget`, {"tokens": N, "cost": X} to add to the budget'
    )


class DecideApproval(_Body):
    call: str = Field(
        min_length=1,
        max_length=512,
        description="the waiting call's key: run.step.iteration.position",
    )
    digest: str = Field(
        min_length=1, max_length=128, description="the digest of the call the approver saw"
    )
    decision: Literal["approve", "deny"]
    reason: str = Field(default="", max_length=4096, description="a denial's reaches the model")
    approver: str = Field(default="", max_length=256, description="who decides, as recorded")
    args: Any = Field(
        default=None,
        description="edited arguments to run instead (approve only): a new digest, "
        "approved by this act",
    )
    request_id: str = Field(
        default="",
        max_length=256,
        description="the caller's id; a repeat returns the original (default: one per act)",
    )


def _run_id(run_id: str) -> str:
    return check_run_id(run_id, field="run_id")


def _step_id(step_id: str) -> str:
    return check_token(step_id, field="step_id")


def _request_id(request_id: str) -> str:
    return check_request_id(request_id)


def _run_status(name: RunStatusName) -> pb.RunStatus.ValueType:
    return pb.RunStatus.Value(f"RUN_STATUS_{name.upper()}")


ValidRun = Annotated[str, Depends(_run_id)]
ValidStep = Annotated[str, Depends(_step_id)]
ValidRequest = Annotated[str, Depends(_request_id)]

RunStatusName = Literal["running", "completed", "failed", "cancelled"]
InputStatus = Literal["queued", "placed", "done", "unanswered", "withdrawn", "dropped", "expired"]


# ---- workflows --------------------------------------------------------------------


@router.post("/workflows", tags=["workflows"], summary="Register a workflow definition")
async def apply_workflow(
    b: BackendDep,
    document: Annotated[dict[str, Any], Body(description="the workflow definition")],
) -> dict[str, Any]:
    return workflow_dict(await b.client.register_workflow(document))


@router.get("/workflows", tags=["workflows"], summary="List workflows")
async def list_workflows(b: BackendDep) -> dict[str, Any]:
    return {"workflows": [workflow_dict(w) for w in await b.client.list_workflows()]}


@router.get("/workflows/{name}", tags=["workflows"], summary="Get a workflow")
async def get_workflow(b: BackendDep, name: str) -> dict[str, Any]:
    check_token(name, field="name")
    return workflow_dict(await b.client.get_workflow(name))


# ---- runs -------------------------------------------------------------------------


@router.post(
    "/runs",
    tags=["runs"],
    summary="Start a run",
    status_code=201,
    responses={200: {"description": "a run with this idempotency key existed; it is returned"}},
)
async def start_run(
    b: BackendDep,
    body: StartRun,
    idempotency_key: Annotated[str, Header(max_length=256)] = "",
) -> JSONResponse:
    check_token(body.workflow, field="workflow")
    key = body.idempotency_key or idempotency_key
    request = pb.StartRunRequest(
        workflow=body.workflow,
        input=encode(body.input, field="input"),
        idempotency_key=key,
        settings=check_settings(body.settings),
    )
    if body.budget is not None:
        request.budget.CopyFrom(budget_to_proto(parse_budget(body.budget)))
    response = await b.api.start_run(request)
    return JSONResponse(run_dict(response.run), status_code=201 if response.created else 200)


@router.post(
    "/runs/{run_id}/fork",
    tags=["runs"],
    summary="Fork a run from a record of a step's journal",
    status_code=201,
    description=(
        "A new run whose step `step_id` starts with a copy of this run's records of it through "
        "`at_seq`: the recorded model responses and tool results are replayed, so nothing "
        "before that record runs again; then it runs on with the changes (`input`, "
        "`settings`, a `steer` input). The steps it depends on are carried over as "
        "completed. Answers the new run and `copied`, the records copied; 200 when the "
        "idempotency key named a fork made before."
    ),
    responses={200: {"description": "a fork with this idempotency key existed; it is returned"}},
)
async def fork_run(b: BackendDep, run_id: ValidRun, body: ForkRun) -> JSONResponse:
    step_id = check_token(body.step_id, field="step_id")
    answer = await b.client.fork_run(
        run_id,
        step_id,
        check_seq(body.at_seq, field="at_seq"),
        input=body.input,
        settings=check_settings(body.settings),
        steer=body.steer,
        idempotency_key=body.idempotency_key,
    )
    found = {**run_dict(answer.run), "copied": answer.copied}
    return JSONResponse(found, status_code=201 if answer.created else 200)


@router.get(
    "/runs/{run_id}/diff/{other}",
    tags=["runs"],
    summary="Two runs' journals side by side, from their common prefix",
    description=(
        "For each step, how many entries both journals share from the start (`common`) "
        "and the rest side by side (`rows`, each with `a` and `b`: the entry's `seq`, "
        "`kind`, `iteration` and `text`, or null); and both runs' outcomes."
    ),
)
async def diff_runs(b: BackendDep, run_id: ValidRun, other: str) -> dict[str, Any]:
    return await run_diff(b.client, b.journal, run_id, check_run_id(other, field="other"))


@router.get("/runs", tags=["runs"], summary="List runs, newest first")
async def list_runs(
    b: BackendDep,
    workflow: Annotated[str, Query(max_length=64)] = "",
    status: RunStatusName | None = None,
    limit: Annotated[int, Query(ge=0, le=10_000)] = 0,
) -> dict[str, Any]:
    if workflow:
        check_token(workflow, field="workflow")
    runs = await b.client.list_runs(
        workflow=workflow, status=_run_status(status) if status else None, limit=limit
    )
    return {"runs": [run_dict(r) for r in runs]}


# Before /runs/{run_id}: "events" is no run id, and this path is matched first.
@router.get(
    "/runs/events",
    tags=["runs"],
    summary="A live list of runs, as server-sent events",
    description=(
        "The runs `GET /runs` lists (newest first, at most `limit`, default 100, at most "
        "1000), kept up to date: one event `runs` (data: `runs`, the whole list) first, then "
        "an event `change` (data: `runs` that changed or entered the list, `removed`: ids of "
        "runs that left it) as runs are stored. A run leaves when its status no longer "
        "matches `status`, when newer runs push it out, or when it is purged; an older run "
        "does not take its place. Runs here have no input or outputs (`null`; "
        "`GET /runs/{run_id}` has them). Another event `runs` replaces the list (the "
        "engine's stream was opened anew). An event `error` (data: `code`, `message`) ends "
        "a stream whose engine could not be reached. The engine pushes every change; the "
        "gateway does not poll. Changes are coalesced per run while a client reads, so a "
        "slow client gets each run's latest state, not a backlog."
    ),
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def runs_events(
    request: Request,
    b: BackendDep,
    workflow: Annotated[str, Query(max_length=64)] = "",
    status: RunStatusName | None = None,
    limit: Annotated[int, Query(ge=0, le=MAX_LIVE_RUNS)] = 0,
) -> Response:
    if workflow:
        check_token(workflow, field="workflow")
    feed, first = await runs_stream.first_list(
        b.client, workflow=workflow, status=_run_status(status) if status else None, limit=limit
    )
    return StreamingResponse(
        runs_stream.events(request, feed, first),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get(
    "/runs/{run_id}",
    tags=["runs"],
    summary="Get a run and its steps, waiting up to `wait` for its status to change",
    description=(
        "With `wait`, the answer comes when the run's status differs from `if_status` "
        "(the status the caller last saw), at once when it already does, or when `wait` "
        "runs out (200 with the run as it is then). Without `if_status` it waits for a "
        "change from the status on arrival: a running run answers when it ends. The "
        "engine pushes the change; the gateway does not poll."
    ),
)
async def get_run(
    b: BackendDep,
    run_id: ValidRun,
    wait: Annotated[str, Query(description="e.g. 30s, 500ms; at most 60s")] = "0s",
    if_status: Annotated[
        RunStatusName | None, Query(description="the status the caller last saw")
    ] = None,
) -> dict[str, Any]:
    seconds = parse_duration(wait, field="wait", maximum=MAX_WAIT)
    if not seconds:
        return run_dict(await b.client.get_run(run_id))
    seen = _run_status(if_status) if if_status else None
    return run_dict(await run_watch.wait_for_change(b.client, run_id, seconds, seen))


@router.get(
    "/runs/{run_id}/usage",
    tags=["runs"],
    summary="What a run's model calls spent, per step and in total",
    description=(
        "Read from the run's journals (the usage ledger): for the run and each step, "
        "`spent` (every call), `kept` (calls whose response the journal keeps), `retried` "
        "(calls of an attempt a retry replaced) and `fenced` (calls of a holder the fence "
        "stopped), each with `calls`, `input_tokens` (cached ones included), "
        "`output_tokens`, `cached_tokens` and `cost` (priced calls only, in the currency "
        "of the journal's price table); each step's spent usage `by_model`."
    ),
)
async def get_run_usage(b: BackendDep, run_id: ValidRun) -> dict[str, Any]:
    return usage_dict(await b.client.run_usage(run_id))


@router.get(
    "/runs/{run_id}/events",
    tags=["runs"],
    summary="A run's changes, as server-sent events",
    description=(
        "One event `run` (data: the run, as `GET /runs/{run_id}` answers it) at once, then "
        "one each time the run changes: its status, output or error, or a step's status, "
        "iteration, attempt, output, error or wait. After the run's final state one event "
        "`end` (data: `status`) closes the stream; a client should not reconnect after it. "
        "A reconnect gets the run as it is then, first. An event `error` (data: `code`, "
        "`message`) ends a stream whose engine could not be reached."
    ),
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def run_events(request: Request, b: BackendDep, run_id: ValidRun) -> Response:
    watch, first = await run_watch.first_state(b.client, run_id)
    return StreamingResponse(
        run_watch.events(request, watch, first),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post("/runs/{run_id}/cancel", tags=["runs"], summary="Cancel a run and its child runs")
async def cancel_run(
    b: BackendDep, run_id: ValidRun, body: CancelRun | None = None
) -> dict[str, Any]:
    reason = body.reason if body else ""
    return run_dict(await b.client.cancel_run(run_id, reason))


@router.post(
    "/runs/{run_id}/upgrade",
    tags=["runs"],
    summary="Move a running run to another worker build",
    description=(
        "Each step that recorded a build goes to `build_id`; a pinned step whose task "
        "waits for its old build (`waiting_for_build`) is dispatched again to the new one. "
        "409 when the run has ended."
    ),
)
async def upgrade_run(b: BackendDep, run_id: ValidRun, body: UpgradeRun) -> dict[str, Any]:
    return run_dict(await b.client.upgrade_run(run_id, body.build_id))


@router.delete("/runs/{run_id}", tags=["runs"], summary="Purge a finished run", status_code=204)
async def purge_run(b: BackendDep, run_id: ValidRun) -> Response:
    await b.client.purge_run(run_id)
    return Response(status_code=204)


@router.get("/runs/{run_id}/journal/check", tags=["journal"], summary="Audit a run's journal")
async def check_journal(b: BackendDep, run_id: ValidRun) -> dict[str, Any]:
    return check_dict(await b.journal.check(run_id))


@router.get(
    "/runs/{run_id}/journal/export",
    tags=["journal"],
    summary="A run's journal as a file: the journal export (JSON lines)",
    description=(
        "Every record of every journaled step of the run, as `dagnats journal export` writes "
        "them: a header line (`format` `dagnats.journal`, `version` 1, the run, its workflow, "
        "input and steps, each step's task type and input), a line per record (`step_id`, "
        '`seq`, `record`: the record as protobuf JSON), then `{"end": true, "records": N}`. '
        "It streams; an answer without its end line was cut short. 404 for a missing run or "
        "a run none of whose steps has a journal. `dagnats.sdk.testing.replay` reads it."
    ),
    responses={200: {"content": {MEDIA_TYPE: {}}}},
)
async def export_journal(b: BackendDep, run_id: ValidRun) -> Response:
    export = await open_export(b.client, b.journal, run_id)
    return StreamingResponse(
        export.lines(b.journal),
        media_type=MEDIA_TYPE,
        headers={"Content-Disposition": f'attachment; filename="{run_id}.jsonl"'},
    )


# ---- inputs -----------------------------------------------------------------------

_MODES = {
    "steer": InputMode.STEER,
    "follow_up": InputMode.FOLLOW_UP,
    "budget": InputMode.BUDGET,
}


@router.post(
    "/runs/{run_id}/steps/{step_id}/inputs",
    tags=["inputs"],
    summary="Submit an input to a running step",
    status_code=201,
    responses={200: {"description": "a repeat of the request_id; the original is returned"}},
)
async def submit_input(
    b: BackendDep, run_id: ValidRun, step_id: ValidStep, body: SubmitInput
) -> JSONResponse:
    check_request_id(body.request_id)
    item, created = await b.client.submit_input(
        run_id, step_id, body.request_id, body.content, mode=_MODES[body.mode]
    )
    return JSONResponse(input_dict(item), status_code=201 if created else 200)


@router.get(
    "/runs/{run_id}/steps/{step_id}/approvals",
    tags=["approvals"],
    summary="List the tool calls waiting for approval, with their arguments",
)
async def list_approvals(b: BackendDep, run_id: ValidRun, step_id: ValidStep) -> dict[str, Any]:
    await _require_step(b, run_id, step_id)
    return {"approvals": await approvals.waiting(b.journal, run_id, step_id)}


@router.post(
    "/runs/{run_id}/steps/{step_id}/approvals",
    tags=["approvals"],
    summary="Approve or deny a tool call waiting for approval",
    description=(
        "The approval is bound to the call's arguments: `digest` must be the digest of "
        "the waiting call (as listed), else the answer is 409 with the reason and nothing "
        "changes. `args` approves edited arguments instead. The decision reaches the step "
        "as an input of mode `approval` and is recorded in its journal when the call runs."
    ),
    status_code=201,
    responses={200: {"description": "a repeat of the request_id; the original is returned"}},
)
async def decide_approval(
    b: BackendDep, run_id: ValidRun, step_id: ValidStep, body: DecideApproval
) -> JSONResponse:
    act = approvals.act(
        run_id,
        step_id,
        call=body.call,
        digest=body.digest,
        approve=body.decision == "approve",
        approver=body.approver,
        reason=body.reason,
        args=body.args,
        edited="args" in body.model_fields_set and body.args is not None,
    )
    if body.request_id:
        check_request_id(body.request_id)
    await _require_step(b, run_id, step_id)
    decided = await approvals.decide(
        b.client, b.journal, run_id, step_id, act, request_id=body.request_id
    )
    return JSONResponse(decided.to_dict(), status_code=201 if decided.created else 200)


@router.get("/runs/{run_id}/steps/{step_id}/inputs", tags=["inputs"], summary="List inputs")
async def list_inputs(b: BackendDep, run_id: ValidRun, step_id: ValidStep) -> dict[str, Any]:
    await _require_step(b, run_id, step_id)
    response = await b.api.list_inputs(ipb.ListRequest(run_id=run_id, step_id=step_id))
    return {"inputs": [input_dict(i) for i in response.inputs]}


@router.get(
    "/runs/{run_id}/steps/{step_id}/inputs/{request_id}",
    tags=["inputs"],
    summary="Get an input's status, waiting up to `wait` for a change",
    description=(
        "With `wait`, the answer comes when the status differs from `if_status` (the "
        "status the caller last saw), at once when it already does, or when `wait` "
        "runs out. Without `if_status` it waits for a change from the status on arrival, "
        "so a change just before the request is missed: pass `if_status`."
    ),
)
async def get_input(
    b: BackendDep,
    run_id: ValidRun,
    step_id: ValidStep,
    request_id: ValidRequest,
    wait: Annotated[str, Query(description="e.g. 30s, 500ms; at most 60s")] = "0s",
    if_status: Annotated[
        InputStatus | None, Query(description="the status the caller last saw")
    ] = None,
) -> dict[str, Any]:
    seconds = parse_duration(wait, field="wait", maximum=MAX_WAIT)
    seen = ipb.Status.Value(f"STATUS_{if_status.upper()}") if if_status else ipb.STATUS_UNSPECIFIED
    item = await b.client.get_input(run_id, step_id, request_id, wait=seconds, if_status=seen)
    return input_dict(item)


@router.delete(
    "/runs/{run_id}/steps/{step_id}/inputs/{request_id}",
    tags=["inputs"],
    summary="Withdraw a queued input (409 once placed)",
    status_code=204,
)
async def withdraw_input(
    b: BackendDep, run_id: ValidRun, step_id: ValidStep, request_id: ValidRequest
) -> Response:
    await b.client.withdraw_input(run_id, step_id, request_id)
    return Response(status_code=204)


# ---- journal ----------------------------------------------------------------------


@router.get(
    "/runs/{run_id}/steps/{step_id}/journal",
    tags=["journal"],
    summary="A step's journal records: a JSON page, or server-sent events",
    description=(
        "Without `follow`, a JSON page of records from sequence `from`. With `follow=1` "
        "or `Accept: text/event-stream`, server-sent events: each event `record` has the "
        "record's sequence as its `id` and the record as its data; a reconnect with "
        "`Last-Event-ID` resumes right after that record. A record that also holds the "
        "model response or tool result stored just before its `kind` names that body in "
        "`leading` (`leading_model`, `leading_tool_result`); the first record of a dispatch "
        "handed to its holder with the commit before it also holds that dispatch's claim, "
        "`leading_claim`. A commit with action `continue` "
        "ends an iteration. Once the step has finished and every record was sent, one "
        "event `end` (data: `run_status`, `step_status`) closes the stream; "
        "a client should not reconnect after it."
    ),
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def read_journal(
    request: Request,
    b: BackendDep,
    run_id: ValidRun,
    step_id: ValidStep,
    from_: Annotated[
        int, Query(alias="from", description=f"a record sequence, 0 to {MAX_SEQ}")
    ] = 0,
    follow: bool = False,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    check_seq(from_, field="from")
    start = from_
    if last_event_id:
        start = check_seq(
            parse_seq(last_event_id, field="Last-Event-ID") + 1, field="Last-Event-ID"
        )
    await _require_step(b, run_id, step_id)
    streaming = follow or "text/event-stream" in request.headers.get("accept", "")
    if streaming:
        return StreamingResponse(
            journal_stream.events(request, b, run_id, step_id, start),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    records = []
    async for record in b.journal.read(run_id, step_id, from_seq=from_):
        records.append(record_dict(record))
        if len(records) == limit:
            break
    next_from = records[-1]["seq"] + 1 if records else from_
    return JSONResponse({"records": records, "next": int(next_from)})


@router.get(
    "/runs/{run_id}/steps/{step_id}/state",
    tags=["journal"],
    summary="A step's state at a commit",
    description=(
        "The state of record a step's commit stored, rebuilt from its chain: a commit "
        "stores the state whole (`state`) or as a delta against the commit before it "
        "(`state_delta`: the first `keep` bytes of that state, then `tail`). `at` is the "
        "commit's sequence; 0 (the default) is the step's last commit that ended an "
        "iteration. Answers `seq`, `has_state` and `state` (null without one)."
    ),
)
async def read_state(
    b: BackendDep,
    run_id: ValidRun,
    step_id: ValidStep,
    at: Annotated[int, Query(description=f"a commit's sequence, 0 to {MAX_SEQ}")] = 0,
) -> JSONResponse:
    check_seq(at, field="at")
    await _require_step(b, run_id, step_id)
    state = await b.journal.state(run_id, step_id, at_seq=at)
    found = decode_payload(state) if state is not None else None
    return JSONResponse({"seq": at, "has_state": state is not None, "state": found})


_STREAM_EVENT_ID = re.compile(
    r"[0-9a-f]{16}\.[0-9]{1,4}\.([0-9]{1,19}|committed|abandoned)|journal\.[0-9]{1,19}"
)


@router.get(
    "/runs/{run_id}/steps/{step_id}/stream",
    tags=["journal"],
    summary="A step's live token stream, as server-sent events",
    description=(
        "The live preview a worker sends with `put_stream` or a streamed model call: "
        "events `token` (data: `text` or `json`, `seq`, `position`, `writer`, `stream`, and "
        "`retry_of` on a retry of an abandoned stream), `committed` (the model record's "
        "`record_seq` and `response`), `abandoned` (`reason`: `failed` or `superseded`) and "
        "`gap` (`first_seq`..`last_seq` of a stream, `dropped`: chunks this reader lost "
        "by falling behind; markers are never lost). "
        "A preview is not a record: trust `committed`. A reconnect with `Last-Event-ID` "
        "resumes right after that event while the stream lives; a reader arriving after "
        "the commit gets the `committed` event, from the journal when need be."
    ),
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def stream_step(
    request: Request,
    b: BackendDep,
    run_id: ValidRun,
    step_id: ValidStep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    if last_event_id is not None and not _STREAM_EVENT_ID.fullmatch(last_event_id):
        raise InvalidArgument(
            "Last-Event-ID is not an event id of this stream", field="Last-Event-ID"
        )
    await _require_step(b, run_id, step_id)
    hub = await request.app.state.hubs.hub(b, run_id, step_id)
    return StreamingResponse(
        live_stream.events(request, b, hub, last_event_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _require_step(b: BackendDep, run_id: str, step_id: str) -> None:
    run = await b.client.get_run(run_id)
    if all(step.step_id != step_id for step in run.steps):
        raise NotFound(f"run {run_id} has no step {step_id!r}", field="step_id")
