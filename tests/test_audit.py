"""The journal audit on golden journals: sound ones pass, each hand-made
corruption is reported by exactly the rule it breaks. Pure: no event loop."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dagnats.core.approvals import call_digest
from dagnats.journal import convert
from dagnats.journal.audit import EngineStep, Finding, check_run, check_step
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
)
from dagnats.journal.v1 import journal_pb2 as pb


class Journal:
    """Builds one step's records as the journal service would store them.

    Each record gets the next sequence and, unless ``expected=`` says otherwise,
    expects the current tail (the chain a fenced append produces). A claim makes
    its writer the current one; ``by=`` writes as another (a zombie).
    """

    def __init__(self) -> None:
        self.entries: list[AnyEntry] = []
        self._dispatch: dict[str, tuple[int, int]] = {}
        self._position: dict[str, int] = {}
        self._current = ""

    def claim(self, writer: str, iteration: int, attempt: int = 1) -> int:
        self._dispatch[writer] = (iteration, attempt)
        self._position[writer] = 0
        self._current = writer
        return self._add(ClaimEntry, writer, None, delivery=1, worker_id=f"worker-{writer}")

    def model(self, *, by: str | None = None, expected: int | None = None) -> int:
        writer = by or self._current
        return self._add(
            ModelEntry, writer, expected, position=self._next(writer), response=b'{"text": "hi"}'
        )

    def intent(
        self,
        name: str,
        *,
        safe: bool = False,
        honours: int = 0,
        by: str | None = None,
        expected: int | None = None,
    ) -> int:
        writer = by or self._current
        return self._add(
            IntentEntry,
            writer,
            expected,
            position=self._next(writer),
            name=name,
            input=b"{}",
            safe=safe,
            honours_seq=honours,
        )

    def output(self, intent_seq: int, *, by: str | None = None) -> int:
        return self._add(OutputEntry, by or self._current, None, intent_seq=intent_seq, chunk="..")

    def result(
        self,
        intent_seq: int,
        *,
        interrupted: bool = False,
        by: str | None = None,
        expected: int | None = None,
    ) -> int:
        return self._add(
            ResultEntry,
            by or self._current,
            expected,
            intent_seq=intent_seq,
            output=b"" if interrupted else b'"ok"',
            interrupted=interrupted,
        )

    def commit(
        self, action: str, *, by: str | None = None, expected: int | None = None, reason: str = ""
    ) -> int:
        return self._add(
            CommitEntry, by or self._current, expected, action=Action(action), reason=reason
        )

    def placed(self, request_id: str, *, carried: bool = False) -> int:
        writer = self._current
        return self._add(
            InputEntry,
            writer,
            None,
            position=self._next(writer),
            request_id=request_id,
            mode=1,
            content=b'{"text": "hi"}',
            carried=carried,
        )

    @property
    def tail(self) -> int:
        return self.entries[-1].seq if self.entries else 0

    def _next(self, writer: str) -> int:
        position = self._position[writer]
        self._position[writer] = position + 1
        return position

    def _add(self, kind: type, writer: str, expected: int | None, **fields: object) -> int:
        iteration, attempt = self._dispatch[writer]
        seq = self.tail + 1
        self.entries.append(
            kind(
                seq=seq,
                iteration=iteration,
                attempt=attempt,
                writer=writer,
                expected_seq=self.tail if expected is None else expected,
                **fields,
            )
        )
        return seq


def rules(findings: list[Finding]) -> list[str]:
    return [f.rule for f in findings]


def only(findings: list[Finding], rule: str) -> Finding:
    assert rules(findings) == [rule], findings
    return findings[0]


def two_iterations_with_tools() -> Journal:
    """Iteration 0 calls a safe tool and continues; iteration 1 an unsafe one and completes."""
    j = Journal()
    j.claim("w1", 0)
    j.model()
    search = j.intent("search", safe=True)
    j.output(search)
    j.result(search)
    j.model()
    j.commit("continue")
    j.claim("w2", 1)
    j.model()
    charge = j.intent("charge")
    j.result(charge)
    j.model()
    j.commit("complete")
    return j


# ---- sound journals ----------------------------------------------------------------


def test_a_finished_journal_with_tool_calls_is_sound() -> None:
    j = two_iterations_with_tools()
    assert check_step("agent", j.entries, engine_iterations=1) == []


def test_retries_after_a_failure_a_timeout_and_the_restart_limit_are_sound() -> None:
    j = Journal()
    j.claim("w1", 0, 1)
    send = j.intent("send")
    j.result(send)
    j.commit("fail")  # the attempt failed; the engine retries
    j.claim("w2", 0, 2)
    j.result(j.intent("send", honours=send))  # honours the earlier unsafe intent
    charge = j.intent("charge")  # then w2 times out mid-tool
    j.claim("w3", 0, 3)
    j.result(charge, interrupted=True)  # the claim answers attempt 2's intent
    j.commit("pause")
    for writer in ("w4", "w5", "w6"):
        j.claim(writer, 0, 4)  # crashes right after claiming, three times
    j.commit("fail", reason="restart_limit")
    j.claim("w7", 0, 5)
    j.model()
    j.commit("continue")
    j.claim("w8", 1)
    j.commit("complete")
    assert check_step("agent", j.entries, engine_iterations=1) == []


def test_a_fenced_zombie_that_writes_nothing_more_is_sound() -> None:
    j = Journal()
    j.claim("zombie", 0)
    j.model()
    lookup = j.intent("lookup", safe=True)  # the zombie stalls inside the tool
    j.claim("successor", 0)  # the same task, redelivered
    j.model()
    j.result(lookup)  # safe both times: run again under the same intent
    j.commit("continue")
    assert check_step("agent", j.entries, engine_iterations=1) == []


def test_a_running_journal_may_have_a_tool_still_running() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    j.intent("deploy")
    assert check_step("agent", j.entries) == []


def test_a_new_attempt_may_still_be_closing_earlier_intents() -> None:
    j = Journal()
    j.claim("w1", 0, 1)
    j.intent("charge")
    j.claim("w2", 0, 2)  # crashed before answering attempt 1's intent
    assert check_step("agent", j.entries) == []


def test_check_run_audits_every_step_in_order() -> None:
    sound = two_iterations_with_tools().entries
    broken = Journal()
    broken.claim("w1", 0)
    broken.intent("lost")
    broken.commit("complete")
    findings = check_run({"b": broken.entries, "a": sound}, {"a": 1, "b": 0})
    assert [(f.step_id, f.rule) for f in findings] == [("b", "unanswered_intent")]
    assert [f.step_id for f in check_run({"a": sound, "b": sound}, {"a": 2})] == ["a"]


# ---- corrupted journals ------------------------------------------------------------


def test_two_commits_ending_one_iteration() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    first = j.commit("continue")
    second = j.commit("complete")
    finding = only(check_step("agent", j.entries), "commit_count")
    assert finding.seq == second
    assert finding.message == f"iteration 0 has 2 commits that end it (seq {first} and {second})"


def test_two_commits_of_one_attempt() -> None:
    j = Journal()
    j.claim("w1", 0, 1)
    first = j.commit("fail")
    second = j.commit("pause")
    finding = only(check_step("agent", j.entries), "commit_count")
    assert finding.seq == second
    assert f"attempt 1 has 2 commits (seq {first} and {second})" in finding.message


def test_a_record_after_the_commit_that_ended_its_iteration() -> None:
    j = Journal()
    j.claim("w1", 0)
    end = j.commit("continue")
    late = j.model()
    finding = only(check_step("agent", j.entries), "commit_count")
    assert finding.seq == late
    assert f"commit at seq {end}" in finding.message and f"seq {late}" in finding.message


def test_a_record_after_its_attempt_failed() -> None:
    j = Journal()
    j.claim("w1", 0, 1)
    end = j.commit("fail")
    late = j.model()
    finding = only(check_step("agent", j.entries), "commit_count")
    assert finding.seq == late
    assert f"attempt 1 ended with the commit at seq {end} (fail)" in finding.message


def test_an_intent_without_a_result_in_a_finished_journal() -> None:
    j = Journal()
    j.claim("w1", 0)
    lost = j.intent("send_email")
    j.model()
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "unanswered_intent")
    assert finding.seq == lost
    assert (
        finding.message
        == f"tool intent 'send_email' at seq {lost} (iteration 0 attempt 1) has no result"
    )


def test_an_earlier_attempt_intent_left_open_by_a_claim_that_moved_on() -> None:
    j = Journal()
    j.claim("w1", 0, 1)
    lost = j.intent("charge")
    j.claim("w2", 0, 2)
    j.model()  # the claim should have answered `lost` before this
    finding = only(check_step("agent", j.entries), "unanswered_intent")
    assert finding.seq == lost


def test_an_intent_with_two_results() -> None:
    j = Journal()
    j.claim("w1", 0)
    charge = j.intent("charge")
    first = j.result(charge)
    second = j.result(charge)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "double_result")
    assert finding.seq == second
    assert f"seq {charge} has 2 results (seq {first} and {second})" in finding.message


def test_a_record_after_the_claim_that_fenced_its_writer() -> None:
    j = Journal()
    j.claim("zombie", 0)
    j.model()
    fence = j.claim("successor", 0)
    late = j.model(by="zombie")  # a zombie that re-read the tail instead of stopping
    j.model()
    j.commit("continue")
    finding = only(check_step("agent", j.entries, engine_iterations=1), "after_fence")
    assert finding.seq == late
    assert f"seq {late}" in finding.message and f"claim at seq {fence}" in finding.message
    assert "zombie" in finding.message and "successor" in finding.message


def test_a_record_by_a_writer_that_never_claimed() -> None:
    j = Journal()
    holder = j.claim("w1", 0)
    j._dispatch["ghost"] = (0, 1)
    j._position["ghost"] = 0
    ghost = j.model(by="ghost")
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "after_fence")
    assert finding.seq == ghost
    assert "never claimed" in finding.message and f"seq {holder}" in finding.message


def test_a_broken_chain() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    broken = j.model(expected=1)  # the tail was seq 2
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "chain")
    assert finding.seq == broken
    assert finding.message == (
        f"seq {broken} (model response) expected the tail at seq 1, "
        "but the record before it is seq 2"
    )


def test_a_first_record_that_expected_a_tail() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.commit("complete")
    j.entries[0] = ClaimEntry(seq=1, iteration=0, attempt=1, writer="w1", expected_seq=7)
    finding = only(check_step("agent", j.entries), "chain")
    assert finding.seq == 1 and "first record" in finding.message and "seq 7" in finding.message


def test_a_result_for_a_missing_intent() -> None:
    j = Journal()
    j.claim("w1", 0)
    orphan = j.result(99)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "orphan_result")
    assert finding.seq == orphan
    assert f"seq {orphan} answers seq 99, which is not in the journal" in finding.message


def test_a_result_that_answers_a_model_response() -> None:
    j = Journal()
    j.claim("w1", 0)
    model = j.model()
    orphan = j.result(model)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "orphan_result")
    assert f"answers seq {model}, which is a model response" in finding.message
    assert finding.seq == orphan


def test_the_engine_counting_other_iterations_than_the_commits() -> None:
    j = two_iterations_with_tools()
    finding = only(check_step("agent", j.entries, engine_iterations=2), "iteration_count")
    assert finding.seq == 0
    assert finding.message == (
        "the engine counts 2 iterations of this step, but the journal has 1 continue commit (seq 7)"
    )


def test_a_running_or_cancelled_step_may_lag_its_newest_continue_by_one() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.commit("continue")
    j.claim("w1", 1)
    j.commit("continue")
    # The event of the second continue is in flight, or a cancel dropped it.
    assert check_step("agent", j.entries, engine_iterations=1, settling=True) == []
    assert check_step("agent", j.entries, engine_iterations=2, settling=True) == []
    # Never more than one behind, never ahead, and not once the step settled.
    for engine, settling in ((0, True), (3, True), (1, False)):
        found = check_step("agent", j.entries, engine_iterations=engine, settling=settling)
        assert rules(found) == ["iteration_count"], (engine, settling)


def test_a_loop_that_moves_on_while_audited_is_sound_between_its_two_counts() -> None:
    j = Journal()
    for iteration in range(3):
        j.claim("w1", iteration)
        j.commit("continue")
    j.claim("w1", 3)
    # Counted 1 before the journal was read and 3 after: the journal's 3 lie between.
    assert check_step("agent", j.entries, engine_iterations=1, engine_iterations_after=3) == []
    # Counted 2 after, the 3rd in flight: sound only while the step runs.
    assert (
        check_step(
            "agent", j.entries, engine_iterations=1, engine_iterations_after=2, settling=True
        )
        == []
    )
    for before, after in ((4, 4), (1, 2), (0, 1)):
        found = check_step(
            "agent", j.entries, engine_iterations=before, engine_iterations_after=after
        )
        assert rules(found) == ["iteration_count"], (before, after)
    found = check_step("agent", j.entries, engine_iterations=4, engine_iterations_after=5)
    assert only(found, "iteration_count").message.startswith("the engine counts 4 iterations")
    found = check_step("agent", j.entries, engine_iterations=0, engine_iterations_after=1)
    assert only(found, "iteration_count").message.startswith("the engine counts 1 iteration ")


def test_a_lagging_count_is_sound_only_when_the_newest_commit_is_a_continue() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.commit("continue")
    j.claim("w1", 1)
    j.commit("pause")
    found = check_step("agent", j.entries, engine_iterations=0, settling=True)
    assert rules(found) == ["iteration_count"]


def test_findings_come_in_sequence_order_with_the_count_last() -> None:
    j = Journal()
    j.claim("w1", 0)
    lost = j.intent("lost")
    j.result(99)
    j.commit("complete")
    findings = check_step("agent", j.entries, engine_iterations=3)
    assert rules(findings) == ["unanswered_intent", "orphan_result", "iteration_count"]
    assert findings[0].seq == lost


def test_an_input_placed_twice() -> None:
    j = Journal()
    j.claim("w1", 0)
    first = j.placed("msg-1")
    j.commit("continue")
    j.claim("w2", 1)
    j.placed("msg-2")
    again = j.placed("msg-1")
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "input_placed_twice")
    assert finding.seq == again
    assert finding.message == f"input 'msg-1' was placed at seq {first} and again at seq {again}"


def test_an_input_carried_into_a_retry_is_placed_once() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.placed("msg-1")
    j.commit("fail")
    j.claim("w2", 0, attempt=2)
    j.placed("msg-1", carried=True)
    j.commit("complete")
    assert check_step("agent", j.entries) == []


# ---- the engine's outcome against the last commit -------------------------------------


def completed_with(output: bytes) -> Journal:
    j = Journal()
    j.claim("w1", 0)
    j.commit("continue")
    j.claim("w2", 1)
    j.model()
    j._add(CommitEntry, "w2", None, action=Action.COMPLETE, output=output)
    return j


def test_a_completed_step_shows_its_last_commit() -> None:
    j = completed_with(b'"done"')
    step = EngineStep(status="completed", iteration=1, output=b'"done"')
    assert check_step("agent", j.entries, engine_step=step) == []


def test_a_completed_step_with_another_output_than_its_commit() -> None:
    j = completed_with(b'"successor"')
    step = EngineStep(status="completed", iteration=1, output=b'"zombie"')
    finding = only(check_step("agent", j.entries, engine_step=step), "outcome")
    assert finding.seq == j.tail
    assert finding.message == (
        "the engine shows the step's output as '\"zombie\"', but the complete commit "
        "at seq 5 records '\"successor\"'"
    )


def test_a_completed_step_whose_last_commit_is_no_complete() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.commit("continue")
    step = EngineStep(status="completed", iteration=0, output=b"")
    finding = only(check_step("agent", j.entries, engine_step=step), "outcome")
    assert "its last commit is a continue (seq 2)" in finding.message
    elsewhere = EngineStep(status="completed", iteration=0, output=b'"done"')
    assert rules(check_step("agent", completed_with(b'"done"').entries, engine_step=elsewhere)) == [
        "outcome"
    ]


def test_a_running_step_shows_the_continue_that_brought_it_there() -> None:
    j = Journal()
    j.claim("w1", 0)
    j._add(CommitEntry, "w1", None, action=Action.CONTINUE, output=b'"turn 0"')
    j.claim("w2", 1)
    j._add(CommitEntry, "w2", None, action=Action.CONTINUE, output=b'"turn 1"')
    for status in ("running", "waiting"):
        # At iteration 2, or still at 1 while the newest continue is on its way.
        at_two = EngineStep(status=status, iteration=2, output=b'"turn 1"')
        at_one = EngineStep(status=status, iteration=1, output=b'"turn 0"')
        assert check_step("agent", j.entries, engine_step=at_two) == []
        assert check_step("agent", j.entries, engine_step=at_one) == []
    other = EngineStep(status="running", iteration=2, output=b'"zombie"')
    assert rules(check_step("agent", j.entries, engine_step=other)) == ["outcome"]
    ahead = EngineStep(status="running", iteration=3, output=b'"turn 1"')
    finding = only(check_step("agent", j.entries, engine_step=ahead), "outcome")
    assert "no continue commit of iteration 2" in finding.message


def test_a_failed_or_cancelled_step_is_not_compared() -> None:
    j = completed_with(b'"done"')
    for status in ("failed", "cancelled"):
        step = EngineStep(status=status, iteration=0, output=b"")
        assert check_step("agent", j.entries, engine_step=step) == []


# ---- records that hold two entries: leading entries (ADR 24) -----------------------------


def merged_turns(*, expected: dict[int, int] | None = None, handed: bool = False) -> list[AnyEntry]:
    """Two tool turns stored as the SDK stores them: a claim, the response with
    the intent it asks for, the result with the commit; then an answer with
    its commit. ``expected`` overrides a record's expected tail. ``handed``:
    iterations 1 and 2 were handed over with the commit before them, their
    claim stored ahead of their first record (the hand-over)."""
    bodies: list[Any] = []
    for iteration, name in ((0, "search"), (1, "charge")):
        if not (handed and iteration):
            bodies.append((iteration, pb.Record(claim=pb.Claim(delivery=1))))
        intent_seq = len(bodies) + 1
        bodies += [
            (
                iteration,
                pb.Record(
                    leading_model=pb.ModelCall(position=0, response=b"{}"),
                    tool_intent=pb.ToolIntent(position=1, name=name, input=b"{}"),
                ),
            ),
            (
                iteration,
                pb.Record(
                    leading_tool_result=pb.ToolResult(intent_seq=intent_seq, output=b'"ok"'),
                    commit=pb.Commit(action=pb.ACTION_CONTINUE),
                ),
            ),
        ]
    if not handed:
        bodies.append((2, pb.Record(claim=pb.Claim(delivery=1))))
    bodies += [
        (
            2,
            pb.Record(
                leading_model=pb.ModelCall(position=0, response=b"{}"),
                commit=pb.Commit(action=pb.ACTION_COMPLETE),
            ),
        ),
    ]
    records = []
    for seq, (iteration, body) in enumerate(bodies, start=1):
        record = pb.Record(iteration=iteration, attempt=1, writer=f"{iteration:016x}")
        record.MergeFrom(body)
        if handed and iteration and bodies[seq - 2][0] != iteration:
            record.leading_claim.CopyFrom(pb.Claim(delivery=1))
        record.seq = seq
        record.expected_seq = (expected or {}).get(seq, seq - 1)
        records.append(record)
    return convert.all_entries(records)


def test_records_that_hold_two_entries_are_sound() -> None:
    entries = merged_turns()
    assert len(entries) == 13, "8 records, 5 of them with an entry ahead of their kind"
    assert check_step("agent", entries, engine_iterations=2) == []
    # In any order the service hands them over.
    assert check_step("agent", entries[::-1], engine_iterations=2) == []


def test_claims_handed_over_with_the_commit_before_are_sound() -> None:
    entries = merged_turns(handed=True)
    assert len(entries) == 13, "6 records: 2 with three entries, 3 with two"
    claims = [e for e in entries if isinstance(e, ClaimEntry)]
    assert [(c.seq, c.iteration, c.leading) for c in claims] == [
        (1, 0, False),
        (4, 1, True),
        (6, 2, True),
    ]
    assert check_step("agent", entries, engine_iterations=2) == []
    assert check_step("agent", entries[::-1], engine_iterations=2) == []


def test_a_handed_over_dispatch_whose_claim_was_not_stored() -> None:
    entries = [
        e for e in merged_turns(handed=True) if not (isinstance(e, ClaimEntry) and e.seq == 4)
    ]
    findings = check_step("agent", entries, engine_iterations=2)
    assert {f.rule for f in findings} == {"after_fence"}
    assert [f.seq for f in findings] == [4, 4, 5, 5], "every entry of the unclaimed writer"
    assert "never claimed" in findings[0].message


def test_a_broken_chain_at_a_record_of_two_entries_is_one_finding() -> None:
    finding = only(check_step("agent", merged_turns(expected={5: 3})), "chain")
    assert finding.seq == 5
    assert finding.message == (
        "seq 5 (tool intent 'charge') expected the tail at seq 3, but the record before it is seq 4"
    )


def test_a_result_stored_with_a_commit_must_answer_an_intent() -> None:
    entries = [
        replace(e, intent_seq=1) if isinstance(e, ResultEntry) and e.seq == 3 else e
        for e in merged_turns()
    ]
    findings = check_step("agent", entries)
    assert rules(findings) == ["unanswered_intent", "orphan_result"]
    assert findings[0].seq == 2 and "'search' at seq 2" in findings[0].message
    assert findings[1].seq == 3 and "answers seq 1, which is a claim" in findings[1].message


# ---- a cancelled run ------------------------------------------------------------------


def cancelled_journal() -> tuple[Journal, int]:
    """A holder's tool runs when the engine appends the cancel (whatever the
    tail); its result is stored after it, ahead of a copy of the cancel."""
    j = Journal()
    j.claim("a", 0)
    intent = j.intent("charge")
    j.output(intent)
    j.entries.append(CancelEntry(seq=j.tail + 1, iteration=0, attempt=1, writer="", reason="stop"))
    engine = j.tail
    j.entries.append(
        ResultEntry(
            seq=engine + 1,
            iteration=0,
            attempt=1,
            writer="a",
            expected_seq=engine,
            intent_seq=intent,
            interrupted=True,
            leading=True,
        )
    )
    j.entries.append(
        CancelEntry(
            seq=engine + 1, iteration=0, attempt=1, writer="a", expected_seq=engine, reason="stop"
        )
    )
    return j, engine


def test_a_cancelled_journal_with_the_running_tools_result_after_the_cancel_is_sound() -> None:
    j, _ = cancelled_journal()
    assert check_step("agent", j.entries, engine_iterations=0, settling=True) == []


def test_a_journal_that_holds_only_the_cancel_is_not_checked() -> None:
    only = [CancelEntry(seq=7, iteration=3, attempt=1, writer="", reason="stop")]
    assert check_step("plain", only, engine_iterations=3) == []


def test_a_cancel_after_a_commit_of_its_iteration_is_no_late_record() -> None:
    j = Journal()
    j.claim("a", 0)
    j.commit("continue")
    j.entries.append(CancelEntry(seq=j.tail + 1, iteration=0, attempt=1, writer="", reason="x"))
    assert check_step("agent", j.entries, engine_iterations=0, settling=True) == []


def test_a_record_after_the_cancel_that_is_no_cancel_breaks_the_chain_or_the_fence() -> None:
    j, engine = cancelled_journal()
    j.entries.append(
        ClaimEntry(seq=j.tail + 1, iteration=0, attempt=2, writer="b", expected_seq=engine)
    )
    assert "chain" in rules(check_step("agent", j.entries))


# ---- parallel groups ----------------------------------------------------------------


def group(j: Journal, calls: list[tuple[str, bool]], *, size: int = 0, start: int = -1) -> int:
    """One record holding the intents of a parallel group's ``calls`` (name,
    safe) at the writer's next positions; its sequence."""
    writer = j._current
    iteration, attempt = j._dispatch[writer]
    seq = j.tail + 1
    first = j._position[writer]
    for index, (name, safe) in enumerate(calls):
        j.entries.append(
            IntentEntry(
                seq=seq,
                iteration=iteration,
                attempt=attempt,
                writer=writer,
                expected_seq=seq - 1,
                leading=index < len(calls) - 1,
                position=j._next(writer),
                name=name,
                input=b"{}",
                safe=safe,
                index=index,
                group_size=size or len(calls),
                group_position=first if start < 0 else start,
            )
        )
    return seq


def group_result(
    j: Journal, seq: int, index: int, *, by: str = "", interrupted: bool = False
) -> int:
    writer = by or j._current
    return j._add(
        ResultEntry,
        writer,
        None,
        intent_seq=seq,
        intent_index=index,
        output=b"" if interrupted else b'"ok"',
        interrupted=interrupted,
    )


CALLS = [("search", True), ("send", False), ("search", True)]


def test_a_finished_group_answered_in_any_order_is_sound() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    seq = group(j, CALLS)
    for index in (2, 0, 1):
        group_result(j, seq, index)
    j.model()
    j.commit("complete")
    assert check_step("agent", j.entries) == []


def test_a_group_taken_over_with_its_unsafe_call_interrupted_is_sound() -> None:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    seq = group(j, CALLS)
    group_result(j, seq, 0)
    j.claim("w2", 0)
    group_result(j, seq, 1, interrupted=True)
    group_result(j, seq, 2)
    j.model()
    j.commit("complete")
    assert check_step("agent", j.entries) == []


def test_a_groups_call_left_unanswered() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq = group(j, CALLS)
    group_result(j, seq, 0)
    group_result(j, seq, 2)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "unanswered_intent")
    assert "'send'" in finding.message


def test_a_result_for_an_index_the_group_does_not_have() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq = group(j, CALLS)
    for index in range(3):
        group_result(j, seq, index)
    stray = group_result(j, seq, 3)
    j.commit("complete")
    assert only(check_step("agent", j.entries), "orphan_result").seq == stray


def test_a_call_of_a_group_that_ran_before_the_groups_last_intent_was_stored() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq = group(j, CALLS[:2], size=3)
    early = group_result(j, seq, 0)
    later = group(j, CALLS[2:], size=3, start=0)
    group_result(j, seq, 1)
    group_result(j, later, 0)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "group_order")
    assert finding.seq == early and f"(seq {later})" in finding.message


def test_a_group_with_two_intents_at_one_position() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq = group(j, CALLS)
    j._position["w1"] = 0
    again = group(j, CALLS)
    for s in (seq, again):
        for index in range(3):
            group_result(j, s, index)
    j.commit("complete")
    findings = check_step("agent", j.entries)
    assert set(rules(findings)) == {"group_order"}
    assert all(f.seq == again for f in findings)


def test_an_unsafe_call_of_a_group_run_again_by_a_successor() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq = group(j, CALLS)
    j.claim("w2", 0)
    rerun = group_result(j, seq, 1)
    group_result(j, seq, 0)
    group_result(j, seq, 2)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "unsafe_started_twice")
    assert finding.seq == rerun and "'send'" in finding.message


def test_an_unsafe_call_alone_with_output_from_a_successor() -> None:
    j = Journal()
    j.claim("w1", 0)
    charge = j.intent("charge")
    j.claim("w2", 0)
    started = j.output(charge)
    j.result(charge, interrupted=True)
    j.commit("complete")
    assert only(check_step("agent", j.entries), "unsafe_started_twice").seq == started


# ---- approvals bound to their arguments -------------------------------------------------

SEND = b'{"to":"bob"}'
EDITED = b'{"to":"billing"}'


def _asks(j: Journal, input: bytes = SEND, *, result: bool = True) -> tuple[int, str]:
    """A call to ``send`` that asks for approval, answered awaiting_approval."""
    digest = call_digest("send", input)
    seq = j._add(
        IntentEntry, j._current, None, position=j._next(j._current), name="send",
        input=input, safe=False, digest=digest,
    )  # fmt: skip
    if result:
        j._add(ResultEntry, j._current, None, intent_seq=seq, awaiting_approval=True)
    return seq, digest


def _runs_approved(
    j: Journal, seen: str, input: bytes = SEND, *, digest: str = "", edited: bool = False
) -> int:
    """A call to ``send`` under an approval of ``seen``, and its result."""
    mark = ApprovalMark(call="run.agent.0.0", digest=seen, approved=True, edited=edited)
    seq = j._add(
        IntentEntry, j._current, None, position=j._next(j._current), name="send",
        input=input, safe=False, digest=digest or call_digest("send", input), approval=mark,
    )  # fmt: skip
    j._add(ResultEntry, j._current, None, intent_seq=seq, output=b'"sent"')
    return seq


def _approval_journal(**run: Any) -> tuple[Journal, int]:
    j = Journal()
    j.claim("w1", 0)
    _, digest = _asks(j)
    j.commit("continue")
    j.claim("w2", 1)
    seq = _runs_approved(j, run.pop("seen", digest), **run)
    j.commit("complete")
    return j, seq


def test_a_call_that_ran_with_the_approved_arguments_is_sound() -> None:
    j, _ = _approval_journal()
    assert check_step("agent", j.entries) == []
    edited, _ = _approval_journal(input=EDITED, edited=True)
    assert check_step("agent", edited.entries) == []


def test_a_call_that_ran_with_other_arguments_than_approved() -> None:
    j, seq = _approval_journal(input=EDITED)
    finding = only(check_step("agent", j.entries), "approval")
    assert finding.seq == seq
    assert "but the approval was given for" in finding.message


def test_a_digest_that_is_not_the_calls_own() -> None:
    j, seq = _approval_journal(digest=call_digest("send", EDITED))
    finding = only(check_step("agent", j.entries), "approval")
    assert finding.seq == seq and "digest to" in finding.message


def test_an_approval_no_call_asked_for() -> None:
    j, seq = _approval_journal(seen=call_digest("send", b'{"to":"eve"}'), input=EDITED, edited=True)
    finding = only(check_step("agent", j.entries), "approval")
    assert finding.seq == seq and "which no call asked for" in finding.message


def test_a_call_that_asked_for_approval_and_ran_anyway() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq, _ = _asks(j, result=False)
    ran = j.result(seq)
    j.commit("complete")
    finding = only(check_step("agent", j.entries), "approval")
    assert finding.seq == ran and "says it ran" in finding.message


def test_a_call_that_asked_and_was_cut_by_a_crash_is_sound() -> None:
    j = Journal()
    j.claim("w1", 0)
    seq, _ = _asks(j, result=False)
    j.claim("w2", 0, attempt=2)
    j.result(seq, interrupted=True)  # the claim closes it
    j.commit("complete")
    assert check_step("agent", j.entries) == []
