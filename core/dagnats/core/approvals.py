"""Approvals of a tool call, bound to its arguments: the digest and the rules.

Pure: no I/O, no ``async``, no ``nats``, no ``grpc``. A tool declared as
needing approval stores its intent with ``call_digest(name, input)`` and
waits; an approval names the call (its idempotency key) and the digest the
approver saw, and :func:`decide_approval` says what it does: run the call
(``Approved``), run the approver's edited arguments instead (``Edited``, a new
digest the act itself approves), give the model the denial (``Denied``), or
change nothing (``ApprovalRefused``: no such call, another digest, a malformed
act). The SDK, the journal service, the gateway and the audit all ask here,
so all agree on what "the same arguments" means.

Invariants:

* The digest is the sha256, in lowercase hex, of the canonical JSON of
  ``{"name": name, "input": input}``: keys sorted, no insignificant
  whitespace, UTF-8 unescaped, integers as integers. Two encodings of the same
  JSON value (key order, spacing) have one digest; any change to the name or
  to a value has another.
* ``input`` is taken as the JSON bytes stored in the intent (empty bytes are
  null, as everywhere in the contracts); bytes that are not JSON raise
  ``InvalidArgument`` naming ``field``.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any, assert_never

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_run_id, check_token
from dagnats.core.payload import check_json, decode

DIGEST_PREFIX = "sha256:"


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON: sorted keys, compact, strict (no NaN)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def call_digest(name: str, input: bytes, *, field: str = "input") -> str:
    """The digest of a call to ``name`` with the JSON ``input``:
    ``sha256:<64 hex digits>``."""
    canonical = canonical_json({"name": name, "input": decode(input, field=field)})
    return DIGEST_PREFIX + hashlib.sha256(canonical).hexdigest()


def is_digest(value: str) -> bool:
    """Whether ``value`` has the form of a digest (not whether it matches one)."""
    hex_part = value.removeprefix(DIGEST_PREFIX)
    return (
        value.startswith(DIGEST_PREFIX)
        and len(hex_part) == 64
        and all(c in "0123456789abcdef" for c in hex_part)
    )


# ---- what one approval act does -------------------------------------------------
#
# An approval is an input of its own kind (``approval``): it names one tool call
# waiting for approval and the digest the approver saw. The gateway asks
# :func:`decide_approval` before it queues the act (a refusal changes nothing);
# the SDK asks again when the placed act reaches the call, against the call as
# the handler makes it now, and the journal service checks what it stores.

MAX_REASON_BYTES = 4 * 1024
MAX_ARGS_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitingCall:
    """A tool call whose intent is stored and waits for an approval.

    ``decided_digest``: the digest an earlier act approved or denied, once one
    was recorded (empty while the call still waits)."""

    key: str
    name: str
    input: bytes
    digest: str
    decided_digest: str = ""
    denied: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalAct:
    """What an approver sends: approve or deny ``key`` as seen with ``digest``;
    ``input``, when not None, the edited arguments (JSON) to run instead."""

    key: str
    digest: str
    approve: bool
    approver: str = ""
    reason: str = ""
    input: bytes | None = None
    decided_at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Approved:
    """Run the call with ``input``, whose digest is ``digest`` (the stored
    intent's own)."""

    key: str
    digest: str
    input: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Edited:
    """Run the call with the approver's ``input`` instead: a new intent, whose
    digest ``digest`` the act itself approves; ``seen_digest`` is the one the
    approver saw (the stored intent's)."""

    key: str
    digest: str
    input: bytes
    seen_digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Denied:
    """Do not run the call: the model gets the denial and ``reason`` as the
    tool's result."""

    key: str
    digest: str
    reason: str


class RefusalKind(enum.Enum):
    """Why an act changes nothing; the edges map it to 404, 409 and 400."""

    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    INVALID = "invalid"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalRefused:
    """The act changes nothing; ``message`` says why, for the approver."""

    kind: RefusalKind
    message: str


ApprovalDecision = Approved | Edited | Denied | ApprovalRefused


def decide_approval(
    waiting: WaitingCall | None, act: ApprovalAct, *, edited_digest: str = ""
) -> ApprovalDecision:
    """What ``act`` does to the call it names.

    ``waiting``: the call as stored, None when no call of that key waits for
    approval. ``edited_digest``: the digest of ``act.input`` with the call's
    name, when the act carries edited arguments (the caller computes it; the
    rules only compare).

    * No such call: ``NOT_FOUND``.
    * A digest other than the stored intent's: ``CONFLICT``, naming both, so an
      approval given for other arguments never runs these.
    * An act for a call already decided: the same act again (same approve or
      deny, same digest) is answered as before (a repeat is idempotent); any
      other is a ``CONFLICT``.
    * A denial with edited arguments, or edited arguments without their
      digest: ``INVALID``.
    """
    if waiting is None:
        return ApprovalRefused(
            kind=RefusalKind.NOT_FOUND, message=f"no tool call {act.key!r} waits for approval"
        )
    if act.digest != waiting.digest:
        return ApprovalRefused(
            kind=RefusalKind.CONFLICT,
            message=(
                f"the approval is for digest {act.digest}, but call {act.key!r} "
                f"({waiting.name}) waits with digest {waiting.digest}: its arguments are "
                "not the ones approved"
            ),
        )
    if act.input is not None and not act.approve:
        return ApprovalRefused(
            kind=RefusalKind.INVALID, message="a denial cannot carry edited arguments"
        )
    if act.input is not None and not edited_digest:
        return ApprovalRefused(
            kind=RefusalKind.INVALID, message="edited arguments need their digest"
        )
    decision: ApprovalDecision
    if not act.approve:
        decision = Denied(key=act.key, digest=waiting.digest, reason=act.reason)
    elif act.input is not None and edited_digest != waiting.digest:
        decision = Edited(
            key=act.key, digest=edited_digest, input=act.input, seen_digest=waiting.digest
        )
    else:
        decision = Approved(key=act.key, digest=waiting.digest, input=waiting.input)
    if waiting.decided_digest:
        return _repeat(waiting, decision)
    return decision


def _repeat(waiting: WaitingCall, decision: ApprovalDecision) -> ApprovalDecision:
    """``decision`` again for a call already decided, if it decides the same."""
    match decision:
        case Denied() if waiting.denied:
            return decision
        case Approved(digest=digest) | Edited(digest=digest) if (
            not waiting.denied and digest == waiting.decided_digest
        ):
            return decision
        case Approved() | Edited() | Denied():
            done = "denied" if waiting.denied else f"approved with digest {waiting.decided_digest}"
            return ApprovalRefused(
                kind=RefusalKind.CONFLICT,
                message=f"tool call {waiting.key!r} was already {done}",
            )
        case ApprovalRefused():
            return decision
        case _:
            assert_never(decision)


def denial_output(reason: str) -> dict[str, object]:
    """The tool's result a denial gives the model (its output, not an error:
    the model reads it and answers, the step goes on)."""
    return {"denied": True, "reason": reason or "the call was not approved"}


def check_approval_act(
    run_id: str, step_id: str, act: ApprovalAct, *, max_bytes: int = MAX_ARGS_BYTES
) -> ApprovalAct:
    """``act`` itself once its fields are valid for a call of ``run_id``'s
    ``step_id``.

    Raises:
        InvalidArgument: naming the first offending field: a key that is not
            ``{run}.{step}.{iteration}.{position}`` of this step, a digest
            that is not ``sha256:`` and 64 hex digits, a reason too long,
            edited arguments that are not JSON or too large.
    """
    check_run_id(run_id)
    check_token(step_id, field="step_id")
    head, _, tail = act.key.rpartition(".")
    call_prefix, _, iteration = head.rpartition(".")
    if call_prefix != f"{run_id}.{step_id}" or not (
        iteration.isdecimal() and tail.isdecimal() and iteration.isascii() and tail.isascii()
    ):
        raise InvalidArgument(
            f"call must be a tool call key {run_id}.{step_id}.<iteration>.<position>, "
            f"got {act.key!r}",
            field="call",
        )
    if not is_digest(act.digest):
        raise InvalidArgument(
            f"digest must be sha256: and 64 lowercase hex digits, got {act.digest!r}",
            field="digest",
        )
    if len(act.reason.encode()) > MAX_REASON_BYTES:
        raise InvalidArgument(f"reason is longer than {MAX_REASON_BYTES} bytes", field="reason")
    if act.input is not None:
        check_json(act.input, field="args", limit=max_bytes, allow_empty=False)
    return act


# ---- the approval input's content -------------------------------------------------


def act_content(act: ApprovalAct) -> dict[str, Any]:
    """The JSON content of the approval input that carries ``act``."""
    content: dict[str, Any] = {
        "call": act.key,
        "digest": act.digest,
        "approve": act.approve,
        "approver": act.approver,
        "reason": act.reason,
        "decided_at": act.decided_at,
    }
    if act.input is not None:
        content["args"] = decode(act.input, field="args")
    return content


def act_of(content: Any) -> ApprovalAct | None:
    """The act an approval input's content carries; None when it is not one
    (a content no edge that checks approvals would have queued)."""
    if not isinstance(content, dict):
        return None
    key, digest, approve = content.get("call"), content.get("digest"), content.get("approve")
    approver, reason = content.get("approver", ""), content.get("reason", "")
    decided_at = content.get("decided_at", 0.0)
    if not (
        isinstance(key, str)
        and isinstance(digest, str)
        and isinstance(approve, bool)
        and isinstance(approver, str)
        and isinstance(reason, str)
        and isinstance(decided_at, int | float)
    ):
        return None
    edited = canonical_json(content["args"]) if "args" in content else None
    return ApprovalAct(
        key=key,
        digest=digest,
        approve=approve,
        approver=approver,
        reason=reason,
        input=edited,
        decided_at=float(decided_at),
    )
