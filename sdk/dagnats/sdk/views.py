"""The JSON shape of dagnats objects, shared by ``dagnats --json`` and the HTTP API.

Each function turns a contract message into plain JSON values: field names
as in the contract (``run_id``, not ``runId``), enum values as short lower-case
names (``"running"``), timestamps as RFC 3339 strings, durations as seconds
with an ``s`` suffix, and the contract's JSON ``bytes`` fields (inputs,
outputs, states, tool inputs, model responses) decoded rather than base64. A
payload that is not JSON is returned as text, so a view never fails.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb

__all__ = [
    "check_dict",
    "decode_payload",
    "enum_name",
    "input_dict",
    "record_dict",
    "run_dict",
    "usage_dict",
    "workflow_dict",
]


def run_dict(run: pb.Run) -> dict[str, Any]:
    """A run, its steps included."""
    data = _as_dict(run)
    data["status"] = enum_name(pb.RunStatus, run.status)
    data["input"] = decode_payload(run.input)
    data["output"] = decode_payload(run.output)
    data["steps"] = [_step_dict(step) for step in run.steps]
    if run.HasField("budget"):
        data["budget"] = budget_dict(run.budget)
    return data


def budget_dict(budget: jpb.Budget) -> dict[str, Any]:
    """A run's budget: its bounds (0: none) and its policy."""
    policy = enum_name(jpb.BudgetPolicy, budget.policy) if budget.policy else "fail"
    return {"tokens": budget.tokens, "cost": budget.cost_micros / 1_000_000, "policy": policy}


def usage_dict(usage: pb.RunUsage) -> dict[str, Any]:
    """A run's usage: its total and each step's, every total with its counts
    as numbers and its cost in the price table's currency (``cost``)."""
    return {
        "total": _split_dict(usage.total),
        "steps": [
            {
                "step_id": step.step_id,
                **_split_dict(step.usage),
                "by_model": {name: _totals_dict(t) for name, t in sorted(step.by_model.items())},
            }
            for step in usage.steps
        ],
    }


def _split_dict(split: pb.UsageSplit) -> dict[str, Any]:
    return {kind: _totals_dict(getattr(split, kind)) for kind in USAGE_KINDS}


USAGE_KINDS = ("spent", "kept", "retried", "fenced", "copied")


def _totals_dict(totals: pb.UsageTotals) -> dict[str, Any]:
    return {
        "calls": totals.calls,
        "input_tokens": totals.input_tokens,
        "output_tokens": totals.output_tokens,
        "cached_tokens": totals.cached_tokens,
        "cost": totals.cost_micros / 1_000_000,
    }


def workflow_dict(workflow: pb.Workflow) -> dict[str, Any]:
    """A registered workflow definition."""
    data = _as_dict(workflow)
    for step_msg, step in zip(workflow.steps, data["steps"], strict=True):
        step["type"] = enum_name(pb.StepType, step_msg.type)
        if step_msg.HasField("retry"):
            step["retry"]["backoff"] = enum_name(pb.BackoffStrategy, step_msg.retry.backoff)
    if workflow.HasField("default_retry"):
        data["default_retry"]["backoff"] = enum_name(
            pb.BackoffStrategy, workflow.default_retry.backoff
        )
    if workflow.HasField("budget"):
        data["budget"] = budget_dict(workflow.budget)
    if workflow.build_policy:
        data["build_policy"] = enum_name(pb.BuildPolicy, workflow.build_policy)
    return data


def input_dict(item: ipb.Input) -> dict[str, Any]:
    """A submitted input and where it is in its life."""
    data = _as_dict(item)
    data["mode"] = enum_name(ipb.Mode, item.mode)
    data["status"] = enum_name(ipb.Status, item.status)
    data["content"] = decode_payload(item.content)
    return data


def record_dict(record: jpb.Record) -> dict[str, Any]:
    """A journal record; ``kind`` names which of the record's bodies is set.
    A record that also holds the entry stored ahead of it names that one's
    body in ``leading`` (``leading_model`` or ``leading_tool_result``); one
    that stores its dispatch's handed-over claim has it in ``leading_claim``."""
    data = _as_dict(record)
    kind = record.WhichOneof("kind")
    data["kind"] = kind
    leading = record.WhichOneof("leading")
    data["leading"] = leading
    for name in (kind, leading):
        for field_kind, field in _JSON_PAYLOADS:
            body = name.removeprefix("leading_") if name else None
            if body == field_kind and name and field in data[name]:
                data[name][field] = decode_payload(getattr(getattr(record, name), field))
    if kind == "tool_intent":
        data[kind]["replay"] = enum_name(jpb.Replay, record.tool_intent.replay)
    if kind == "tool_intents":  # a parallel group's intents
        for intent, stored in zip(data[kind]["intents"], record.tool_intents.intents, strict=True):
            intent["input"] = decode_payload(stored.input)
            intent["replay"] = enum_name(jpb.Replay, stored.replay)
    if kind == "commit":
        data[kind]["action"] = enum_name(jpb.Action, record.commit.action)
        if record.commit.HasField("state_delta"):
            # A delta's tail is the end of a JSON text, not JSON: shown as text.
            tail = record.commit.state_delta.tail
            data[kind]["state_delta"]["tail"] = tail.decode(errors="replace")
    if kind == "input_placed":
        data[kind]["mode"] = enum_name(ipb.Mode, record.input_placed.mode)
    return data


def check_dict(response: jpb.CheckResponse) -> dict[str, Any]:
    """The audit of a run's journal: the violations and what was checked."""
    return _as_dict(response)


def decode_payload(raw: bytes) -> Any:
    """A JSON payload as a value; empty is None, and non-JSON comes back as text."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def enum_name(enum: Any, value: int) -> str:
    """``RUN_STATUS_RUNNING`` -> ``running``: the value's name without its prefix."""
    name = str(enum.Name(value))
    prefix = _common_prefix(enum)
    return name.removeprefix(prefix).lower()


def _common_prefix(enum: Any) -> str:
    # Every contract enum has an UNSPECIFIED zero value named PREFIX_UNSPECIFIED.
    zero = str(enum.Name(0))
    return zero.removesuffix("UNSPECIFIED")


def _step_dict(step: pb.StepState) -> dict[str, Any]:
    data = _as_dict(step)
    data["status"] = enum_name(pb.StepStatus, step.status)
    data["output"] = decode_payload(step.output)
    return data


_JSON_PAYLOADS = (
    ("model", "response"),
    ("tool_intent", "input"),
    ("tool_result", "output"),
    ("commit", "state"),
    ("commit", "output"),
    ("input_placed", "content"),
)


def _as_dict(message: Message) -> dict[str, Any]:
    # Zero values printed too: a script reading iteration 0 should not find it missing.
    data = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(message, data)
    return data


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _numbers(message: Message, data: dict[str, Any]) -> None:
    # Protobuf's JSON writes 64-bit integers as strings; sequences and counts
    # are far below 2**53, so they are plain JSON numbers here.
    for field in message.DESCRIPTOR.fields:
        value = data.get(field.name)
        if value is None:
            continue
        if field.type in _INT64:
            data[field.name] = [int(v) for v in value] if field.is_repeated else int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            nested = getattr(message, field.name)
            if field.is_repeated and isinstance(value, list):
                for item, item_data in zip(nested, value, strict=True):
                    _numbers(item, item_data)
            elif isinstance(value, dict) and not _is_map(field):
                _numbers(nested, value)


def _is_map(field: Any) -> bool:
    entry = field.message_type
    return entry is not None and bool(entry.GetOptions().map_entry)
