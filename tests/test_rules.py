"""The engine's pure rules: no event loop, no NATS."""

from __future__ import annotations

import json

import pytest

from dagnats.engine import model as m
from dagnats.engine import rules
from dagnats.engine.definition import parse_mapping

T0 = 1_000.0


def wf(steps: list[dict[str, object]], **extra: object) -> object:
    return parse_mapping({"name": "wf", "steps": steps, **extra})


LOOP = wf(
    [
        {
            "id": "agent",
            "type": "agent_loop",
            "task": "agent",
            "agent_loop": {"max_iterations": 3},
            "retry": {"max_attempts": 2, "backoff": "fixed", "initial_delay": "1s"},
        }
    ]
)


def start(workflow: object = LOOP, input: bytes = b'{"q": 1}') -> m.Accepted:
    return rules.start_run(run_id="r" * 32, workflow=workflow, input=input, now=T0)  # type: ignore[arg-type]


def report(step: str, it: int | None, at: int | None, outcome: m.StepOutcome) -> m.StepReport:
    ident = None if it is None or at is None else m.Identity(iteration=it, attempt=at)
    return m.StepReport(step_id=step, identity=ident, outcome=outcome)


def accepted(decision: m.Decision) -> m.Accepted:
    assert isinstance(decision, m.Accepted), decision
    return decision


def dispatches(decision: m.Accepted) -> list[tuple[str, int, int]]:
    return [
        (e.step_id, e.iteration, e.attempt)
        for e in decision.effects
        if isinstance(e, m.DispatchTask)
    ]


def test_first_dispatch_carries_iteration_zero_attempt_one() -> None:
    first = start()
    assert dispatches(first) == [("agent", 0, 1)]
    task = next(e for e in first.effects if isinstance(e, m.DispatchTask))
    assert task.input == b'{"q": 1}'
    assert first.run.step("agent").status is m.StepStatus.RUNNING


def test_continue_advances_iteration_once() -> None:
    run = start().run
    nxt = accepted(rules.apply(run, report("agent", 0, 1, m.Continued(output=b"1")), T0 + 1))
    assert dispatches(nxt) == [("agent", 1, 1)]
    assert nxt.run.step("agent").iterations == 1
    duplicate = rules.apply(nxt.run, report("agent", 0, 1, m.Continued()), T0 + 2)
    assert isinstance(duplicate, m.Dropped)
    assert "(0, 1)" in duplicate.reason


def test_stale_attempt_is_dropped() -> None:
    run = start().run
    retry = accepted(rules.apply(run, report("agent", 0, 1, m.Failed(error="boom")), T0))
    woken = accepted(
        rules.apply(
            retry.run,
            m.TimerFired(step_id="agent", kind=m.TimerKind.WAKE, iteration=0, attempt=2),
            T0 + 1,
        )
    )
    assert dispatches(woken) == [("agent", 0, 2)]
    stale = rules.apply(woken.run, report("agent", 0, 1, m.Continued()), T0 + 2)
    assert isinstance(stale, m.Dropped)


def test_retry_waits_for_backoff_then_fails_after_max_attempts() -> None:
    run = start().run
    retry = accepted(rules.apply(run, report("agent", 0, 1, m.Failed(error="boom")), T0))
    timers = [e for e in retry.effects if isinstance(e, m.SetTimer)]
    assert [(t.kind, t.attempt, t.due) for t in timers] == [(m.TimerKind.WAKE, 2, T0 + 1.0)]
    assert retry.run.step("agent").status is m.StepStatus.WAITING
    early = rules.apply(retry.run, report("agent", 0, 2, m.Continued()), T0 + 0.5)
    assert isinstance(early, m.Dropped), "a waiting step takes no reports"
    woken = accepted(
        rules.apply(
            retry.run,
            m.TimerFired(step_id="agent", kind=m.TimerKind.WAKE, iteration=0, attempt=2),
            T0 + 1,
        )
    )
    failed = accepted(rules.apply(woken.run, report("agent", 0, 2, m.Failed(error="again")), T0))
    assert failed.run.status is m.RunStatus.FAILED
    assert "again" in failed.run.error


def test_permanent_failure_skips_retries() -> None:
    run = start().run
    failed = accepted(
        rules.apply(
            run, report("agent", 0, 1, m.Failed(error="no", kind=m.FailureKind.PERMANENT)), T0
        )
    )
    assert failed.run.status is m.RunStatus.FAILED
    assert any(isinstance(e, m.AnnounceCancel) for e in failed.effects)


def test_max_iterations_fails_the_loop() -> None:
    run = start().run
    for i in range(2):
        run = accepted(rules.apply(run, report("agent", i, 1, m.Continued()), T0)).run
    last = accepted(rules.apply(run, report("agent", 2, 1, m.Continued()), T0))
    assert last.run.status is m.RunStatus.FAILED
    assert "max_iterations (3)" in last.run.error


def test_complete_finishes_run_with_sink_output() -> None:
    run = start().run
    done = accepted(rules.apply(run, report("agent", 0, 1, m.Completed(output=b'"hi"')), T0))
    assert done.run.status is m.RunStatus.COMPLETED
    assert done.run.output == b'"hi"'


def test_a_report_without_a_dispatch_identity_is_dropped() -> None:
    run = start().run
    anonymous = report("agent", None, None, m.Continued())
    assert isinstance(rules.apply(run, anonymous, T0), m.Dropped)


def test_loop_delay_is_a_timer() -> None:
    delayed = wf(
        [{"id": "a", "type": "agent_loop", "task": "t", "agent_loop": {"loop_delay": "2s"}}]
    )
    run = start(delayed).run
    nxt = accepted(rules.apply(run, report("a", 0, 1, m.Continued()), T0 + 1))
    assert dispatches(nxt) == []
    (timer,) = [e for e in nxt.effects if isinstance(e, m.SetTimer)]
    assert (timer.iteration, timer.attempt, timer.due) == (1, 1, T0 + 3)
    fired = accepted(
        rules.apply(
            nxt.run,
            m.TimerFired(step_id="a", kind=m.TimerKind.WAKE, iteration=1, attempt=1),
            T0 + 3,
        )
    )
    assert dispatches(fired) == [("a", 1, 1)]
    again = rules.apply(
        fired.run, m.TimerFired(step_id="a", kind=m.TimerKind.WAKE, iteration=1, attempt=1), T0 + 3
    )
    assert isinstance(again, m.Dropped), "a redelivered timer does not dispatch twice"


def test_step_timeout_counts_as_a_retriable_failure() -> None:
    timed = wf([{"id": "a", "task": "t", "timeout": "5s", "retry": {"max_attempts": 2}}])
    first = start(timed)
    (timer,) = [e for e in first.effects if isinstance(e, m.SetTimer)]
    assert timer.kind is m.TimerKind.STEP_TIMEOUT and timer.due == T0 + 5
    fired = accepted(
        rules.apply(
            first.run,
            m.TimerFired(step_id="a", kind=m.TimerKind.STEP_TIMEOUT, iteration=0, attempt=1),
            T0 + 5,
        )
    )
    assert fired.run.step("a").status is m.StepStatus.WAITING
    assert "timed out" in fired.run.step("a").error


def test_dependencies_dispatch_in_order_and_merge_outputs() -> None:
    dag = wf(
        [
            {"id": "a", "task": "t"},
            {"id": "b", "task": "t"},
            {"id": "c", "task": "t", "depends_on": ["a", "b"]},
        ]
    )
    first = start(dag)
    assert sorted(dispatches(first)) == [("a", 0, 1), ("b", 0, 1)]
    run = accepted(rules.apply(first.run, report("a", 0, 1, m.Completed(output=b"1")), T0)).run
    last = accepted(rules.apply(run, report("b", 0, 1, m.Completed(output=b"2")), T0))
    (task,) = [e for e in last.effects if isinstance(e, m.DispatchTask)]
    assert json.loads(task.input) == {"a": 1, "b": 2}


def test_cancel_cascades_to_children_and_is_final() -> None:
    nested = wf([{"id": "child", "type": "sub_workflow", "workflow": "other"}])
    first = start(nested)
    (spawn,) = [e for e in first.effects if isinstance(e, m.StartChildRun)]
    assert spawn.child_run_id == first.run.step("child").child_run_id
    cancelled = accepted(rules.apply(first.run, m.CancelRequested(reason="stop"), T0))
    assert cancelled.run.status is m.RunStatus.CANCELLED
    assert [e.child_run_id for e in cancelled.effects if isinstance(e, m.CancelChildRun)] == [
        spawn.child_run_id
    ]
    later = rules.apply(cancelled.run, report("child", 0, 1, m.Completed()), T0)
    assert isinstance(later, m.Dropped)


def test_child_result_completes_parent_step() -> None:
    nested = wf([{"id": "child", "type": "sub_workflow", "workflow": "other"}])
    first = start(nested)
    child = first.run.step("child").child_run_id
    other = m.ChildEnded(step_id="child", child_run_id="x" * 32, status=m.RunStatus.COMPLETED)
    assert isinstance(rules.apply(first.run, other, T0), m.Dropped)
    done = accepted(
        rules.apply(
            first.run,
            m.ChildEnded(
                step_id="child", child_run_id=child, status=m.RunStatus.COMPLETED, output=b"7"
            ),
            T0,
        )
    )
    assert done.run.status is m.RunStatus.COMPLETED and done.run.output == b"7"


def test_child_run_reports_to_parent() -> None:
    child = rules.start_run(
        run_id="c" * 32,
        workflow=LOOP,  # type: ignore[arg-type]
        input=b"",
        now=T0,
        parent_run_id="p" * 32,
        parent_step_id="s",
    )
    done = accepted(rules.apply(child.run, report("agent", 0, 1, m.Completed(output=b"1")), T0))
    (note,) = [e for e in done.effects if isinstance(e, m.NotifyParent)]
    assert (note.parent_run_id, note.status, note.output) == ("p" * 32, m.RunStatus.COMPLETED, b"1")


def test_vanished_task_is_dispatched_again_with_same_identity() -> None:
    run = start().run
    again = accepted(
        rules.apply(run, m.TaskVanished(step_id="agent", iteration=0, attempt=1), T0 + 60)
    )
    (task,) = [e for e in again.effects if isinstance(e, m.DispatchTask)]
    assert (task.iteration, task.attempt, task.redispatch) == (0, 1, 1)
    moved = accepted(rules.apply(run, report("agent", 0, 1, m.Continued()), T0)).run
    late = rules.apply(moved, m.TaskVanished(step_id="agent", iteration=0, attempt=1), T0)
    assert isinstance(late, m.Dropped)


def test_pause_redispatches_same_iteration_without_spending_retries() -> None:
    run = start().run
    for attempt in (1, 2, 3):
        paused = accepted(rules.apply(run, report("agent", 0, attempt, m.Paused(duration=5)), T0))
        wake = m.TimerFired(
            step_id="agent", kind=m.TimerKind.WAKE, iteration=0, attempt=attempt + 1
        )
        run = accepted(rules.apply(paused.run, wake, T0 + 5)).run
    assert run.status is m.RunStatus.RUNNING
    assert (run.step("agent").iteration, run.step("agent").attempt) == (0, 4)


@pytest.mark.parametrize("status", [m.RunStatus.COMPLETED, m.RunStatus.FAILED])
def test_terminal_run_never_changes(status: m.RunStatus) -> None:
    from dataclasses import replace

    run = replace(start().run, status=status)
    assert isinstance(rules.apply(run, m.CancelRequested(), T0), m.Dropped)


def continued(wait: m.Wait | None) -> m.Continued:
    return m.Continued(wait=wait)


def test_wait_for_time_or_input_holds_no_task_and_ignores_loop_delay() -> None:
    delayed = wf(
        [
            {
                "id": "a",
                "type": "agent_loop",
                "task": "t",
                "timeout": "1h",
                "agent_loop": {"loop_delay": "5s"},
            }
        ]
    )
    run = start(delayed).run
    wait = m.Wait(delay=60, until_input=True)
    waiting = accepted(rules.apply(run, report("a", 0, 1, continued(wait)), T0))
    step = waiting.run.step("a")
    assert (step.status, step.iteration, step.attempt) == (m.StepStatus.WAITING, 1, 1)
    assert step.waiting_for_input and step.wake_at == T0 + 60
    assert dispatches(waiting) == []
    timers = {e.kind: e for e in waiting.effects if isinstance(e, m.SetTimer)}
    assert set(timers) == {m.TimerKind.WAKE, m.TimerKind.STEP_TIMEOUT}
    assert timers[m.TimerKind.WAKE].due == T0 + 60, "the wait's own time, not loop_delay"
    (check,) = [e for e in waiting.effects if isinstance(e, m.StepInputs)]
    assert not check.close, "entering the wait checks for inputs that came during the turn"


def test_an_input_wakes_a_step_waiting_for_input_once() -> None:
    run = start().run
    waiting = accepted(
        rules.apply(run, report("agent", 0, 1, continued(m.Wait(until_input=True))), T0)
    ).run
    woken = accepted(rules.apply(waiting, m.InputArrived(step_id="agent"), T0 + 1))
    assert dispatches(woken) == [("agent", 1, 1)]
    again = rules.apply(woken.run, m.InputArrived(step_id="agent"), T0 + 2)
    assert isinstance(again, m.Dropped), "a second input does not dispatch twice"
    fired = rules.apply(
        woken.run, m.TimerFired(step_id="agent", kind=m.TimerKind.WAKE, iteration=1, attempt=1), T0
    )
    assert isinstance(fired, m.Dropped)


def test_time_wait_is_not_woken_by_input_and_fires_on_time() -> None:
    run = start().run
    waiting = accepted(
        rules.apply(run, report("agent", 0, 1, continued(m.Wait(until=T0 + 30))), T0)
    ).run
    assert isinstance(rules.apply(waiting, m.InputArrived(step_id="agent"), T0), m.Dropped)
    fired = accepted(
        rules.apply(
            waiting,
            m.TimerFired(step_id="agent", kind=m.TimerKind.WAKE, iteration=1, attempt=1),
            T0 + 30,
        )
    )
    assert dispatches(fired) == [("agent", 1, 1)]


def test_step_timeout_keeps_counting_during_a_wait() -> None:
    timed = wf([{"id": "a", "type": "agent_loop", "task": "t", "timeout": "10s"}])
    run = start(timed).run
    waiting = accepted(rules.apply(run, report("a", 0, 1, continued(m.Wait(until_input=True))), T0))
    timeout = next(
        e
        for e in waiting.effects
        if isinstance(e, m.SetTimer) and e.kind is m.TimerKind.STEP_TIMEOUT
    )
    fired = accepted(
        rules.apply(
            waiting.run,
            m.TimerFired(step_id="a", kind=m.TimerKind.STEP_TIMEOUT, iteration=1, attempt=1),
            timeout.due,
        )
    )
    assert "timed out" in fired.run.step("a").error


def test_finished_steps_close_their_inputs() -> None:
    run = start().run
    done = accepted(rules.apply(run, report("agent", 0, 1, m.Completed(output=b"1")), T0))
    closes = [e for e in done.effects if isinstance(e, m.StepInputs) and e.close]
    assert [c.step_id for c in closes] == ["agent"]
    cancelled = accepted(rules.apply(run, m.CancelRequested(), T0))
    assert any(isinstance(e, m.StepInputs) and e.close for e in cancelled.effects)


def test_report_carrying_the_commit_of_the_current_iteration_is_accepted() -> None:
    run = start().run
    retry = accepted(rules.apply(run, report("agent", 0, 1, m.Failed(error="x")), T0)).run
    late = m.StepReport(
        step_id="agent",
        identity=m.Identity(iteration=0, attempt=1),
        outcome=m.Continued(),
        journal_seq=42,
    )
    accepted_late = accepted(rules.apply(retry, late, T0))
    assert accepted_late.run.step("agent").iterations == 1
    stale = m.StepReport(
        step_id="agent", identity=m.Identity(iteration=0, attempt=1), outcome=m.Continued()
    )
    assert isinstance(rules.apply(retry, stale, T0), m.Dropped), "no commit, no exception"


# ---- journal steps: the journal's say on a report or a lease --------------------------


def mark(
    seq: int, it: int, at: int, *, commit: m.StepOutcome | None = None, delivery: int = 0
) -> m.JournalMark:
    return m.JournalMark(seq=seq, iteration=it, attempt=at, commit=commit, delivery=delivery)


def journal_report(it: int, at: int, outcome: m.StepOutcome, seq: int = 0) -> m.StepReport:
    ident = m.Identity(iteration=it, attempt=at)
    return m.StepReport(step_id="agent", identity=ident, outcome=outcome, journal_seq=seq)


def test_a_report_without_a_journal_needs_no_commit() -> None:
    done = m.Completed(output=b'"x"')
    assert rules.check_journal_report(journal_report(0, 1, done), None, None) is None
    # The journal has only earlier dispatches: this one ended before it claimed.
    earlier = mark(4, 0, 1, commit=m.Continued())
    assert rules.check_journal_report(journal_report(1, 1, done), earlier, None) is None


def test_a_claimed_dispatch_reports_its_commit_and_only_what_it_records() -> None:
    done = m.Completed(output=b'"successor"')
    commit = mark(7, 2, 1, commit=done)
    assert rules.check_journal_report(journal_report(2, 1, done, 7), commit, commit) is None
    zombie = journal_report(2, 1, m.Completed(output=b'"zombie"'), 7)
    refused = rules.check_journal_report(zombie, commit, commit)
    assert refused is not None and refused.reason == "fenced"
    assert "records a complete" in refused.message
    # An empty wait is no wait: the bridge sends one, the commit keeps none.
    cont = m.Continued(output=b"{}")
    stored = mark(9, 2, 1, commit=cont)
    with_wait = journal_report(2, 1, m.Continued(output=b"{}", wait=m.Wait()), 9)
    assert rules.check_journal_report(with_wait, stored, stored) is None


@pytest.mark.parametrize(
    ("tail", "named", "seq", "reason"),
    [
        (mark(5, 2, 1), None, 0, "fenced"),  # claimed by a successor, no commit
        (mark(5, 2, 1), None, 999, "fenced"),  # a made-up sequence
        (mark(5, 2, 1), mark(3, 1, 1, commit=m.Continued()), 3, "fenced"),  # another iteration
        (mark(6, 2, 1, commit=m.Completed()), None, 0, "stale"),  # committed already
        (mark(8, 3, 1), mark(3, 1, 1, commit=m.Continued()), 3, "stale"),  # moved past it
        (mark(8, 2, 2), None, 0, "stale"),  # a later attempt holds the iteration
    ],
)
def test_a_report_the_journal_does_not_back_is_refused(
    tail: m.JournalMark, named: m.JournalMark | None, seq: int, reason: str
) -> None:
    refused = rules.check_journal_report(journal_report(2, 1, m.Completed(), seq), tail, named)
    assert refused is not None and refused.reason == reason, refused


def test_a_legacy_report_on_a_journal_step_is_refused() -> None:
    legacy = m.StepReport(step_id="agent", identity=None, outcome=m.Completed())
    refused = rules.check_journal_report(legacy, mark(1, 0, 1), None)
    assert refused is not None and refused.reason == "fenced"


def test_only_the_holders_delivery_keeps_or_releases_the_lease() -> None:
    ident = m.Identity(iteration=2, attempt=1)
    holder = mark(5, 2, 1, delivery=3)
    assert rules.check_journal_lease(ident, 3, holder) is None
    for delivery in (2, 4):  # an earlier holder, or one that never claimed after it
        assert rules.check_journal_lease(ident, delivery, holder) is not None
        assert rules.check_journal_lease(ident, delivery, holder, releasing=True) is not None
    # No journal for the dispatch yet, or a claim that gave no delivery: no say.
    assert rules.check_journal_lease(ident, 1, mark(4, 1, 1, delivery=9)) is None
    assert rules.check_journal_lease(ident, 1, mark(5, 2, 1)) is None
    # Past the dispatch: no lease to keep, but a stale task may be released.
    later = mark(9, 3, 1, delivery=1)
    assert rules.check_journal_lease(ident, 3, later) is not None
    assert rules.check_journal_lease(ident, 3, later, releasing=True) is None
    committed = mark(6, 2, 1, commit=m.Completed(), delivery=3)
    assert rules.check_journal_lease(ident, 2, committed, releasing=True) is None
    # The run ended: any delivery's claim answers stale, and its task may go.
    assert rules.check_journal_lease(ident, 2, holder, releasing=True, run_ended=True) is None
    assert rules.check_journal_lease(ident, 2, holder, run_ended=True) is not None


def test_a_commit_of_an_earlier_attempt_counts_only_when_it_ends_the_iteration() -> None:
    failed = rules.apply(start().run, report("agent", 0, 1, m.Failed(error="x")), T0)
    assert isinstance(failed, m.Accepted)
    wake = m.TimerFired(step_id="agent", kind=m.TimerKind.WAKE, iteration=0, attempt=2)
    woken = rules.apply(failed.run, wake, T0 + 2)
    assert isinstance(woken, m.Accepted)
    run = woken.run
    again = m.StepReport(
        step_id="agent",
        identity=m.Identity(iteration=0, attempt=1),
        outcome=m.Failed(error="x"),
        journal_seq=4,
    )
    assert isinstance(rules.apply(run, again, T0 + 3), m.Dropped)
    cont = m.StepReport(
        step_id="agent",
        identity=m.Identity(iteration=0, attempt=1),
        outcome=m.Continued(),
        journal_seq=4,
    )
    accepted = rules.apply(run, cont, T0 + 3)
    assert isinstance(accepted, m.Accepted) and accepted.run.step("agent").iteration == 1


# ---- which task is current, which step awaits one ---------------------------------


def test_a_task_is_current_only_for_its_steps_dispatch_while_both_run() -> None:
    dispatch = m.Identity(iteration=2, attempt=1)
    running, step = m.RunStatus.RUNNING, m.StepStatus.RUNNING
    assert rules.carried_dispatch(running, step, dispatch, dispatch) == dispatch
    retried = m.Identity(iteration=2, attempt=2)
    assert rules.carried_dispatch(running, step, retried, dispatch) is None, "an earlier attempt"
    assert rules.carried_dispatch(running, m.StepStatus.WAITING, dispatch, dispatch) is None
    assert rules.carried_dispatch(m.RunStatus.CANCELLED, step, dispatch, dispatch) is None
    assert rules.carried_dispatch(running, None, None, dispatch) is None, "no such step"


def test_the_steps_awaiting_a_task_are_the_running_ones_a_worker_runs() -> None:
    workflow = wf(
        [
            {"id": "a", "type": "task", "task": "t1"},
            {"id": "b", "type": "task", "task": "t2"},
            {"id": "c", "type": "task", "task": "t3", "depends_on": ["a"]},
        ]
    )
    run = start(workflow).run
    awaiting = [(step.step_id, task) for step, task in rules.awaiting_a_task(run)]
    assert awaiting == [("a", "t1"), ("b", "t2")], "c is pending"
    done = replace_step(run, "b", status=m.StepStatus.COMPLETED)
    assert [s.step_id for s, _ in rules.awaiting_a_task(done)] == ["a"]
    child = replace_step(run, "a", child_run_id="c" * 32)
    assert [s.step_id for s, _ in rules.awaiting_a_task(child)] == ["b"]


def replace_step(run: m.Run, step_id: str, **changes: object) -> m.Run:
    from dataclasses import replace

    steps = tuple(replace(s, **changes) if s.step_id == step_id else s for s in run.steps)  # type: ignore[arg-type]
    return replace(run, steps=steps)


def test_a_task_is_published_again_only_inside_the_duplicate_window() -> None:
    window = 120.0
    task = "tasks.agent.r.s"
    assert rules.republishable(task, 0.0, window)
    assert rules.republishable(task, window - rules.CLOCK_MARGIN - 1, window)
    assert not rules.republishable(task, window - rules.CLOCK_MARGIN, window)
    assert not rules.republishable(task, 10 * window, window)
    assert rules.republishable("timers.r.s", 10 * window, window), "only tasks deliver twice"
    assert rules.republishable("history.r", 10 * window, window)


def test_a_task_whose_run_is_not_stored_waits_for_it_within_the_horizon() -> None:
    def wait(age: float, delivered: int) -> float | None:
        return rules.awaits_its_run(age, delivered, retry_budget=30.0, clock_skew=5.0)

    horizon = 3 * 30.0 + 5.0  # three writes' retries, and the clocks' skew
    first, most = rules.RUN_AWAITED_FIRST, rules.RUN_AWAITED_MOST
    assert wait(0.0, 1) == first
    assert wait(0.0, 2) == 2 * first, "each delivery waits twice as long"
    assert wait(0.0, 10_000) == most
    assert wait(horizon - 0.25, 10_000) == 0.25, "never past the horizon"
    assert wait(horizon, 1) is None, "settled: its run never came"
    assert wait(10 * horizon, 1) is None


# ---- the kept task: a task kept across iterations (ADR 31) ---------------------------


def kept_continue(it: int, seq: int, wait: m.Wait | None = None) -> m.StepReport:
    return m.StepReport(
        step_id="agent",
        identity=m.Identity(iteration=it, attempt=1),
        outcome=m.Continued(wait=wait),
        kept_seq=seq,
    )


def test_a_continue_that_keeps_its_task_dispatches_on_it_without_a_new_task() -> None:
    run = start().run
    nxt = accepted(rules.apply(run, kept_continue(0, 7), T0 + 1))
    step = nxt.run.step("agent")
    assert (step.status, step.iteration, step.attempt, step.kept_seq) == (
        m.StepStatus.RUNNING,
        1,
        1,
        7,
    )
    assert dispatches(nxt) == []
    # The message is current for the dispatch it was kept for, not the one it carried.
    current = m.Identity(iteration=1, attempt=1)
    published_for = m.Identity(iteration=0, attempt=1)
    kept = rules.carried_dispatch(
        m.RunStatus.RUNNING, step.status, current, published_for, kept=True
    )
    assert kept == current
    assert rules.carried_dispatch(m.RunStatus.RUNNING, step.status, current, published_for) is None
    assert rules.kept_decision(step, m.RunStatus.RUNNING, 7, published_for) is True
    task = rules.dispatch_task(nxt.run, step)
    assert (task.iteration, task.attempt, task.input) == (1, 1, b'{"q": 1}')


def test_a_continue_that_waits_releases_its_task() -> None:
    run = start().run
    waits = accepted(rules.apply(run, kept_continue(0, 7, m.Wait(until_input=True)), T0 + 1))
    step = waits.run.step("agent")
    assert step.status is m.StepStatus.WAITING and step.kept_seq == 0
    assert (
        rules.kept_decision(step, m.RunStatus.RUNNING, 7, m.Identity(iteration=0, attempt=1))
        is False
    )


def test_a_dispatch_that_is_not_kept_forgets_the_kept_task() -> None:
    run = accepted(rules.apply(start().run, kept_continue(0, 7), T0 + 1)).run
    # The kept iteration fails; its retry is a task of its own.
    failed = accepted(rules.apply(run, report("agent", 1, 1, m.Failed(error="boom")), T0 + 2))
    woken = accepted(
        rules.apply(
            failed.run,
            m.TimerFired(step_id="agent", kind=m.TimerKind.WAKE, iteration=1, attempt=2),
            T0 + 3,
        )
    )
    step = woken.run.step("agent")
    assert dispatches(woken) == [("agent", 1, 2)] and step.kept_seq == 0
    assert (
        rules.kept_decision(step, m.RunStatus.RUNNING, 7, m.Identity(iteration=0, attempt=1))
        is False
    )


def test_only_a_kept_iteration_that_carries_the_loop_on_may_go_unwritten() -> None:
    # The first kept iteration is written: the run as stored must say the
    # message is kept before a reader can know to look in the journal.
    first = rules.apply(start().run, kept_continue(0, 7), T0 + 1)
    assert not rules.carries_kept_loop_on(start().run, first, "agent", 7)
    run = accepted(first).run
    assert rules.carries_kept_loop_on(
        run, rules.apply(run, kept_continue(1, 7), T0 + 2), "agent", 7
    )
    waits = rules.apply(run, kept_continue(1, 7, m.Wait(until_input=True)), T0 + 2)
    assert not rules.carries_kept_loop_on(run, waits, "agent", 7)
    ends = rules.apply(run, report("agent", 1, 1, m.Completed(output=b"{}")), T0 + 2)
    assert not rules.carries_kept_loop_on(run, ends, "agent", 7)
    stale = rules.apply(run, kept_continue(0, 7), T0 + 2)
    assert not rules.carries_kept_loop_on(run, stale, "agent", 7)


def test_a_run_catches_up_with_the_kept_iterations_and_stops_at_anything_else() -> None:
    run = accepted(rules.apply(start().run, kept_continue(0, 7), T0 + 1)).run  # as stored
    caught = rules.catch_up(run, [kept_continue(1, 7)], T0 + 2)
    step = caught.step("agent")
    assert (step.iteration, step.iterations, step.status, step.kept_seq) == (
        2,
        2,
        m.StepStatus.RUNNING,
        7,
    )
    # Iteration 2's continue reaches max_iterations (3): the loop fails, which
    # no engine decided unwritten; it is left to its event.
    assert rules.catch_up(run, [kept_continue(1, 7), kept_continue(2, 7)], T0 + 2) == caught
    # A commit that waits is left to its event, and so is everything after it.
    waits = kept_continue(1, 7, m.Wait(until_input=True))
    assert rules.catch_up(run, [waits, kept_continue(2, 7)], T0 + 2) == run
    assert rules.catch_up(run, [kept_continue(5, 7)], T0 + 2) == run  # not the run's iteration


def test_a_kept_task_whose_report_is_not_applied_yet_is_left_to_its_lease() -> None:
    step = start().run.step("agent")
    reported = m.Identity(iteration=0, attempt=1)
    assert rules.kept_decision(step, m.RunStatus.RUNNING, 7, reported) is None
    assert rules.kept_decision(step, m.RunStatus.CANCELLED, 7, reported) is False
    assert rules.kept_decision(None, m.RunStatus.RUNNING, 7, reported) is False


def test_only_a_run_with_nothing_in_motion_and_no_outbox_is_parked() -> None:
    run = start().run
    assert not rules.parked(run, outbox=False), "its task is in flight"
    waits = accepted(
        rules.apply(run, report("agent", 0, 1, continued(m.Wait(until_input=True))), T0)
    )
    assert not rules.parked(waits.run, outbox=True), "its outbox is not cleared"
    assert rules.parked(waits.run, outbox=False)
    woken = accepted(rules.apply(waits.run, m.InputArrived(step_id="agent"), T0 + 1))
    assert not rules.parked(woken.run, outbox=False), "its next dispatch is in flight"
    cancelled = accepted(rules.apply(waits.run, m.CancelRequested(), T0 + 1))
    assert not rules.parked(cancelled.run, outbox=False), "it ended"
    backoff = accepted(rules.apply(run, report("agent", 0, 1, m.Failed(error="x")), T0))
    assert rules.parked(backoff.run, outbox=False), "a timer it waits for is stored already"


def test_a_cancel_seals_the_journal_of_each_step_a_handler_may_hold() -> None:
    both = wf(
        [
            {"id": "agent", "type": "agent_loop", "task": "t"},
            {"id": "child", "type": "sub_workflow", "workflow": "other"},
            {"id": "after", "type": "task", "task": "t", "depends_on": ["agent"]},
        ]
    )
    first = start(both)
    cancelled = accepted(rules.apply(first.run, m.CancelRequested(reason="stop"), T0))
    sealed = [e for e in cancelled.effects if isinstance(e, m.StoreCancel)]
    # The running agent's journal, at its dispatch; not the child run's step
    # (its run is cancelled) nor a step never dispatched.
    assert sealed == [
        m.StoreCancel(run_id="r" * 32, step_id="agent", iteration=0, attempt=1, reason="stop")
    ]
    announce = next(i for i, e in enumerate(cancelled.effects) if isinstance(e, m.AnnounceCancel))
    assert cancelled.effects.index(sealed[0]) < announce, "sealed before it is announced"


# ---- retention ------------------------------------------------------------------


def purges(decision: m.Decision) -> list[m.PurgeLater]:
    return [e for e in accepted(decision).effects if isinstance(e, m.PurgeLater)]


def test_only_the_decision_that_ends_a_run_sets_its_purge() -> None:
    options = m.RuleOptions(run_retention=60.0)
    run = start().run
    assert purges(start()) == []
    moved = rules.apply(run, report("agent", 0, 1, m.Continued()), T0 + 1, options)
    assert purges(moved) == []
    retried = rules.apply(run, report("agent", 0, 1, m.Failed(error="x")), T0 + 1, options)
    assert purges(retried) == [], "a retry keeps the run running"
    purge = [m.PurgeLater(run_id=run.run_id, due=T0 + 5 + 60.0)]
    assert purges(rules.apply(run, m.CancelRequested(), T0 + 5, options)) == purge
    done = rules.apply(run, report("agent", 0, 1, m.Completed(output=b"1")), T0 + 5, options)
    assert purges(done) == purge
    failed = m.Failed(error="x", kind=m.FailureKind.PERMANENT)
    assert purges(rules.apply(run, report("agent", 0, 1, failed), T0 + 5, options)) == purge


def test_a_runs_budget_rides_its_tasks_and_a_task_step_never_pauses_for_it() -> None:
    """A pause waits with a continue, which only an agent loop has: a task
    step's task carries the budget with the fail policy."""
    from dagnats.core.usage import Budget, Policy

    both = wf(
        [
            {"id": "agent", "type": "agent_loop", "task": "agent"},
            {"id": "once", "task": "once"},
        ],
        budget={"tokens": 100, "policy": "pause"},
    )
    first = start(both)
    budgets = {e.step_id: e.budget for e in first.effects if isinstance(e, m.DispatchTask)}
    assert budgets == {
        "agent": Budget(tokens=100, policy=Policy.PAUSE),
        "once": Budget(tokens=100, policy=Policy.FAIL),
    }
    own = rules.start_run(
        run_id="r" * 32,
        workflow=both,  # type: ignore[arg-type]
        input=b"{}",
        now=T0,
        budget=Budget(cost_micros=5),
    )
    assert own.run.budget == Budget(cost_micros=5)  # the run's own, not the workflow's
    assert start(LOOP).run.budget is None
    # A registered workflow keeps its budget through its message.
    from dagnats.engine.convert_workflow import workflow_from_proto, workflow_to_proto

    assert workflow_from_proto(workflow_to_proto(both)) == both  # type: ignore[arg-type]
