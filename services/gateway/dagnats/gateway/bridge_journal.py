"""The bridge's journal actions, under ``/bridge/journal``.

The first action on a task claims its journal. The replay actions are the
SDK journal handle's calls: ``model/begin`` then (unless a response is
recorded) ``model/record``; ``tool/begin`` then (when told to run)
``tool/output`` and ``tool/finish``; ``tools/begin`` for a parallel group
(every intent stored before it answers), then ``tools/finish`` with the
results of the calls that finished (``tool/output`` names a call by its
``intent_seq`` and ``intent_index``); ``inputs/place``. ``append`` writes a
record the worker built itself, through the same RPCs, so it obeys the same
replay rules. Positions are counted in the token: each begun call, placement
or appended model or intent takes the next one, unless an append names it.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter

from dagnats.core.errors import Conflict, InvalidArgument
from dagnats.core.payload import encode
from dagnats.gateway import bridge_models as bm
from dagnats.gateway import bridge_ops as ops
from dagnats.gateway.backend import Backend, BackendDep
from dagnats.gateway.bridge_token import BridgeToken
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk.views import decode_payload, record_dict

router = APIRouter(prefix="/journal")

_REPLAY = {"safe": jpb.REPLAY_SAFE, "unsafe": jpb.REPLAY_UNSAFE}
_MODE = {"steer": 1, "follow_up": 2}


@router.post("/read", summary="Claim (first action), then this iteration's records and state")
async def read(b: BackendDep, body: bm.TokenBody) -> bm.ReadResult:
    t, claimed = await ops.claim(b, BridgeToken.decode(body.token))
    if claimed is not None and not claimed.more_from_seq and not claimed.state_follows:
        records = list(claimed.records)
        state = claimed.state if claimed.has_state else None
    else:  # not claimed now, or the claim's answer held only some of the records
        await ops.holding(b, t)
        records = await _iteration_records(b, t)
        state = await ops.state_of(b, t)
    return bm.ReadResult(
        token=t.encode(),
        records=[record_dict(r) for r in records],
        state=decode_payload(state) if state is not None else None,
        has_state=state is not None,
    )


async def _iteration_records(b: Backend, t: BridgeToken) -> list[jpb.Record]:
    assert t.writer is not None
    w = t.writer
    found: list[jpb.Record] = []
    # At most last_seq - base_seq records of this step lie in between.
    limit = max(w.last_seq - w.base_seq, 1)
    async with ops.records_from(b, t, w.base_seq + 1, limit=limit) as records:
        async for record in records:
            if record.seq > w.last_seq:
                break
            if record.iteration == w.iteration:
                found.append(record)
    return found


# ---- model calls --------------------------------------------------------------------------


@router.post("/model/begin", summary="The response recorded at the next position, if any")
async def model_begin(b: BackendDep, body: bm.TokenBody) -> bm.ModelBeginResult:
    t, _ = await ops.claim(b, BridgeToken.decode(body.token))
    position = t.position
    t, response = await _begin_model(b, t, position)
    return bm.ModelBeginResult(
        token=t.encode(),
        position=position,
        recorded=response is not None,
        response=decode_payload(response) if response is not None else None,
    )


async def _begin_model(
    b: Backend, t: BridgeToken, position: int
) -> tuple[BridgeToken, bytes | None]:
    assert t.writer is not None
    request = jpb.BeginModelRequest(token=t.writer, position=position, budget=t.budget)
    begin = await ops.writing(b, t, b.rpc.begin_model(request))
    if begin.HasField("token"):  # the budget's check placed raises: the next token
        t = replace(t, writer=begin.token)
    if begin.recorded:
        return replace(t, position=position + 1, model_position=None), begin.response
    return replace(t, position=position + 1, model_position=position), None


@router.post("/model/record", summary="Record the response of the begun model call")
async def model_record(b: BackendDep, body: bm.ModelRecordBody) -> bm.TokenResult:
    t = BridgeToken.decode(body.token)
    if t.writer is None or t.model_position is None:
        raise Conflict("no model call is begun: call /bridge/journal/model/begin first")
    data = encode(body.response, field="response")
    t = await _record_model(b, t, t.model_position, data, body.usage)
    return bm.TokenResult(token=t.encode())


async def _record_model(
    b: Backend, t: BridgeToken, position: int, data: bytes, usage: bm.UsageBody | None
) -> BridgeToken:
    assert t.writer is not None
    request = jpb.RecordModelRequest(token=t.writer, position=position, response=data)
    if usage is not None:
        request.usage.CopyFrom(jpb.Usage(**usage.model_dump()))
    recorded = await ops.writing(b, t, b.rpc.record_model(request))
    return replace(t, writer=recorded.token, model_position=None)


# ---- tool calls ---------------------------------------------------------------------------


@router.post("/tool/begin", summary="Record a tool call's intent, or the result to use instead")
async def tool_begin(b: BackendDep, body: bm.ToolBeginBody) -> bm.ToolBeginResult:
    t, _ = await ops.claim(b, BridgeToken.decode(body.token))
    position = t.position
    t, begin = await _begin_tool(b, t, position, body.name, body.input, body.replay)
    return bm.ToolBeginResult(
        token=t.encode(),
        position=position,
        key=f"{t.run_id}.{t.step_id}.{t.iteration}.{position}",
        run=begin.run,
        intent_seq=_intent_of(begin),
        result=None if begin.run else _result_view(begin.result),
    )


async def _begin_tool(
    b: Backend, t: BridgeToken, position: int, name: str, value: object, replay: str
) -> tuple[BridgeToken, jpb.BeginToolResponse]:
    assert t.writer is not None
    request = jpb.BeginToolRequest(
        token=t.writer,
        position=position,
        name=name,
        input=encode(value, field="input"),
        replay=_REPLAY[replay],
    )
    begin = await ops.writing(b, t, b.rpc.begin_tool(request))
    intent_seq = begin.intent_seq if begin.run else 0
    return replace(t, writer=begin.token, position=position + 1, intent_seq=intent_seq), begin


def _intent_of(begin: jpb.BeginToolResponse) -> int:
    return int(begin.intent_seq or begin.result.intent_seq)


def _result_view(result: jpb.ToolResult) -> bm.ToolResultView:
    return bm.ToolResultView(
        output=decode_payload(result.output),
        error=result.error,
        interrupted=result.interrupted,
        partial=result.partial,
    )


@router.post("/tool/output", summary="Record partial output of the running tool")
async def tool_output(b: BackendDep, body: bm.ToolOutputBody) -> bm.TokenResult:
    t = BridgeToken.decode(body.token)
    t = await _tool_output(b, t, _intent(t, body.intent_seq), body.chunk, body.intent_index)
    return bm.TokenResult(token=t.encode())


async def _tool_output(
    b: Backend, t: BridgeToken, intent_seq: int, chunk: str, index: int = 0
) -> BridgeToken:
    assert t.writer is not None
    request = jpb.ToolOutputRequest(
        token=t.writer, intent_seq=intent_seq, chunk=chunk, intent_index=index
    )
    out = await ops.writing(b, t, b.rpc.tool_output(request), intent_seq=intent_seq)
    return replace(t, writer=out.token)


@router.post("/tool/finish", summary="Record the result of the running tool")
async def tool_finish(b: BackendDep, body: bm.ToolFinishBody) -> bm.TokenResult:
    t = BridgeToken.decode(body.token)
    intent_seq = _intent(t, body.intent_seq)
    if body.interrupted:
        if body.output is not None or body.error:
            raise InvalidArgument(
                "an interrupted tool call has no output or error; send `partial`",
                field="interrupted",
            )
        result = jpb.FinishToolRequest(
            intent_seq=intent_seq, interrupted=True, partial=body.partial
        )
    elif body.partial:
        raise InvalidArgument("`partial` goes with `interrupted`", field="partial")
    else:
        result = _finished(intent_seq, body.output, body.error)
    result.intent_index = body.intent_index
    t = await _finish_tool(b, t, result)
    return bm.TokenResult(token=t.encode())


def _finished(intent_seq: int, output: object, error: str) -> jpb.FinishToolRequest:
    # As the SDK: a tool that failed has an error and no output.
    data = b"" if error and output is None else encode(output, field="output")
    return jpb.FinishToolRequest(intent_seq=intent_seq, output=data, error=error)


async def _finish_tool(b: Backend, t: BridgeToken, result: jpb.FinishToolRequest) -> BridgeToken:
    assert t.writer is not None
    result.token.CopyFrom(t.writer)
    finished = await ops.writing(b, t, b.rpc.finish_tool(result), intent_seq=result.intent_seq)
    return replace(t, writer=finished.token, intent_seq=0)


def _intent(t: BridgeToken, given: int | None) -> int:
    intent = given or t.intent_seq
    if t.writer is None or not intent:
        raise Conflict("no tool call is running: call /bridge/journal/tool/begin first")
    return intent


# ---- parallel groups ------------------------------------------------------------------------


@router.post(
    "/tools/begin",
    summary="Record the intents of a parallel group (the tool calls of one model response)",
)
async def tools_begin(b: BackendDep, body: bm.ToolsBeginBody) -> bm.ToolsBeginResult:
    t, _ = await ops.claim(b, BridgeToken.decode(body.token))
    assert t.writer is not None
    position = t.position
    request = jpb.BeginToolsRequest(
        token=t.writer,
        position=position,
        calls=[
            jpb.ToolCallSpec(
                name=c.name,
                input=encode(c.input, field=f"calls[{i}].input"),
                replay=_REPLAY[c.replay],
            )
            for i, c in enumerate(body.calls)
        ],
    )
    begun = await ops.writing(b, t, b.rpc.begin_tools(request))
    t = replace(t, writer=begun.token, position=position + len(body.calls), intent_seq=0)
    return bm.ToolsBeginResult(
        token=t.encode(),
        position=position,
        calls=[
            bm.ToolsBeginCall(
                position=position + i,
                key=answer.key,
                run=answer.run,
                intent_seq=_intent_of(answer),
                intent_index=answer.intent_index,
                result=None if answer.run else _result_view(answer.result),
            )
            for i, answer in enumerate(begun.calls)
        ],
    )


@router.post("/tools/finish", summary="Record the results of calls of a parallel group")
async def tools_finish(b: BackendDep, body: bm.ToolsFinishBody) -> bm.TokenResult:
    t = BridgeToken.decode(body.token)
    if t.writer is None:
        raise Conflict("no tool call is running: call /bridge/journal/tools/begin first")
    for result in body.results:
        finish = _finished(result.intent_seq, result.output, result.error)
        finish.intent_index = result.intent_index
        t = await _finish_tool(b, t, finish)
    return bm.TokenResult(token=t.encode())


# ---- inputs -------------------------------------------------------------------------------


@router.post("/inputs/place", summary="Place the step's queued inputs of one mode")
async def place_inputs(b: BackendDep, body: bm.PlaceInputsBody) -> bm.PlaceInputsResult:
    t, _ = await ops.claim(b, BridgeToken.decode(body.token))
    assert t.writer is not None
    position = t.position
    request = jpb.PlaceInputsRequest(token=t.writer, position=position, mode=_MODE[body.mode])
    placed = await ops.writing(b, t, b.rpc.place_inputs(request))
    t = replace(t, writer=placed.token, position=position + 1)
    inputs = [
        bm.PlacedInputView(
            request_id=p.request_id,
            mode="follow_up" if p.mode == _MODE["follow_up"] else "steer",
            content=decode_payload(p.content),
            carried=p.carried,
        )
        for p in placed.inputs
    ]
    return bm.PlaceInputsResult(token=t.encode(), inputs=inputs)


# ---- records the worker builds --------------------------------------------------------------


@router.post("/append", summary="Write one record (model, tool_intent, tool_output, tool_result)")
async def append(b: BackendDep, body: bm.AppendBody) -> bm.AppendResult:
    record = body.record
    t = BridgeToken.decode(body.token)
    if isinstance(record, bm.ToolOutputRecord | bm.ToolResultRecord):
        _intent(t, record.intent_seq)  # they follow a begun call: no claim for them
    t, _ = await ops.claim(b, t)
    assert t.writer is not None
    before = t.writer.last_seq
    match record:
        case bm.ModelRecord():
            position = t.position if record.position is None else record.position
            t, recorded = await _begin_model(b, t, position)
            if recorded is None:
                data = encode(record.response, field="record.response")
                t = await _record_model(b, t, position, data, record.usage)
            return bm.AppendResult(
                token=t.encode(),
                kind=record.kind,
                seq=_written(t, before),
                position=position,
                recorded=recorded is not None,
                response=decode_payload(recorded) if recorded is not None else None,
            )
        case bm.ToolIntentRecord():
            position = t.position if record.position is None else record.position
            t, begin = await _begin_tool(b, t, position, record.name, record.input, record.replay)
            return bm.AppendResult(
                token=t.encode(),
                kind=record.kind,
                seq=_written(t, before),
                position=position,
                run=begin.run,
                intent_seq=_intent_of(begin),
                result=None if begin.run else _result_view(begin.result),
            )
        case bm.ToolOutputRecord():
            intent = _intent(t, record.intent_seq)
            t = await _tool_output(b, t, intent, record.chunk)
        case bm.ToolResultRecord():
            intent = _intent(t, record.intent_seq)
            t = await _finish_tool(b, t, _finished(intent, record.output, record.error))
    return bm.AppendResult(
        token=t.encode(), kind=record.kind, seq=_written(t, before), intent_seq=intent
    )


def _written(t: BridgeToken, before: int) -> int:
    """Sequence of the last record this call wrote; 0 when it wrote none."""
    assert t.writer is not None
    return int(t.writer.last_seq) if t.writer.last_seq != before else 0
