"""Approvals of a tool call, as the edges take them (REST, the CLI, the
console): the calls of a step that wait for approval, read from its journal,
and an approver's act checked against the call it names before it is queued
as an input of mode ``approval``.

An act the rules refuse (``dagnats.core.approvals.decide_approval``: no such
call, another digest, a malformed act) raises the matching domain error
(``NotFound``, ``Conflict``, ``InvalidArgument``) and queues nothing. The
input is deduplicated on its request id, as every input is; by default the
id is derived from the act, so a repeat of one act is one input.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, assert_never

from dagnats.core import approvals
from dagnats.core.errors import Conflict, DagnatsError, InvalidArgument, NotFound
from dagnats.core.ids import check_request_id
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal import convert, replay
from dagnats.sdk import Client, InputMode, JournalClient
from dagnats.sdk.views import decode_payload, input_dict

_REFUSED: dict[approvals.RefusalKind, type[DagnatsError]] = {
    approvals.RefusalKind.NOT_FOUND: NotFound,
    approvals.RefusalKind.CONFLICT: Conflict,
    approvals.RefusalKind.INVALID: InvalidArgument,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Decided:
    """An act accepted and queued: what it decides, and its input."""

    decision: approvals.Approved | approvals.Edited | approvals.Denied
    input: ipb.Input
    created: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "call": self.decision.key,
            "digest": self.decision.digest,
            "decision": "deny" if isinstance(self.decision, approvals.Denied) else "approve",
            "edited": isinstance(self.decision, approvals.Edited),
            "input": input_dict(self.input),
        }


async def asked_calls(journal: JournalClient, run_id: str, step_id: str) -> list[replay.AskedCall]:
    """Every call of the step that asked for approval, each with its decision."""
    records = [r async for r in journal.read(run_id, step_id)]
    return replay.asked_calls(run_id, step_id, convert.all_entries(records))


async def waiting(journal: JournalClient, run_id: str, step_id: str) -> list[dict[str, Any]]:
    """The calls that wait for approval now, with their arguments."""
    records = [r async for r in journal.read(run_id, step_id)]
    calls = replay.waiting_calls(run_id, step_id, convert.all_entries(records))
    return [asked_dict(c) for c in calls]


def asked_dict(call: replay.AskedCall) -> dict[str, Any]:
    """A call that asked for approval, as the edges show it."""
    return {
        "call": call.key,
        "tool": call.intent.name,
        "args": decode_payload(call.intent.input),
        "digest": call.intent.digest,
        "iteration": call.intent.iteration,
        "seq": call.intent.seq,
    }


def act(
    run_id: str,
    step_id: str,
    *,
    call: str,
    digest: str,
    approve: bool,
    approver: str = "",
    reason: str = "",
    args: Any = None,
    edited: bool = False,
) -> approvals.ApprovalAct:
    """An approver's act, checked field by field (``InvalidArgument``)."""
    return approvals.check_approval_act(
        run_id,
        step_id,
        approvals.ApprovalAct(
            key=call,
            digest=digest,
            approve=approve,
            approver=approver,
            reason=reason,
            input=approvals.canonical_json(args) if edited else None,
            decided_at=time.time(),
        ),
    )


async def decide(
    client: Client,
    journal: JournalClient,
    run_id: str,
    step_id: str,
    act: approvals.ApprovalAct,
    *,
    request_id: str = "",
) -> Decided:
    """Queue ``act`` for the call it names, once the rules accept it.

    Raises:
        NotFound: no such run, step, or call that asked for approval.
        Conflict: the digest is not the call's, or the call was decided otherwise.
        InvalidArgument: a malformed act.
    """
    request_id = check_request_id(request_id or _request_id(act))
    asked = next((c for c in await asked_calls(journal, run_id, step_id) if c.key == act.key), None)
    edited = ""
    if asked is not None and act.input is not None:
        edited = approvals.call_digest(asked.intent.name, act.input, field="args")
    decision = approvals.decide_approval(_waiting(asked), act, edited_digest=edited)
    match decision:
        case approvals.ApprovalRefused(kind=kind, message=message):
            raise _REFUSED[kind](message)
        case approvals.Approved() | approvals.Edited() | approvals.Denied():
            content = approvals.act_content(act)
            item, created = await client.submit_input(
                run_id, step_id, request_id, content, mode=InputMode.APPROVAL
            )
            return Decided(decision=decision, input=item, created=created)
        case _:
            assert_never(decision)


def _request_id(act: approvals.ApprovalAct) -> str:
    """One request id per act, so a repeat of the same act is one input."""
    what = approvals.canonical_json(
        [act.key, act.digest, act.approve, act.reason, act.input.decode() if act.input else None]
    )
    return "approval-" + hashlib.sha256(what).hexdigest()[:32]


def _waiting(asked: replay.AskedCall | None) -> approvals.WaitingCall | None:
    if asked is None:
        return None
    decided = asked.decided
    return approvals.WaitingCall(
        key=asked.key,
        name=asked.intent.name,
        input=asked.intent.input,
        digest=asked.intent.digest,
        decided_digest=decided.digest if decided is not None else "",
        denied=decided is not None
        and decided.approval is not None
        and not decided.approval.approved,
    )
