"""Stored journal records (protobuf) to the plain values the rules use."""

from __future__ import annotations

from typing import Any

from dagnats.journal import model as jm
from dagnats.journal.v1 import journal_pb2 as pb

_ACTION = {
    pb.ACTION_CONTINUE: jm.Action.CONTINUE,
    pb.ACTION_COMPLETE: jm.Action.COMPLETE,
    pb.ACTION_FAIL: jm.Action.FAIL,
    pb.ACTION_FAIL_PERMANENT: jm.Action.FAIL_PERMANENT,
    pb.ACTION_PAUSE: jm.Action.PAUSE,
}


def entry(record: pb.Record) -> jm.AnyEntry:
    """The plain value of a stored record (``record.seq`` must be set)."""
    head: dict[str, Any] = {
        "seq": record.seq,
        "iteration": record.iteration,
        "attempt": record.attempt,
        "writer": record.writer,
        "expected_seq": record.expected_seq,
        "base_seq": record.base_seq,
    }
    kind = record.WhichOneof("kind")
    if kind == "claim":
        return jm.ClaimEntry(
            **head, delivery=record.claim.delivery, worker_id=record.claim.worker_id
        )
    if kind == "model":
        return jm.ModelEntry(**head, position=record.model.position, response=record.model.response)
    if kind == "tool_intent":
        i = record.tool_intent
        return jm.IntentEntry(
            **head,
            position=i.position,
            name=i.name,
            input=i.input,
            safe=i.replay == pb.REPLAY_SAFE,
            honours_seq=i.honours_seq,
        )
    if kind == "tool_output":
        o = record.tool_output
        return jm.OutputEntry(**head, intent_seq=o.intent_seq, chunk=o.chunk)
    if kind == "tool_result":
        r = record.tool_result
        return jm.ResultEntry(
            **head,
            intent_seq=r.intent_seq,
            output=r.output,
            error=r.error,
            interrupted=r.interrupted,
            partial=r.partial,
        )
    if kind == "commit":
        c = record.commit
        return jm.CommitEntry(
            **head,
            action=_ACTION.get(c.action, jm.Action.FAIL),
            state=c.state,
            has_state=c.has_state,
            output=c.output,
            error=c.error,
            reason=c.reason,
            pause=c.pause.ToNanoseconds() / 1e9,
        )
    if kind == "input_placed":
        p = record.input_placed
        return jm.InputEntry(
            **head,
            position=p.position,
            request_id=p.request_id,
            mode=p.mode,
            content=p.content,
            carried=p.carried,
        )
    raise ValueError(f"record {record.seq} has no kind")


def result_to_proto(result: jm.ResultEntry) -> pb.ToolResult:
    return pb.ToolResult(
        intent_seq=result.intent_seq,
        output=result.output,
        error=result.error,
        interrupted=result.interrupted,
        partial=result.partial,
    )


def placed_to_proto(entry: jm.InputEntry) -> pb.InputPlaced:
    return pb.InputPlaced(
        position=entry.position,
        request_id=entry.request_id,
        mode=entry.mode,
        content=entry.content,
        carried=entry.carried,
    )
