"""The replay rules on golden journals, one rule per test, including a journal
that must come back as ``Mismatch`` (``ReplayMismatch`` in the service).

Pure: plain records built by hand, no event loop, no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import pytest

from dagnats.journal import convert
from dagnats.journal.limits import MAX_PARTIAL_BYTES
from dagnats.journal.model import (
    Action,
    AnyEntry,
    ApprovalMark,
    CancelEntry,
    ClaimEntry,
    CommitEntry,
    InputEntry,
    IntentEntry,
    ModelEntry,
    OutputEntry,
    ResultEntry,
    ToolCall,
)
from dagnats.journal.replay import (
    DEFAULT_RESTART_LIMIT,
    AlreadyCommitted,
    CallModel,
    Cancelled,
    ClaimAsked,
    ClaimDecision,
    ClaimSeen,
    FencedWrite,
    Group,
    Honour,
    Interrupt,
    Mismatch,
    NoClaim,
    Proceed,
    ReadRecords,
    ReadTail,
    RestartLimit,
    RideFirstRecord,
    RunAgain,
    RunNew,
    Stale,
    StoreAfterCancel,
    StoreClaim,
    StoredAfterCancel,
    UseGuessedTail,
    UseResponse,
    UseResult,
    cancel_of,
    claim_may_ride,
    claim_step,
    cut_partial,
    decide_claim,
    decide_model,
    decide_tool,
    decide_tools,
    deliveries_without_progress,
    fenced_out_write,
    partial_output,
    placed_by_earlier_try,
    restart_limit_reached,
)
from dagnats.journal.v1 import journal_pb2 as pb

E = TypeVar("E", bound=AnyEntry)


class J:
    """One step's journal as the service stores it, built call by call.

    Every record gets the next sequence and expects the one before it (the chain
    fenced appends produce). A claim opens dispatch ``(it, at)`` with a fresh
    writer nonce; later records belong to it until the next claim.
    """

    def __init__(self) -> None:
        self.entries: list[AnyEntry] = []
        self._dispatch = (0, 1)
        self._writer = ""
        self._base = 0
        self._deliveries: dict[tuple[int, int], int] = {}

    def claim(self, *, it: int = 0, at: int = 1) -> J:
        self._dispatch = (it, at)
        self._writer = f"{len(self.entries) + 1:016x}"
        delivery = self._deliveries.get((it, at), 0) + 1
        self._deliveries[(it, at)] = delivery
        return self._add(ClaimEntry, delivery=delivery, worker_id=f"worker-{delivery}")

    def rode(self, *, it: int = 0, delivery: int = 1) -> J:
        """Delivery ``delivery`` of ``(it, 1)`` held a claim that was to ride
        its first record, and died before writing it: nothing is stored."""
        self._deliveries[(it, 1)] = delivery
        return self

    def placed(self, request_id: str, *, p: int) -> J:
        return self._add(InputEntry, position=p, request_id=request_id, mode=1, content=b"{}")

    def model(self, *, p: int, resp: bytes = b'{"text": "hi"}') -> J:
        return self._add(ModelEntry, position=p, response=resp)

    def intent(
        self, *, p: int, name: str, input: bytes = b"{}", safe: bool = False, honours: int = 0
    ) -> J:
        return self._add(
            IntentEntry, position=p, name=name, input=input, safe=safe, honours_seq=honours
        )

    def output(self, chunk: str, *, intent: int | None = None, index: int = 0) -> J:
        return self._add(
            OutputEntry, intent_seq=intent or self._last_intent(), chunk=chunk, intent_index=index
        )

    def group(self, *, p: int, calls: list[ToolCall], size: int = 0, start: int = -1) -> J:
        """One record holding the intents of a parallel group's ``calls`` from
        position ``p`` (of a group of ``size`` calls from ``start``: by
        default these calls alone); a call's digest and approval (its
        ``approval_id``, as ``_pay`` marks it) are its intent's."""
        seq = self._next_seq()
        it, at = self._dispatch
        for index, call in enumerate(calls):
            self.entries.append(
                IntentEntry(
                    seq=seq,
                    iteration=it,
                    attempt=at,
                    writer=self._writer,
                    expected_seq=seq - 1,
                    base_seq=self._base,
                    leading=index < len(calls) - 1,
                    position=p + index,
                    name=call.name,
                    input=call.input,
                    safe=call.safe,
                    index=index,
                    group_size=size or len(calls),
                    group_position=p if start < 0 else start,
                    digest=call.digest,
                    approval=_mark(call.approval_id) if call.approval_id else None,
                )
            )
        return self

    def result(
        self,
        *,
        intent: int | None = None,
        output: bytes = b'{"ok": true}',
        error: str = "",
        interrupted: bool = False,
        partial: str = "",
        index: int = 0,
    ) -> J:
        return self._add(
            ResultEntry,
            intent_seq=intent or self._last_intent(),
            output=output,
            error=error,
            interrupted=interrupted,
            partial=partial,
            intent_index=index,
        )

    def commit(self, action: Action) -> J:
        self._add(CommitEntry, action=action, error="boom" if action is Action.FAIL else "")
        if self.last_commit.ends_iteration:
            self._base = self.last_commit.seq
        return self

    @property
    def last(self) -> AnyEntry:
        return self.entries[-1]

    @property
    def last_intent(self) -> IntentEntry:
        return self._last(IntentEntry)

    @property
    def last_result(self) -> ResultEntry:
        return self._last(ResultEntry)

    @property
    def last_commit(self) -> CommitEntry:
        return self._last(CommitEntry)

    def _last(self, kind: type[E]) -> E:
        entry = self.entries[-1]
        assert isinstance(entry, kind), f"the last record is {entry!r}, not a {kind.__name__}"
        return entry

    def at(self, seq: int) -> AnyEntry:
        return self.entries[seq - 1]

    def of(self, iteration: int) -> list[AnyEntry]:
        """The records of one iteration, as the service hands them to the rules."""
        return [e for e in self.entries if e.iteration == iteration]

    def _last_intent(self) -> int:
        return next(e.seq for e in reversed(self.entries) if isinstance(e, IntentEntry))

    def _next_seq(self) -> int:
        return (self.entries[-1].seq if self.entries else 0) + 1

    def _add(self, kind: type[AnyEntry], **fields: object) -> J:
        seq = self._next_seq()
        it, at = self._dispatch
        entry = kind(
            seq=seq,
            iteration=it,
            attempt=at,
            writer=self._writer,
            expected_seq=seq - 1,
            base_seq=self._base,
            **fields,  # type: ignore[arg-type]
        )
        self.entries.append(entry)
        return self


def unsafe(name: str, input: bytes = b"{}") -> ToolCall:
    return ToolCall(name=name, input=input, safe=False)


def safe(name: str, input: bytes = b"{}") -> ToolCall:
    return ToolCall(name=name, input=input, safe=True)


def claim(j: J, *, iteration: int = 0, attempt: int = 1) -> ClaimDecision:
    return decide_claim(tail=j.last, records=j.of(iteration), iteration=iteration, attempt=attempt)


def claims(j: J, n: int, *, at: int = 1) -> J:
    for _ in range(n):
        j.claim(it=0, at=at)
    return j


# ---- claim ----------------------------------------------------------------------


def test_claim_is_stale_when_the_tail_is_from_a_later_iteration() -> None:
    j = J().claim(it=0).model(p=0).commit(Action.CONTINUE).claim(it=1)
    assert claim(j, iteration=0, attempt=1) == Stale(
        detail="the journal is at dispatch (1, 1), past (0, 1)"
    )


def test_claim_is_stale_when_the_tail_is_from_a_later_attempt_of_the_iteration() -> None:
    j = J().claim(it=0, at=1).commit(Action.FAIL).claim(it=0, at=2).model(p=0)
    assert claim(j, iteration=0, attempt=1) == Stale(
        detail="the journal is at dispatch (0, 2), past (0, 1)"
    )


def test_claim_on_an_empty_journal_proceeds() -> None:
    assert decide_claim(tail=None, records=[], iteration=0, attempt=1) == Proceed(close=())


@pytest.mark.parametrize("action", [Action.CONTINUE, Action.COMPLETE, Action.FAIL_PERMANENT])
@pytest.mark.parametrize("attempt", [1, 2])
def test_claim_after_an_iteration_ending_commit_is_already_committed(
    action: Action, attempt: int
) -> None:
    # Attempt 2 too: a commit that ends the iteration ends it for every attempt.
    j = J().claim(it=0, at=1).model(p=0).commit(action)
    commit = j.last_commit
    assert claim(j, iteration=0, attempt=attempt) == AlreadyCommitted(commit=commit)


@pytest.mark.parametrize("action", [Action.FAIL, Action.PAUSE])
def test_claim_after_this_attempts_own_fail_or_pause_commit_is_already_committed(
    action: Action,
) -> None:
    j = J().claim(it=0, at=1).commit(Action.FAIL).claim(it=0, at=2).model(p=0).commit(action)
    own = j.last_commit
    assert claim(j, iteration=0, attempt=2) == AlreadyCommitted(commit=own)


def test_claim_of_a_new_attempt_closes_earlier_attempts_unanswered_intents() -> None:
    j = J().claim(it=0, at=1).model(p=0)
    j.intent(p=1, name="search", safe=True).result()  # answered: not closed
    send = j.intent(p=2, name="send", input=b'{"to": "a"}').last_intent
    j.output("sending")
    read = j.intent(p=3, name="read", safe=True).last_intent  # safe ones are closed too
    j.commit(Action.FAIL)
    assert claim(j, iteration=0, attempt=2) == Proceed(close=(send, read))


def test_claim_of_a_third_attempt_closes_only_what_the_second_claim_left_open() -> None:
    # Attempt 1 left `send` open and hit the restart limit; attempt 2's claim
    # closed it, then attempt 2 left `read` open and hit the limit too.
    j = J().claim(it=0, at=1)
    send = j.intent(p=0, name="send").last_intent
    claims(j, 5, at=1).commit(Action.FAIL)
    j.claim(it=0, at=2).result(intent=send.seq, output=b"", interrupted=True)
    read = j.intent(p=0, name="read", safe=True).last_intent
    claims(j, 5, at=2).commit(Action.FAIL)
    assert claim(j, iteration=0, attempt=3) == Proceed(close=(read,))


def test_claim_of_a_later_iteration_closes_nothing_of_the_earlier_one() -> None:
    j = J().claim(it=0).intent(p=0, name="send").commit(Action.CONTINUE)
    assert claim(j, iteration=1, attempt=1) == Proceed(close=())


def test_claim_redelivering_the_same_attempt_proceeds_without_closing() -> None:
    # Attempt 1's open intent is answered per position by decide_tool, not at the claim.
    j = J().claim(it=0, at=1).model(p=0).intent(p=1, name="send")
    assert claim(j, iteration=0, attempt=1) == Proceed(close=())


def test_claim_redelivering_a_retry_does_not_close_its_own_intents_again() -> None:
    j = J().claim(it=0, at=1).intent(p=0, name="send").commit(Action.FAIL)
    j.claim(it=0, at=2).result(interrupted=True)  # the attempt-2 claim closed `send`
    j.intent(p=0, name="charge")  # attempt 2's own open intent
    assert claim(j, iteration=0, attempt=2) == Proceed(close=())


# ---- claim from a guessed tail ------------------------------------------------------


def asked(**fields: object) -> ClaimAsked:
    """A worker's claim of the first delivery of (0, 1), unless told otherwise."""
    base: dict[str, object] = {
        "iteration": 0,
        "attempt": 1,
        "delivery": 1,
        "worker_id": "worker-1",
        "limit": DEFAULT_RESTART_LIMIT,
        "may_ride": False,
    }
    return ClaimAsked(**(base | fields))  # type: ignore[arg-type]


def seen(j: J | None, *, iteration: int, **fields: object) -> ClaimSeen:
    """What a claim of ``iteration`` found: ``j``'s tail and the iteration's
    records (None: an empty journal)."""
    if j is None:
        return ClaimSeen(tail=(), records=(), **fields)  # type: ignore[arg-type]
    return ClaimSeen(tail=(j.last,), records=tuple(j.of(iteration)), **fields)  # type: ignore[arg-type]


def test_a_claim_from_a_guessed_tail_proceeds_and_its_fenced_claim_checks_the_guess() -> None:
    # The guessed tail: the commit this replica stored for iteration 0. A
    # claim of iteration 1 decided from it stores its claim, whose fenced
    # append tells a wrong guessed tail, so the decision may stand.
    j = J().claim(it=0).model(p=0).commit(Action.CONTINUE)
    guess = j.last_commit
    assert decide_claim(tail=guess, records=[], iteration=1, attempt=1) == Proceed(close=())
    step = claim_step(asked(iteration=1), ClaimSeen(tail=(guess,), guessed=True))
    assert step == StoreClaim(base=guess.seq, close=(), guessed=True)


def test_a_claim_answer_that_writes_nothing_never_stands_on_a_guessed_tail() -> None:
    # Stale and already-committed settle the task and write nothing, so nothing
    # would check a guessed tail they were decided from: they need the tail read.
    j = J().claim(it=0).model(p=0).commit(Action.CONTINUE).claim(it=1)
    stale = claim(j, iteration=0, attempt=1)
    assert isinstance(stale, Stale)
    on_guess = ClaimSeen(tail=(j.last,), guessed=True, records=tuple(j.of(0)))
    assert claim_step(asked(iteration=0), on_guess) == ReadTail(with_run=False)
    j.model(p=0).commit(Action.CONTINUE)
    committed = claim(j, iteration=1, attempt=1)
    assert isinstance(committed, AlreadyCommitted)
    on_guess = ClaimSeen(tail=(j.last,), guessed=True, records=tuple(j.of(1)))
    assert claim_step(asked(iteration=1), on_guess) == ReadTail(with_run=False)
    # Read, the same tail decides.
    assert claim_step(asked(iteration=1), seen(j, iteration=1)) == committed


def test_a_claim_whose_append_on_the_guessed_tail_was_refused_reads_the_tail() -> None:
    guess = J().claim(it=0).model(p=0).commit(Action.CONTINUE).last_commit
    missed = ClaimSeen(tail=(guess,), guessed=True, guess_missed=True)
    assert claim_step(asked(iteration=1), missed) == ReadTail(with_run=False)


# ---- restart limit --------------------------------------------------------------


def test_restart_limit_reached_after_five_claims_in_a_row() -> None:
    j = claims(J().claim().model(p=0), 5)
    assert DEFAULT_RESTART_LIMIT == 5
    assert restart_limit_reached(j.of(0), DEFAULT_RESTART_LIMIT) is True


def test_restart_limit_not_reached_after_four_claims_in_a_row() -> None:
    j = claims(J().claim().model(p=0), 4)
    assert restart_limit_reached(j.of(0), 5) is False


def test_restart_limit_a_pause_commit_between_claims_resets_the_count() -> None:
    j = claims(J(), 3).commit(Action.PAUSE)
    claims(j, 2)
    assert restart_limit_reached(j.of(0), 5) is False
    assert restart_limit_reached(j.of(0), 3) is False
    assert restart_limit_reached(j.of(0), 2) is True


@pytest.mark.parametrize("progress", ["model", "intent", "output", "result"])
def test_restart_limit_any_other_record_between_claims_resets_the_count(progress: str) -> None:
    j = claims(J(), 3)
    ls = j.intent(p=0, name="ls", safe=True).last_intent.seq
    j.claim()
    match progress:
        case "model":
            j.model(p=1)
        case "intent":
            j.intent(p=1, name="cat", safe=True)
        case "output":
            j.output("partial", intent=ls)
        case "result":
            j.result()
    claims(j, 4)
    assert restart_limit_reached(j.of(0), 5) is False
    assert restart_limit_reached(j.of(0), 4) is True


def test_restart_limit_counts_claims_of_an_earlier_attempt_that_ended_without_commit() -> None:
    j = claims(J().claim(at=1).model(p=0), 3, at=1)
    claims(j, 2, at=2)
    assert restart_limit_reached(j.of(0), 5) is True


def test_restart_limit_counts_a_claim_repeated_for_one_delivery_once() -> None:
    """A claim whose answer never reached its worker is claimed again for the
    same delivery: that is no restart. A new delivery is one."""
    j = claims(J(), 2)
    repeat = replace(j.entries[-1], seq=j.entries[-1].seq + 1, writer="f" * 16)
    j.entries.extend([repeat, replace(repeat, seq=repeat.seq + 1)])
    assert restart_limit_reached(j.of(0), 3) is False
    j.claim()
    assert restart_limit_reached(j.of(0), 3) is True


@pytest.mark.parametrize("limit", [2, 3, 5])
def test_restart_limit_counts_a_first_deliverys_claim_that_rode_and_was_never_stored(
    limit: int,
) -> None:
    """The first delivery's claim rides its holder's first record, and its holder
    died before writing one: the redeliveries' claims stored after it stand for
    one delivery more, so the limit is reached at the ``limit``-th delivery."""
    j = J().rode()
    for delivery in range(2, limit + 1):
        j.claim()
        assert isinstance(j.last, ClaimEntry) and j.last.delivery == delivery
        assert deliveries_without_progress(j.of(0)) == delivery
        assert restart_limit_reached(j.of(0), limit) is (delivery == limit)


def test_restart_limit_counts_a_handed_over_claim_of_a_kept_message_that_was_never_stored() -> None:
    """Iteration 1 handed over to delivery 3 of a kept message, whose holder
    died before its first record; deliveries 4 and 5 claimed: three in a row."""
    j = J().claim().model(p=0).commit(Action.CONTINUE).rode(it=1, delivery=3)
    j.claim(it=1).claim(it=1)
    assert deliveries_without_progress(j.of(1)) == 3
    assert restart_limit_reached(j.of(1), 3) is True


def test_restart_limit_adds_nothing_for_a_claim_stored_with_its_first_record() -> None:
    """A claim that rode and was stored (``leading``, with its holder's first
    record) is a delivery the trailing claims do not stand for again, and a
    first delivery's claim stored on its own had no delivery before it."""
    j = J().rode(delivery=2).claim()
    j.entries[-1] = replace(j.entries[-1], leading=True)
    j.model(p=0)
    claims(j, 2)
    assert deliveries_without_progress(j.of(0)) == 2
    stored_alone = claims(J(), 2)
    assert deliveries_without_progress(stored_alone.of(0)) == 2


def test_restart_limit_adds_nothing_for_a_retrys_first_claim() -> None:
    """Only the first attempt's claims ride: a retry's first claim is stored
    before its holder runs, so no unstored claim came before it."""
    j = claims(J(), 2, at=2)
    assert deliveries_without_progress(j.of(0)) == 2


def test_partial_output_longer_than_a_record_keeps_its_end() -> None:
    j = J().claim().intent(p=0, name="build", safe=False)
    intent = j.last_intent.seq
    for n in range(5):
        j.output(f"line {n}\n" + "." * 100_000, intent=intent)
    cut = partial_output(j.of(0), intent)
    assert len(cut.encode()) <= MAX_PARTIAL_BYTES + 32
    assert cut.startswith("[") and " bytes cut]" in cut and cut.endswith("." * 1000)
    assert cut_partial("short") == "short"


def test_restart_limit_is_per_iteration() -> None:
    j = claims(J(), 3).commit(Action.CONTINUE)
    j.claim(it=1)
    j.claim(it=1)
    assert restart_limit_reached(j.of(1), 3) is False


# ---- model calls ------------------------------------------------------------------


def test_model_call_reuses_the_response_recorded_at_its_position() -> None:
    j = J().claim().model(p=0, resp=b'{"text": "first"}').model(p=1, resp=b'{"text": "second"}')
    j.claim()  # a redelivery replays the attempt
    assert decide_model(j.of(0), attempt=1, position=1) == UseResponse(
        response=b'{"text": "second"}'
    )


def test_model_call_at_a_new_position_calls_the_model() -> None:
    j = J().claim().model(p=0).intent(p=1, name="ls", safe=True).result().claim()
    assert decide_model(j.of(0), attempt=1, position=2) == CallModel()


def test_model_call_where_a_tool_intent_is_recorded_is_a_mismatch() -> None:
    j = J().claim().model(p=0).intent(p=1, name="search", safe=True).claim()
    assert decide_model(j.of(0), attempt=1, position=1) == Mismatch(
        reason="position 1 recorded tool 'search', not a model call"
    )


def test_model_call_in_a_new_attempt_does_not_reuse_the_earlier_attempts_response() -> None:
    j = J().claim(at=1).model(p=0, resp=b'{"text": "old"}').commit(Action.FAIL).claim(at=2)
    assert decide_model(j.of(0), attempt=2, position=0) == CallModel()


# ---- tool calls: one attempt --------------------------------------------------------


@pytest.mark.parametrize("recorded_safe", [True, False])
@pytest.mark.parametrize("current_safe", [True, False])
def test_tool_recorded_result_is_reused_whatever_the_declarations(
    recorded_safe: bool, current_safe: bool
) -> None:
    j = J().claim().intent(p=0, name="charge", input=b'{"cents": 5}', safe=recorded_safe)
    result = j.result(output=b'{"charged": true}').last_result
    j.claim()
    call = ToolCall(name="charge", input=b'{"cents": 5}', safe=current_safe)
    assert decide_tool(j.of(0), attempt=1, position=0, call=call) == UseResult(result=result)


def test_tool_recorded_error_result_is_reused() -> None:
    j = J().claim().intent(p=0, name="cat", safe=True)
    result = j.result(output=b"", error="no such file").last_result
    j.claim()
    assert decide_tool(j.of(0), attempt=1, position=0, call=safe("cat")) == UseResult(result=result)


def test_tool_intent_without_result_runs_again_when_both_declarations_are_safe() -> None:
    j = J().claim().model(p=0)
    intent = j.intent(p=1, name="search", input=b'{"q": "x"}', safe=True).last_intent
    j.output("half").claim()
    decision = decide_tool(j.of(0), attempt=1, position=1, call=safe("search", b'{"q": "x"}'))
    assert decision == RunAgain(intent=intent)


def test_tool_intent_recorded_safe_called_unsafe_is_interrupted() -> None:
    j = J().claim()
    intent = j.intent(p=0, name="write", safe=True).last_intent
    j.claim()
    decision = decide_tool(j.of(0), attempt=1, position=0, call=unsafe("write"))
    assert decision == Interrupt(intent=intent, partial="")


def test_tool_intent_recorded_unsafe_called_safe_is_interrupted() -> None:
    j = J().claim()
    intent = j.intent(p=0, name="write", safe=False).last_intent
    j.claim()
    decision = decide_tool(j.of(0), attempt=1, position=0, call=safe("write"))
    assert decision == Interrupt(intent=intent, partial="")


def test_tool_intent_recorded_unsafe_called_unsafe_is_interrupted() -> None:
    j = J().claim()
    intent = j.intent(p=0, name="send", safe=False).last_intent
    j.claim()
    decision = decide_tool(j.of(0), attempt=1, position=0, call=unsafe("send"))
    assert decision == Interrupt(intent=intent, partial="")


def test_tool_interrupt_carries_the_partial_output_of_that_intent_only() -> None:
    j = J().claim()
    ls = j.intent(p=0, name="ls", safe=True).last_intent.seq
    j.output("a.txt\n").output("b.txt\n").result(intent=ls)
    deploy = j.intent(p=1, name="deploy").last_intent
    j.output("step 1 ok\n").output("step 2 ").claim()
    decision = decide_tool(j.of(0), attempt=1, position=1, call=unsafe("deploy"))
    assert decision == Interrupt(intent=deploy, partial="step 1 ok\nstep 2 ")
    assert partial_output(j.of(0), ls) == "a.txt\nb.txt\n"


def test_tool_with_another_name_at_a_recorded_position_is_a_mismatch() -> None:
    j = J().claim().intent(p=0, name="search", input=b'{"q": "x"}', safe=True).claim()
    decision = decide_tool(j.of(0), attempt=1, position=0, call=safe("fetch", b'{"q": "x"}'))
    assert decision == Mismatch(
        reason="position 0 recorded tool 'search' with other input; the handler now calls 'fetch'"
    )


def test_tool_with_other_input_at_a_recorded_position_is_a_mismatch() -> None:
    j = J().claim().intent(p=0, name="search", input=b'{"q": "x"}', safe=True).result().claim()
    decision = decide_tool(j.of(0), attempt=1, position=0, call=safe("search", b'{"q": "y"}'))
    assert decision == Mismatch(
        reason="position 0 recorded tool 'search' with other input; the handler now calls 'search'"
    )


def test_tool_call_where_a_model_call_is_recorded_is_a_mismatch() -> None:
    j = J().claim().model(p=0).claim()
    assert decide_tool(j.of(0), attempt=1, position=0, call=safe("search")) == Mismatch(
        reason="position 0 recorded a model call, not tool 'search'"
    )


def test_tool_call_at_a_fresh_position_runs_new() -> None:
    j = J().claim().model(p=0).intent(p=1, name="ls", safe=True).result().claim()
    assert decide_tool(j.of(0), attempt=1, position=2, call=safe("ls")) == RunNew()


# ---- tool calls: a new attempt -------------------------------------------------------


def test_new_attempt_honours_an_earlier_attempts_unsafe_intent_by_name_and_input() -> None:
    j = J().claim(at=1).model(p=0)
    charge = j.intent(p=1, name="charge", input=b'{"cents": 5}').last_intent
    result = j.result(output=b'{"charged": true}').last_result
    j.commit(Action.FAIL).claim(at=2).model(p=0, resp=b'{"text": "fresh"}')
    # Matched by name and input, not by position: attempt 2 calls it at position 1 too,
    # but could have called it anywhere.
    decision = decide_tool(j.of(0), attempt=2, position=1, call=unsafe("charge", b'{"cents": 5}'))
    assert decision == Honour(earlier=charge, result=result)


def test_new_attempt_honours_an_earlier_intent_the_claim_closed_as_interrupted() -> None:
    j = J().claim(at=1)
    send = j.intent(p=0, name="send", input=b'{"to": "a"}').last_intent
    j.output("connecting").commit(Action.FAIL).claim(at=2)
    closed = j.result(
        intent=send.seq, output=b"", interrupted=True, partial="connecting"
    ).last_result
    decision = decide_tool(j.of(0), attempt=2, position=3, call=unsafe("send", b'{"to": "a"}'))
    assert decision == Honour(earlier=send, result=closed)


def test_new_attempt_does_not_honour_an_earlier_safe_intent() -> None:
    j = J().claim(at=1).intent(p=0, name="search", input=b'{"q": "x"}', safe=True).result()
    j.commit(Action.FAIL).claim(at=2)
    assert (
        decide_tool(j.of(0), attempt=2, position=0, call=safe("search", b'{"q": "x"}')) == RunNew()
    )
    assert (
        decide_tool(j.of(0), attempt=2, position=0, call=unsafe("search", b'{"q": "x"}'))
        == RunNew()
    )


def test_new_attempt_does_not_honour_an_intent_with_other_input() -> None:
    j = J().claim(at=1).intent(p=0, name="charge", input=b'{"cents": 5}').result()
    j.commit(Action.FAIL).claim(at=2)
    decision = decide_tool(j.of(0), attempt=2, position=0, call=unsafe("charge", b'{"cents": 6}'))
    assert decision == RunNew()


def test_new_attempt_positions_do_not_collide_with_the_earlier_attempts() -> None:
    j = J().claim(at=1).intent(p=0, name="search", safe=True).result()
    j.commit(Action.FAIL).claim(at=2)
    assert decide_tool(j.of(0), attempt=2, position=0, call=safe("fetch")) == RunNew()


def test_new_attempt_honours_each_earlier_intent_once_by_its_recorded_honour() -> None:
    j = J().claim(at=1)
    charge = j.intent(p=0, name="charge", input=b'{"cents": 5}').last_intent
    j.result(output=b'{"charged": true}').commit(Action.FAIL).claim(at=2)
    j.intent(p=0, name="charge", input=b'{"cents": 5}', honours=charge.seq)
    j.result(intent=j.last_intent.seq, output=b'{"charged": true}')
    decision = decide_tool(j.of(0), attempt=2, position=1, call=unsafe("charge", b'{"cents": 5}'))
    assert decision == RunNew()


def test_new_attempt_honours_each_earlier_intent_once_by_the_writers_honoured_list() -> None:
    j = J().claim(at=1)
    charge = j.intent(p=0, name="charge", input=b'{"cents": 5}').last_intent
    j.result().commit(Action.FAIL).claim(at=2)
    decision = decide_tool(
        j.of(0),
        attempt=2,
        position=1,
        call=unsafe("charge", b'{"cents": 5}'),
        honoured=[charge.seq],
    )
    assert decision == RunNew()


def test_new_attempt_honours_two_identical_earlier_intents_one_each() -> None:
    call = unsafe("charge", b'{"cents": 5}')
    j = J().claim(at=1)
    first = j.intent(p=0, name=call.name, input=call.input).last_intent
    first_result = j.result(output=b'{"n": 1}').last_result
    second = j.intent(p=1, name=call.name, input=call.input).last_intent
    second_result = j.result(output=b'{"n": 2}').last_result
    j.commit(Action.FAIL).claim(at=2)
    assert decide_tool(j.of(0), attempt=2, position=0, call=call) == Honour(
        earlier=first,
        result=first_result,
    )
    j.intent(p=0, name=call.name, input=call.input, honours=first.seq).result(output=b'{"n": 1}')
    assert decide_tool(j.of(0), attempt=2, position=1, call=call) == Honour(
        earlier=second,
        result=second_result,
    )
    j.intent(p=1, name=call.name, input=call.input, honours=second.seq).result(output=b'{"n": 2}')
    assert decide_tool(j.of(0), attempt=2, position=2, call=call) == RunNew()


def test_third_attempt_honours_the_original_intent_not_the_second_attempts_honour() -> None:
    call = unsafe("charge", b'{"cents": 5}')
    j = J().claim(at=1)
    original = j.intent(p=0, name=call.name, input=call.input).last_intent
    result = j.result(output=b'{"charged": true}').last_result
    j.commit(Action.FAIL).claim(at=2)
    j.intent(p=0, name=call.name, input=call.input, honours=original.seq).result()
    j.commit(Action.FAIL).claim(at=3)
    assert decide_tool(j.of(0), attempt=3, position=0, call=call) == Honour(
        earlier=original,
        result=result,
    )


def test_redelivered_honour_is_reused_at_its_position() -> None:
    call = unsafe("charge", b'{"cents": 5}')
    j = J().claim(at=1)
    original = j.intent(p=0, name=call.name, input=call.input).last_intent
    j.result().commit(Action.FAIL).claim(at=2)
    j.intent(p=0, name=call.name, input=call.input, honours=original.seq)
    copy = j.result(output=b'{"ok": true}').last_result
    j.claim(at=2)
    assert decide_tool(j.of(0), attempt=2, position=0, call=call) == UseResult(result=copy)


def test_a_redelivery_of_the_same_attempt_honours_none_of_its_own_intents() -> None:
    # The handler sends the same message twice on purpose. A redelivery of the
    # same attempt replays the first send by its position and runs the second:
    # honouring is for a new attempt, which matches an earlier attempt's unsafe
    # intents by name and input because its calls may come in another order.
    call = unsafe("send", b'{"to": "a"}')
    j = J().claim(at=1)
    first = j.intent(p=0, name=call.name, input=call.input).last_intent
    sent = j.result(output=b'{"sent": 1}').last_result
    j.claim(at=1)  # the same attempt, delivered again
    assert decide_tool(j.of(0), attempt=1, position=0, call=call) == UseResult(result=sent)
    assert decide_tool(j.of(0), attempt=1, position=1, call=call) == RunNew()
    j.commit(Action.FAIL).claim(at=2)
    assert decide_tool(j.of(0), attempt=2, position=1, call=call) == Honour(
        earlier=first, result=sent
    )


def test_an_honouring_intent_is_never_honoured_itself() -> None:
    # Attempt 2 honoured the original charge; attempt 3 honours the original
    # again for its first charge, and runs its second, identical charge: the
    # honour of attempt 2 started nothing, so it stands for no charge.
    call = unsafe("charge", b'{"cents": 5}')
    j = J().claim(at=1)
    original = j.intent(p=0, name=call.name, input=call.input).last_intent
    j.result(output=b'{"charged": true}').commit(Action.FAIL).claim(at=2)
    j.intent(p=0, name=call.name, input=call.input, honours=original.seq).result()
    j.commit(Action.FAIL).claim(at=3)
    j.intent(p=0, name=call.name, input=call.input, honours=original.seq).result()
    assert decide_tool(j.of(0), attempt=3, position=1, call=call) == RunNew()


# ---- golden journals ------------------------------------------------------------------


def test_golden_journal_crashed_turn_replays_up_to_where_it_stopped() -> None:
    j = J().claim()
    j.model(p=0, resp=b'{"tool": "ls"}')
    ls = j.intent(p=1, name="ls", input=b'{"dir": "/"}', safe=True).last_intent
    ls_result = j.result(output=b'["a", "b"]').last_result
    j.model(p=2, resp=b'{"tool": "rm"}')
    rm = j.intent(p=3, name="rm", input=b'{"path": "/a"}').last_intent
    j.output("removing /a").claim()  # crash after the side effect may have started

    records = j.of(0)
    assert decide_model(records, attempt=1, position=0) == UseResponse(response=b'{"tool": "ls"}')
    assert decide_tool(
        records, attempt=1, position=1, call=safe("ls", b'{"dir": "/"}')
    ) == UseResult(result=ls_result)
    assert ls.seq == ls_result.intent_seq
    assert decide_model(records, attempt=1, position=2) == UseResponse(response=b'{"tool": "rm"}')
    assert decide_tool(
        records, attempt=1, position=3, call=unsafe("rm", b'{"path": "/a"}')
    ) == Interrupt(intent=rm, partial="removing /a")
    assert decide_model(records, attempt=1, position=4) == CallModel()


def test_golden_journal_handler_that_changed_its_tool_between_deliveries_mismatches() -> None:
    # Delivery 1 ran `search`; a new build of the handler calls `web_search` there.
    # The service turns this into ReplayMismatch and writes nothing.
    j = J().claim()
    j.model(p=0, resp=b'{"tool": "search", "input": {"q": "nats"}}')
    j.intent(p=1, name="search", input=b'{"q": "nats"}', safe=True).result(output=b'["hit"]')
    j.model(p=2, resp=b'{"text": "done"}')
    j.claim()
    before = list(j.entries)

    records = j.of(0)
    assert decide_model(records, attempt=1, position=0) == UseResponse(
        response=b'{"tool": "search", "input": {"q": "nats"}}'
    )
    decision = decide_tool(
        records, attempt=1, position=1, call=safe("web_search", b'{"q": "nats"}')
    )
    assert decision == Mismatch(
        reason=(
            "position 1 recorded tool 'search' with other input; the handler now calls 'web_search'"
        )
    )
    assert j.entries == before, "the rules are pure: nothing was written"


def test_builder_chains_sequences_and_writers() -> None:
    j = J().claim().model(p=0).claim()
    assert [e.seq for e in j.entries] == [1, 2, 3]
    assert [e.expected_seq for e in j.entries] == [0, 1, 2]
    assert j.at(1).writer == j.at(2).writer != j.at(3).writer
    third = j.at(3)
    assert isinstance(third, ClaimEntry) and third.delivery == 2


def test_base_before_is_the_commit_that_ended_the_previous_iteration() -> None:
    from dagnats.journal import replay
    from dagnats.journal.model import Action, ClaimEntry, CommitEntry

    commit = CommitEntry(
        seq=9, iteration=0, attempt=1, writer="w", base_seq=0, action=Action.CONTINUE
    )
    assert replay.base_before(None, 0) == 0
    assert replay.base_before(commit, 1) == 9, "the tail is the commit that ended iteration 0"
    claim = ClaimEntry(seq=10, iteration=1, attempt=1, writer="v", base_seq=9)
    assert replay.base_before(claim, 1) == 9, "a record of the iteration carries its base"
    failed = CommitEntry(seq=11, iteration=1, attempt=1, writer="v", base_seq=9, action=Action.FAIL)
    assert replay.base_before(failed, 1) == 9, "a retriable failure ends no iteration"


# ---- records that hold two entries: leading entries (ADR 24) -----------------------------


def stored(*bodies: pb.Record, attempt: int = 1) -> list[pb.Record]:
    """``bodies`` as one writer's fenced appends store them: each the next
    sequence, expecting the one before it."""
    records = []
    for seq, body in enumerate(bodies, start=1):
        record = pb.Record(iteration=0, attempt=attempt, writer="a" * 16, expected_seq=seq - 1)
        record.MergeFrom(body)
        record.seq = seq
        records.append(record)
    return records


def test_a_response_stored_with_its_intent_replays_as_a_record_of_its_own() -> None:
    # A holder stored the response with the intent it asked for, started the
    # unsafe tool and died: its redelivery reuses the response and interrupts
    # the tool, exactly as if each had a record of its own.
    records = stored(
        pb.Record(claim=pb.Claim(delivery=1)),
        pb.Record(
            leading_model=pb.ModelCall(position=0, response=b'{"tool": "rm"}'),
            tool_intent=pb.ToolIntent(position=1, name="rm", input=b"{}", replay=pb.REPLAY_UNSAFE),
        ),
        pb.Record(tool_output=pb.ToolOutput(intent_seq=2, chunk="removing")),
        pb.Record(claim=pb.Claim(delivery=2)),
    )
    entries = convert.all_entries(records)
    assert [type(e).__name__ for e in entries] == [
        "ClaimEntry",
        "ModelEntry",
        "IntentEntry",
        "OutputEntry",
        "ClaimEntry",
    ]
    model, intent = entries[1], entries[2]
    assert (model.seq, intent.seq) == (2, 2) and model.leading and not intent.leading
    assert convert.entry(records[1]) == intent, "the record's kind is its last entry"
    assert decide_model(entries, attempt=1, position=0) == UseResponse(response=b'{"tool": "rm"}')
    assert isinstance(intent, IntentEntry)
    assert decide_tool(entries, attempt=1, position=1, call=unsafe("rm")) == Interrupt(
        intent=intent, partial="removing"
    )
    # A retry honours the intent the claim closes, found by its seq.
    assert decide_claim(tail=entries[-1], records=entries, iteration=0, attempt=2) == Proceed(
        close=(intent,)
    )


def test_a_result_stored_with_its_commit_answers_its_intent() -> None:
    records = stored(
        pb.Record(claim=pb.Claim(delivery=1)),
        pb.Record(
            leading_model=pb.ModelCall(position=0, response=b'{"tool": "send"}'),
            tool_intent=pb.ToolIntent(position=1, name="send", input=b"{}"),
        ),
        pb.Record(
            leading_tool_result=pb.ToolResult(intent_seq=2, output=b'"sent"'),
            commit=pb.Commit(action=pb.ACTION_FAIL, error="boom"),
        ),
    )
    entries = convert.all_entries(records)
    result, commit = entries[-2], entries[-1]
    assert isinstance(result, ResultEntry) and result.leading and result.intent_seq == 2
    assert isinstance(commit, CommitEntry) and commit.seq == result.seq == 3
    # The failed attempt's retry has nothing to close, and honours the result.
    decision = decide_claim(tail=commit, records=entries, iteration=0, attempt=2)
    assert decision == Proceed(close=())
    honour = decide_tool(entries, attempt=2, position=1, call=unsafe("send"))
    assert isinstance(honour, Honour) and honour.result == result
    assert decide_claim(tail=commit, records=entries, iteration=0, attempt=1) == AlreadyCommitted(
        commit=commit
    )


def test_a_claim_of_iteration_zero_of_an_ended_run_is_stale_before_its_records_are_read() -> None:
    j = J().claim(it=0).model(p=0)
    ended = ClaimSeen(tail=(j.last,), run_ended="run r is completed")
    assert claim_step(asked(), ended) == Stale(detail="run r is completed")
    assert claim_step(asked(), ClaimSeen(tail=(j.last,))) == ReadRecords(base=0, through=2)
    # A later iteration follows a commit: the run's end is never read for it.
    assert claim_step(asked(iteration=3), ClaimSeen()) == ReadTail(with_run=False)
    assert claim_step(asked(), ClaimSeen()) == ReadTail(with_run=True)


def test_only_the_commit_of_the_iteration_before_is_a_guessed_tail() -> None:
    assert claim_step(asked(iteration=5, guessed_tail=4), ClaimSeen()) == UseGuessedTail()
    for guessed_tail in (3, 5, None):
        step = claim_step(asked(iteration=5, guessed_tail=guessed_tail), ClaimSeen())
        assert step == ReadTail(with_run=False), guessed_tail
    # A claim that may ride appends nothing that would check a guessed tail.
    step = claim_step(asked(iteration=5, guessed_tail=4, may_ride=True), ClaimSeen())
    assert step == ReadTail(with_run=False)


def test_only_a_first_delivery_of_a_first_attempt_under_the_limit_may_ride() -> None:
    assert claim_may_ride(attempt=1, delivery=1, limit=DEFAULT_RESTART_LIMIT)
    assert not claim_may_ride(attempt=1, delivery=2, limit=5), "a redelivery fences the ones before"
    assert not claim_may_ride(attempt=2, delivery=1, limit=5), "a retry fences the attempts before"
    assert not claim_may_ride(attempt=1, delivery=0, limit=5), "a delivery not known"
    assert not claim_may_ride(attempt=1, delivery=1, limit=1), "the claim alone reaches the limit"


def test_a_claim_rides_the_first_record_only_when_it_proceeds_on_nothing_stored() -> None:
    j = J().claim(it=0).model(p=0).commit(Action.CONTINUE)
    nothing = seen(j, iteration=1)
    assert claim_step(asked(iteration=1, may_ride=True), nothing) == RideFirstRecord(base=3)
    assert claim_step(asked(iteration=1), nothing) == StoreClaim(base=3, close=(), guessed=False)
    j.claim(it=1).model(p=0)
    found = seen(j, iteration=1)
    step = claim_step(asked(iteration=1, may_ride=True), found)
    assert step == StoreClaim(base=3, close=(), guessed=False), "records to fence or close"
    j.commit(Action.CONTINUE).claim(it=2)
    later = seen(j, iteration=1)
    assert isinstance(claim_step(asked(iteration=1, may_ride=True), later), Stale)


# ---- the claim, step by step: each step and the inputs that give it -----------------


def test_a_claim_with_the_lease_that_could_not_ride_leaves_the_claim_to_its_holder() -> None:
    for fields in ({"delivery": 2}, {"attempt": 2}, {"limit": 1}):
        step = claim_step(asked(with_lease=True, may_ride=True, **fields), ClaimSeen())
        assert step == NoClaim(), fields


def test_a_claim_with_the_lease_of_a_first_dispatch_rides_on_nothing_read() -> None:
    first = asked(with_lease=True, may_ride=True, first_dispatch=True)
    assert claim_step(first, ClaimSeen()) == RideFirstRecord(base=0)
    # Without the engine's word that it is the first dispatch, it reads.
    plain = asked(with_lease=True, may_ride=True)
    assert claim_step(plain, ClaimSeen()) == ReadTail(with_run=True)


def test_a_claim_with_the_lease_answers_only_when_it_rides() -> None:
    lease = asked(iteration=1, with_lease=True, may_ride=True)
    j = J().claim(it=0).model(p=0).commit(Action.CONTINUE)
    assert claim_step(lease, seen(j, iteration=1)) == RideFirstRecord(base=3)
    j.claim(it=1)
    assert claim_step(lease, seen(j, iteration=1)) == NoClaim(), "a record to fence"
    j.commit(Action.CONTINUE)
    assert claim_step(lease, seen(j, iteration=1)) == NoClaim(), "committed: the holder settles"
    ended = ClaimSeen(tail=(), run_ended="run r is cancelled")
    assert claim_step(replace(lease, iteration=0), ended) == NoClaim(), "stale: the holder settles"
    sealed = ClaimSeen(tail=(engine_cancel(4),))
    assert claim_step(lease, sealed) == NoClaim(), "cancelled: the holder is refused"


def test_a_claim_on_a_sealed_journal_is_cancelled_before_its_records_are_read() -> None:
    # The cancel is of iteration 0: the claim would read its records otherwise.
    sealed = ClaimSeen(tail=(engine_cancel(3, reason="stopped"),))
    assert claim_step(asked(), sealed) == Cancelled(reason="stopped")
    assert claim_step(asked(), ClaimSeen(tail=(J().claim(it=0).last,))) == ReadRecords(
        base=0, through=1
    )


def test_a_claim_that_reaches_the_restart_limit_is_stored_then_fails() -> None:
    j = claims(J(), 4)
    assert claim_step(asked(delivery=5), seen(j, iteration=0)) == RestartLimit(
        base=0, guessed=False
    )
    assert claim_step(asked(delivery=5, limit=6), seen(j, iteration=0)) == StoreClaim(
        base=0, close=(), guessed=False
    )
    guess = J().claim(it=0).commit(Action.CONTINUE).last_commit
    on_guess = ClaimSeen(tail=(guess,), guessed=True)
    assert claim_step(asked(iteration=1, limit=1), on_guess) == RestartLimit(base=2, guessed=True)


def test_a_claim_reads_its_iterations_records_only_when_the_tail_is_of_it() -> None:
    j = J().claim(it=0).model(p=0).commit(Action.CONTINUE)
    assert claim_step(asked(iteration=1), ClaimSeen(tail=(j.last,))) == StoreClaim(
        base=3, close=(), guessed=False
    )
    j.claim(it=1).intent(p=0, name="send")
    assert claim_step(asked(iteration=1), ClaimSeen(tail=(j.last,))) == ReadRecords(
        base=3, through=5
    )


def test_a_claim_of_a_retry_closes_what_the_records_leave_open() -> None:
    j = J().claim(it=0, at=1)
    send = j.intent(p=0, name="send").last_intent
    j.commit(Action.FAIL)
    assert claim_step(asked(attempt=2), seen(j, iteration=0)) == StoreClaim(
        base=0, close=(send,), guessed=False
    )


# ---- a cancelled run's journal --------------------------------------------------------


def engine_cancel(seq: int, reason: str = "stop") -> CancelEntry:
    return CancelEntry(seq=seq, iteration=0, attempt=1, writer="", reason=reason)


def test_only_a_tail_that_is_a_cancel_cancels() -> None:
    j = J().claim().intent(p=0, name="charge")
    assert cancel_of([j.last]) is None
    assert cancel_of([]) is None
    assert cancel_of([engine_cancel(3, "operator stop")]) == Cancelled(reason="operator stop")


def test_a_write_refused_by_a_cancel_stores_nothing_but_a_result_of_a_seen_intent() -> None:
    j = J().claim().intent(p=0, name="charge")
    writer, intent = j.last.writer, j.last.seq
    cancel = engine_cancel(intent + 1)
    # A new intent, a model response, a commit: refused.
    assert fenced_out_write(tail=[cancel], first=cancel, writer=writer, result_for=0) == Cancelled(
        reason="stop"
    )
    # The result of the tool that was running: stored after the cancel.
    assert fenced_out_write(
        tail=[cancel], first=cancel, writer=writer, result_for=intent
    ) == StoreAfterCancel(after=cancel.seq, cancel=cancel)
    # Sent again once stored: the one stored answers it.
    kept: list[AnyEntry] = [
        ResultEntry(seq=cancel.seq + 1, iteration=0, attempt=1, writer=writer, intent_seq=intent),
        CancelEntry(seq=cancel.seq + 1, iteration=0, attempt=1, writer=writer, reason="stop"),
    ]
    assert fenced_out_write(
        tail=kept, first=cancel, writer=writer, result_for=intent
    ) == StoredAfterCancel(seq=cancel.seq + 1)


def test_a_result_of_a_writer_a_successor_fenced_before_the_cancel_is_refused() -> None:
    j = J().claim().intent(p=0, name="charge")
    writer, intent = j.last.writer, j.last.seq
    j.claim()  # a successor, before the cancel
    successor = j.last
    cancel = engine_cancel(successor.seq + 1)
    decision = fenced_out_write(tail=[cancel], first=successor, writer=writer, result_for=intent)
    assert decision == Cancelled(reason="stop")


def test_a_write_refused_without_a_cancel_is_fenced_as_before() -> None:
    j = J().claim().intent(p=0, name="charge")
    writer, intent = j.last.writer, j.last.seq
    j.claim()
    assert fenced_out_write(tail=[j.last], first=j.last, writer=writer, result_for=intent) == (
        FencedWrite()
    )


# ---- parallel groups ------------------------------------------------------------------

SEARCH_A, SEND, SEARCH_B = (
    safe("search", b'{"q": "a"}'),
    unsafe("send"),
    safe("search", b'{"q": "b"}'),
)
GROUP = [SEARCH_A, SEND, SEARCH_B]


def test_a_new_group_runs_every_call() -> None:
    j = J().claim().model(p=0)
    decision = decide_tools(j.of(0), attempt=1, position=1, calls=GROUP)
    assert decision == Group(calls=(RunNew(), RunNew(), RunNew()))


def test_an_empty_group_is_refused() -> None:
    assert isinstance(decide_tools(J().claim().of(0), attempt=1, position=0, calls=[]), Mismatch)


def test_each_call_of_a_recorded_group_follows_the_rules_alone() -> None:
    # The first search finished; the send and the second search did not: the
    # result is reused, the unsafe send comes back interrupted with its own
    # partial output (not a sibling's), the safe search runs again.
    j = J().claim().model(p=0).group(p=1, calls=GROUP)
    intents = [e for e in j.entries if isinstance(e, IntentEntry)]
    j.output("sending;", intent=intents[1].seq, index=1)
    j.output("searching b;", intent=intents[2].seq, index=2)
    j.result(intent=intents[0].seq, index=0, output=b'{"hits": 1}')
    first = j.last_result
    j.claim()
    decision = decide_tools(j.of(0), attempt=1, position=1, calls=GROUP)
    assert decision == Group(
        calls=(
            UseResult(result=first),
            Interrupt(intent=intents[1], partial="sending;"),
            RunAgain(intent=intents[2]),
        )
    )


def test_results_answer_their_own_call_by_index_not_by_completion_order() -> None:
    j = J().claim().model(p=0).group(p=1, calls=GROUP)
    seq = j.last.seq
    j.result(intent=seq, index=2, output=b'{"third": true}')
    third = j.last_result
    j.result(intent=seq, index=0, output=b'{"first": true}')
    first = j.last_result
    decision = decide_tools(j.claim().of(0), attempt=1, position=1, calls=GROUP)
    assert isinstance(decision, Group)
    assert decision.calls[0] == UseResult(result=first)
    assert decision.calls[2] == UseResult(result=third)
    assert isinstance(decision.calls[1], Interrupt)


def test_a_group_split_over_records_runs_the_calls_whose_intent_was_not_stored() -> None:
    # A crash between the group's two intent records: none of its calls started.
    j = J().claim().model(p=0).group(p=1, calls=GROUP[:2], size=3)
    first, send = [e for e in j.entries if isinstance(e, IntentEntry)]
    decision = decide_tools(j.claim().of(0), attempt=1, position=1, calls=GROUP)
    assert decision == Group(
        calls=(RunAgain(intent=first), Interrupt(intent=send, partial=""), RunNew())
    )


@pytest.mark.parametrize(
    ("calls", "why"),
    [
        (GROUP[:2], "parallel group of 3 calls from position 1; the handler now makes 2"),
        ([*GROUP, SEARCH_A], "parallel group of 3 calls from position 1; the handler now makes 4"),
        ([SEARCH_A, unsafe("send", b'{"to": "x"}'), SEARCH_B], "recorded tool 'send' with other"),
        ([SEARCH_A, SEARCH_B, SEND], "recorded tool 'send' with other input"),
    ],
    ids=["fewer calls", "more calls", "other input", "other order"],
)
def test_another_group_at_a_recorded_group_is_a_mismatch(calls: list[ToolCall], why: str) -> None:
    j = J().claim().model(p=0).group(p=1, calls=GROUP).claim()
    decision = decide_tools(j.of(0), attempt=1, position=1, calls=calls)
    assert isinstance(decision, Mismatch) and why in decision.reason


def test_a_group_where_one_call_was_made_alone_is_a_mismatch_both_ways() -> None:
    alone = J().claim().model(p=0).intent(p=1, name="search", input=SEARCH_A.input, safe=True)
    decision = decide_tools(alone.claim().of(0), attempt=1, position=1, calls=GROUP)
    assert isinstance(decision, Mismatch) and "called alone" in decision.reason
    grouped = J().claim().model(p=0).group(p=1, calls=GROUP).claim()
    single = decide_tool(grouped.of(0), attempt=1, position=1, call=SEARCH_A)
    assert isinstance(single, Mismatch) and "parallel group of 3" in single.reason


def test_a_group_at_a_model_response_is_a_mismatch() -> None:
    j = J().claim().model(p=0).model(p=1).claim()
    decision = decide_tools(j.of(0), attempt=1, position=1, calls=GROUP)
    assert isinstance(decision, Mismatch) and "model call" in decision.reason


def test_a_group_starting_elsewhere_is_a_mismatch() -> None:
    j = J().claim().model(p=0).group(p=1, calls=GROUP).claim()
    decision = decide_tools(j.of(0), attempt=1, position=2, calls=GROUP[1:])
    assert isinstance(decision, Mismatch) and "from position 1" in decision.reason


def test_a_new_attempt_honours_each_unsafe_call_of_an_earlier_group_once() -> None:
    twice = [SEND, SEND]
    j = J().claim(at=1).model(p=0).group(p=1, calls=twice)
    seq = j.last.seq
    j.result(intent=seq, index=0, output=b'{"n": 1}')
    r0 = j.last_result
    j.result(intent=seq, index=1, output=b'{"n": 2}')
    r1 = j.last_result
    earlier = [e for e in j.entries if isinstance(e, IntentEntry)]
    j.commit(Action.FAIL).claim(at=2).model(p=0)
    decision = decide_tools(j.of(0), attempt=2, position=1, calls=twice)
    assert decision == Group(
        calls=(Honour(earlier=earlier[0], result=r0), Honour(earlier=earlier[1], result=r1))
    )
    # One was honoured already by this writer: only the other is left.
    decision = decide_tools(
        j.of(0), attempt=2, position=1, calls=twice, honoured_members=[earlier[0].ref]
    )
    assert decision == Group(calls=(Honour(earlier=earlier[1], result=r1), RunNew()))


def test_a_new_attempts_claim_closes_each_unanswered_call_of_a_group() -> None:
    j = J().claim(at=1).model(p=0).group(p=1, calls=GROUP)
    seq = j.last.seq
    j.result(intent=seq, index=1)
    j.commit(Action.FAIL)
    decision = claim(j, attempt=2)
    assert isinstance(decision, Proceed)
    assert [(i.seq, i.index) for i in decision.close] == [(seq, 0), (seq, 2)]


def test_a_second_result_of_a_group_after_a_cancel_is_stored_after_the_first() -> None:
    writer_j = J().claim().model(p=0).group(p=1, calls=GROUP)
    seq, writer = writer_j.last.seq, writer_j.last.writer
    cancel = CancelEntry(seq=seq + 1, iteration=0, attempt=1, writer="", reason="stop")
    copy = replace(cancel, seq=seq + 2, writer=writer)
    kept_first: list[AnyEntry] = [
        ResultEntry(
            seq=seq + 2, iteration=0, attempt=1, writer=writer, leading=True, intent_seq=seq
        ),
        copy,
    ]
    decision = fenced_out_write(
        tail=kept_first, first=cancel, writer=writer, result_for=seq, result_index=1
    )
    assert decision == StoreAfterCancel(after=seq + 2, cancel=copy)
    again = fenced_out_write(
        tail=kept_first, first=cancel, writer=writer, result_for=seq, result_index=0
    )
    assert again == StoredAfterCancel(seq=seq + 2)


def test_a_groups_records_read_back_as_one_intent_per_call() -> None:
    record = pb.Record(
        seq=7,
        tool_intents=pb.ToolIntents(
            intents=[
                pb.ToolIntent(position=1, name="search", input=b"{}", replay=pb.REPLAY_SAFE),
                pb.ToolIntent(position=2, name="send", input=b"{}", replay=pb.REPLAY_UNSAFE),
            ],
            group_size=2,
            group_position=1,
        ),
    )
    found = convert.entries(record)
    assert [(e.seq, e.index, e.leading) for e in found if isinstance(e, IntentEntry)] == [
        (7, 0, True),
        (7, 1, False),
    ]
    assert [e.safe for e in found if isinstance(e, IntentEntry)] == [True, False]


# ---- approvals: a call's approval is part of the call ---------------------------------

PAY = b'{"cents": 500}'
PAY_DIGEST = "sha256:" + "a" * 64


def _mark(request_id: str) -> ApprovalMark:
    return ApprovalMark(call="r.agent.0.1", digest=PAY_DIGEST, approved=True, request_id=request_id)


def _pay(j: J, *, p: int, approval: str = "") -> IntentEntry:
    """An intent of ``pay`` at ``p``: asking for approval, or under ``approval``."""
    mark = _mark(approval) if approval else None
    j._add(
        IntentEntry, position=p, name="pay", input=PAY, safe=False, digest=PAY_DIGEST,
        approval=mark,
    )  # fmt: skip
    return j.last_intent


def _asked(j: J, *, p: int) -> IntentEntry:
    intent = _pay(j, p=p)
    j._add(ResultEntry, intent_seq=intent.seq, awaiting_approval=True)
    return intent


def _under(request_id: str) -> ToolCall:
    return ToolCall(name="pay", input=PAY, safe=False, digest=PAY_DIGEST, approval_id=request_id)


def test_the_decided_call_runs_at_the_position_that_asked() -> None:
    j = J().claim().model(p=0)
    _asked(j, p=1)
    j.claim()  # a redelivery that placed the approval the first delivery had not
    assert decide_tool(j.of(0), attempt=1, position=1, call=_under("approval-1")) == RunNew()


def test_the_decided_call_recorded_there_is_replayed_not_run_twice() -> None:
    j = J().claim().model(p=0)
    _asked(j, p=1)
    j.claim()
    decided = _pay(j, p=1, approval="approval-1")
    j.claim()
    decision = decide_tool(j.of(0), attempt=1, position=1, call=_under("approval-1"))
    assert decision == Interrupt(intent=decided, partial="")  # started, never finished
    result = j.claim().result(intent=decided.seq).last_result
    decision = decide_tool(j.of(0), attempt=1, position=1, call=_under("approval-1"))
    assert decision == UseResult(result=result)


def test_a_call_under_another_approval_than_recorded_is_a_mismatch() -> None:
    j = J().claim().model(p=0)
    _asked(j, p=1)
    j.claim()
    _pay(j, p=1, approval="approval-1")
    j.result()
    j.claim()
    decision = decide_tool(j.of(0), attempt=1, position=1, call=_under("approval-2"))
    assert isinstance(decision, Mismatch)
    asking = ToolCall(name="pay", input=PAY, safe=False, digest=PAY_DIGEST)
    assert isinstance(decide_tool(j.of(0), attempt=1, position=1, call=asking), UseResult)


# ---- approvals inside a parallel group ------------------------------------------------

ASKING = ToolCall(name="pay", input=PAY, safe=False, digest=PAY_DIGEST)


def test_each_call_of_a_group_is_decided_with_its_approval_as_if_alone() -> None:
    # A group of three whose second call asked for approval: the others ran,
    # the ask was answered awaiting_approval.
    asking_group = [SEARCH_A, ASKING, SEARCH_B]
    j = J().claim().model(p=0).group(p=1, calls=asking_group)
    seq = j.last.seq
    ask = [e for e in j.entries if isinstance(e, IntentEntry)][1]
    assert ask.asks_approval and ask.index == 1
    j.result(intent=seq, index=0, output=b'{"hits": 1}')
    first = j.last_result
    j._add(ResultEntry, intent_seq=seq, intent_index=1, awaiting_approval=True)
    awaiting = j.last_result
    j.result(intent=seq, index=2, output=b'{"hits": 2}')
    third = j.last_result
    j.claim()
    # The same group, still asking: every call has its result, the ask its awaiting one.
    assert decide_tools(j.of(0), attempt=1, position=1, calls=asking_group) == Group(
        calls=(UseResult(result=first), UseResult(result=awaiting), UseResult(result=third))
    )
    # A redelivery that placed the approval: the decided call runs where it asked.
    approved_group = [SEARCH_A, _under("approval-1"), SEARCH_B]
    assert decide_tools(j.of(0), attempt=1, position=1, calls=approved_group) == Group(
        calls=(UseResult(result=first), RunNew(), UseResult(result=third))
    )
    # Its intent stored (a record of the group's, index 0 in it), it is that
    # call's from then on: interrupted before its result, then its result.
    j.group(p=2, calls=[_under("approval-1")], size=3, start=1)
    decided = j.last_intent
    assert (decided.index, decided.approval) == (0, _mark("approval-1"))
    j.claim()
    assert decide_tools(j.of(0), attempt=1, position=1, calls=approved_group) == Group(
        calls=(
            UseResult(result=first),
            Interrupt(intent=decided, partial=""),
            UseResult(result=third),
        )
    )
    j.result(intent=decided.seq, index=0, output=b'{"paid": true}')
    paid = j.last_result
    assert decide_tools(j.claim().of(0), attempt=1, position=1, calls=approved_group) == Group(
        calls=(UseResult(result=first), UseResult(result=paid), UseResult(result=third))
    )
    # Under another approval than the one recorded: a mismatch, as alone.
    other = [SEARCH_A, _under("approval-2"), SEARCH_B]
    decision = decide_tools(j.of(0), attempt=1, position=1, calls=other)
    assert isinstance(decision, Mismatch) and "position 2" in decision.reason


def test_a_call_of_a_group_that_now_needs_approval_where_none_was_asked_is_a_mismatch() -> None:
    plain = ToolCall(name="pay", input=PAY, safe=False)
    j = J().claim().model(p=0).group(p=1, calls=[SEARCH_A, plain]).claim()
    decision = decide_tools(j.of(0), attempt=1, position=1, calls=[SEARCH_A, ASKING])
    assert isinstance(decision, Mismatch) and "position 2" in decision.reason


# ---- a placement's earlier try ------------------------------------------------------


def test_a_placements_earlier_try_wrote_only_its_inputs_at_its_position() -> None:
    # What a retried place-inputs call finds of its writer after its token:
    # nothing, or the inputs an earlier try of it placed, is a retry's lot.
    j = J().claim().placed("s1", p=0).placed("s2", p=0)
    assert placed_by_earlier_try([], position=0)
    assert placed_by_earlier_try(j.entries[1:], position=0)


@pytest.mark.parametrize("after", ["commit", "model", "placement"])
def test_a_writer_that_went_on_past_a_placement_leaves_its_late_copy_behind(after: str) -> None:
    # The writer went on past the call (another try answered it): a late copy
    # of it must write nothing, least of all after the iteration's commit.
    j = J().claim().placed("s1", p=0)
    match after:
        case "commit":
            j.commit(Action.COMPLETE)
        case "model":
            j.model(p=1)
        case _:
            j.placed("s2", p=1)
    assert not placed_by_earlier_try(j.entries[1:], position=0)
