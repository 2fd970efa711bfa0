"""The approval rules, pure: the digest binds a call's name and exact
arguments, and each approval act decides once what it does to the call it
names (run, run edited arguments, deny, or change nothing and say why)."""

from __future__ import annotations

import pytest

from dagnats.core.approvals import (
    ApprovalAct,
    ApprovalRefused,
    Approved,
    Denied,
    Edited,
    RefusalKind,
    WaitingCall,
    act_content,
    act_of,
    call_digest,
    canonical_json,
    check_approval_act,
    decide_approval,
    denial_output,
    is_digest,
)
from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import new_run_id

INPUT = b'{"to": "bob", "amount": 12}'
DIGEST = call_digest("pay", INPUT)
RUN = new_run_id()
KEY = f"{RUN}.agent.3.1"
WAITING = WaitingCall(key=KEY, name="pay", input=INPUT, digest=DIGEST)


def test_the_digest_is_of_the_value_not_its_encoding() -> None:
    assert is_digest(DIGEST)
    assert call_digest("pay", b'{"amount":12,"to":"bob"}') == DIGEST
    assert call_digest("pay", b'{"to": "bob", "amount": 13}') != DIGEST
    assert call_digest("refund", INPUT) != DIGEST
    assert call_digest("pay", b"") == call_digest("pay", b"null")
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
    with pytest.raises(InvalidArgument):
        call_digest("pay", b"{not json")


def test_an_approval_of_the_digest_runs_the_call_as_stored() -> None:
    act = ApprovalAct(key=KEY, digest=DIGEST, approve=True)
    assert decide_approval(WAITING, act) == Approved(key=KEY, digest=DIGEST, input=INPUT)


def test_an_approval_of_another_digest_is_a_conflict_naming_both() -> None:
    other = call_digest("pay", b'{"to": "eve", "amount": 12}')
    decision = decide_approval(WAITING, ApprovalAct(key=KEY, digest=other, approve=True))
    assert isinstance(decision, ApprovalRefused) and decision.kind is RefusalKind.CONFLICT
    assert other in decision.message and DIGEST in decision.message


def test_no_waiting_call_is_not_found() -> None:
    decision = decide_approval(None, ApprovalAct(key=KEY, digest=DIGEST, approve=True))
    assert isinstance(decision, ApprovalRefused) and decision.kind is RefusalKind.NOT_FOUND


def test_a_denial_carries_the_reason_and_the_model_reads_it() -> None:
    act = ApprovalAct(key=KEY, digest=DIGEST, approve=False, reason="over budget")
    assert decide_approval(WAITING, act) == Denied(key=KEY, digest=DIGEST, reason="over budget")
    assert denial_output("over budget") == {"denied": True, "reason": "over budget"}
    assert denial_output("")["reason"]


def test_edited_arguments_are_a_new_digest_approved_by_the_act() -> None:
    edited = b'{"amount":10,"to":"bob"}'
    new = call_digest("pay", edited)
    act = ApprovalAct(key=KEY, digest=DIGEST, approve=True, input=edited)
    assert decide_approval(WAITING, act, edited_digest=new) == Edited(
        key=KEY, digest=new, input=edited, seen_digest=DIGEST
    )
    same = ApprovalAct(
        key=KEY, digest=DIGEST, approve=True, input=canonical_json({"to": "bob", "amount": 12})
    )
    assert isinstance(decide_approval(WAITING, same, edited_digest=DIGEST), Approved)


def test_malformed_acts_are_invalid() -> None:
    deny_edit = ApprovalAct(key=KEY, digest=DIGEST, approve=False, input=b"{}")
    no_digest = ApprovalAct(key=KEY, digest=DIGEST, approve=True, input=b"{}")
    for act in (deny_edit, no_digest):
        decision = decide_approval(WAITING, act)
        assert isinstance(decision, ApprovalRefused) and decision.kind is RefusalKind.INVALID


def test_a_decided_call_takes_the_same_act_again_and_refuses_another() -> None:
    approved = WaitingCall(key=KEY, name="pay", input=INPUT, digest=DIGEST, decided_digest=DIGEST)
    again = ApprovalAct(key=KEY, digest=DIGEST, approve=True)
    assert isinstance(decide_approval(approved, again), Approved)
    deny = ApprovalAct(key=KEY, digest=DIGEST, approve=False)
    refused = decide_approval(approved, deny)
    assert isinstance(refused, ApprovalRefused) and refused.kind is RefusalKind.CONFLICT
    assert "already approved" in refused.message
    denied = WaitingCall(
        key=KEY, name="pay", input=INPUT, digest=DIGEST, decided_digest=DIGEST, denied=True
    )
    assert isinstance(decide_approval(denied, deny), Denied)
    assert isinstance(decide_approval(denied, again), ApprovalRefused)


@pytest.mark.parametrize(
    ("key", "digest", "field"),
    [
        (f"{RUN}.other.3.1", DIGEST, "call"),
        (f"{RUN}.agent.x.1", DIGEST, "call"),
        (f"{RUN}.agent.3", DIGEST, "call"),
        (f"{RUN}.agent.3.\u0661", DIGEST, "call"),  # a digit, but not an ASCII one
        (KEY, "sha256:" + "A" * 64, "digest"),
        (KEY, "md5:abc", "digest"),
    ],
    # Named without the random run id, so every process collecting the module
    # (a parallel run's workers) names them alike.
    ids=lambda value: str(value).replace(RUN, "RUN"),
)
def test_every_field_of_an_act_is_checked(key: str, digest: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_approval_act(RUN, "agent", ApprovalAct(key=key, digest=digest, approve=True))
    assert raised.value.field == field


def test_edited_arguments_must_be_json_and_a_reason_short() -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_approval_act(
            RUN, "agent", ApprovalAct(key=KEY, digest=DIGEST, approve=True, input=b"{")
        )
    assert raised.value.field == "args"
    with pytest.raises(InvalidArgument) as raised:
        check_approval_act(
            RUN, "agent", ApprovalAct(key=KEY, digest=DIGEST, approve=False, reason="x" * 5000)
        )
    assert raised.value.field == "reason"


def test_an_act_round_trips_through_its_input_content() -> None:
    act = ApprovalAct(
        key=KEY, digest=DIGEST, approve=True, approver="alice", reason="ok",
        input=canonical_json({"to": "bob"}), decided_at=12.5,
    )  # fmt: skip
    assert act_of(act_content(act)) == act
    assert act_of({"call": KEY}) is None and act_of("text") is None
