"""Stored journal records (protobuf) to the plain values the rules use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dagnats.core.statechain import Delta, StoredDelta
from dagnats.core.usage import Usage
from dagnats.journal import model as jm
from dagnats.journal.v1 import journal_pb2 as pb

_ACTION = {
    pb.ACTION_CONTINUE: jm.Action.CONTINUE,
    pb.ACTION_COMPLETE: jm.Action.COMPLETE,
    pb.ACTION_FAIL: jm.Action.FAIL,
    pb.ACTION_FAIL_PERMANENT: jm.Action.FAIL_PERMANENT,
    pb.ACTION_PAUSE: jm.Action.PAUSE,
}


def entries(record: pb.Record) -> list[jm.AnyEntry]:
    """The entries of a stored record, in order: its dispatch's claim, if it
    was handed over (``Record.leading_claim``); the entry stored ahead of its
    kind (``Record.leading``), if any; then its kind's (``record.seq`` must be
    set)."""
    found: list[jm.AnyEntry] = []
    if record.HasField("leading_claim"):
        c = record.leading_claim
        found.append(
            jm.ClaimEntry(**_head(record), leading=True, delivery=c.delivery, worker_id=c.worker_id)
        )
    if record.HasField("leading_model"):
        m = record.leading_model
        found.append(
            jm.ModelEntry(
                **_head(record),
                leading=True,
                position=m.position,
                response=m.response,
                usage=usage_of(m),
            )
        )
    elif record.HasField("leading_tool_result"):
        r = record.leading_tool_result
        found.append(jm.ResultEntry(**_head(record), leading=True, **_result_fields(r)))
    if record.HasField("tool_intents"):
        found.extend(group_intents(record))
        return found
    found.append(entry(record))
    return found


def group_intents(record: pb.Record) -> list[jm.IntentEntry]:
    """The intents of a parallel group's record, in order; all but the last
    are ``leading`` (stored ahead of another entry of the record)."""
    g = record.tool_intents
    last = len(g.intents) - 1
    return [
        jm.IntentEntry(
            **_head(record),
            leading=index < last,
            **_intent_fields(i),
            index=index,
            group_size=g.group_size,
            group_position=g.group_position,
        )
        for index, i in enumerate(g.intents)
    ]


def _intent_fields(i: pb.ToolIntent) -> dict[str, Any]:
    return {
        "position": i.position,
        "name": i.name,
        "input": i.input,
        "safe": i.replay == pb.REPLAY_SAFE,
        "honours_seq": i.honours_seq,
        "honours_index": i.honours_index,
        "digest": i.digest,
        "approval": approval_mark(i.approval) if i.HasField("approval") else None,
    }


def all_entries(records: Iterable[pb.Record]) -> list[jm.AnyEntry]:
    """The entries of ``records``, in order."""
    return [e for record in records for e in entries(record)]


def _head(record: pb.Record) -> dict[str, Any]:
    return {
        "seq": record.seq,
        "iteration": record.iteration,
        "attempt": record.attempt,
        "writer": record.writer,
        "expected_seq": record.expected_seq,
        "base_seq": record.base_seq,
    }


def _result_fields(r: pb.ToolResult) -> dict[str, Any]:
    return {
        "intent_seq": r.intent_seq,
        "output": r.output,
        "error": r.error,
        "interrupted": r.interrupted,
        "partial": r.partial,
        "intent_index": r.intent_index,
        "awaiting_approval": r.awaiting_approval,
    }


def approval_mark(a: pb.Approval) -> jm.ApprovalMark:
    return jm.ApprovalMark(
        call=a.call,
        digest=a.digest,
        approved=a.approved,
        approver=a.approver,
        reason=a.reason,
        decided_at=a.decided_at.ToNanoseconds() / 1e9,
        request_id=a.request_id,
        edited=a.edited,
    )


def entry(record: pb.Record) -> jm.AnyEntry:
    """The entry of a stored record's kind, the last of its entries (see
    :func:`entries`; ``record.seq`` must be set)."""
    head = _head(record)
    kind = record.WhichOneof("kind")
    if kind == "claim":
        return jm.ClaimEntry(
            **head, delivery=record.claim.delivery, worker_id=record.claim.worker_id
        )
    if kind == "model":
        m = record.model
        return jm.ModelEntry(**head, position=m.position, response=m.response, usage=usage_of(m))
    if kind == "tool_intent":
        return jm.IntentEntry(**head, **_intent_fields(record.tool_intent))
    if kind == "tool_output":
        o = record.tool_output
        return jm.OutputEntry(
            **head, intent_seq=o.intent_seq, chunk=o.chunk, intent_index=o.intent_index
        )
    if kind == "tool_result":
        return jm.ResultEntry(**head, **_result_fields(record.tool_result))
    if kind == "commit":
        c = record.commit
        return jm.CommitEntry(
            **head,
            action=_ACTION.get(c.action, jm.Action.FAIL),
            state=c.state,
            has_state=c.has_state,
            state_delta=stored_delta(c) if c.HasField("state_delta") else None,
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
    if kind == "cancel":
        return jm.CancelEntry(**head, reason=record.cancel.reason)
    if kind == "tool_intents":
        return group_intents(record)[-1]
    if kind == "fork":
        f = record.fork
        return jm.ForkEntry(
            **head,
            source_run=f.run_id,
            source_step=f.step_id,
            at_seq=f.at_seq,
            copied=f.copied,
            digest=f.digest,
        )
    raise ValueError(f"record {record.seq} has no kind")


def stored_delta(c: pb.Commit) -> StoredDelta:
    """The state delta ``c`` stores (the state chain), as the rules read it."""
    d = c.state_delta
    return StoredDelta(delta=Delta(keep=d.keep, tail=d.tail), size=d.size, depth=d.depth)


def result_to_proto(result: jm.ResultEntry) -> pb.ToolResult:
    return pb.ToolResult(
        intent_seq=result.intent_seq,
        output=result.output,
        error=result.error,
        interrupted=result.interrupted,
        partial=result.partial,
        intent_index=result.intent_index,
        awaiting_approval=result.awaiting_approval,
    )


def placed_to_proto(entry: jm.InputEntry) -> pb.InputPlaced:
    return pb.InputPlaced(
        position=entry.position,
        request_id=entry.request_id,
        mode=entry.mode,
        content=entry.content,
        carried=entry.carried,
    )


def largest_part(record: pb.Record) -> tuple[str, int]:
    """What holds most of ``record``'s bytes, named as a user knows it, and its
    size: what to tell the writer of a record too large to store."""
    parts = [
        ("the state", record.commit.state),
        ("the state", record.commit.state_delta.tail),
        ("the step's output", record.commit.output),
        ("the tool's output", record.tool_result.output),
        ("the tool's output", record.leading_tool_result.output),
        ("the tool's error", record.tool_result.error.encode()),
        ("the model's response", record.model.response),
        ("the model's response", record.leading_model.response),
        ("the tool call's input", record.tool_intent.input),
        ("the tool calls' inputs", b"".join(i.input for i in record.tool_intents.intents)),
        ("the failure's error", record.commit.error.encode()),
        ("the tool's partial output", record.tool_output.chunk.encode()),
        ("the input's content", record.input_placed.content),
    ]
    name, data = max(parts, key=lambda part: len(part[1]))
    return name, len(data)


def usage_of(model: pb.ModelCall) -> Usage | None:
    """What a recorded model call spent, when its record says."""
    if not model.HasField("usage"):
        return None
    u = model.usage
    return Usage(
        input_tokens=u.input_tokens,
        output_tokens=u.output_tokens,
        cached_tokens=u.cached_tokens,
        model=u.model,
        cost_micros=u.cost_micros if u.priced else None,
    )
