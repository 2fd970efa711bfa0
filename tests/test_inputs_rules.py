"""The inputs state machine and its validation, with no I/O."""

from __future__ import annotations

import base64
from dataclasses import replace

import pytest

from dagnats.core.errors import InvalidArgument
from dagnats.inputs import rules
from dagnats.inputs.rules import InputState, Mode, Refusal, Status, StepProgress, StepStatus

RUN = "0123456789abcdef0123456789abcdef"
WINDOW = 100.0  # the dedupe window; queued() is created at 1.0


def queued(**fields: object) -> InputState:
    base = InputState(
        run_id=RUN,
        step_id="agent",
        request_id="msg-1",
        mode=Mode.STEER,
        content=b'{"text": "hi"}',
        created_at=1.0,
        updated_at=1.0,
        created_by="nonce",
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def placed(iteration: int = 2) -> InputState:
    state = rules.place(queued(), iteration=iteration, attempt=1, writer="w1", now=2.0)
    assert isinstance(state, InputState)
    return state


# ---- withdraw -------------------------------------------------------------------


def test_withdraw_a_queued_input() -> None:
    assert rules.withdraw(queued(), now=5.0, window=WINDOW) == queued(
        status=Status.WITHDRAWN, updated_at=5.0
    )


def test_withdraw_twice_changes_nothing() -> None:
    withdrawn = queued(status=Status.WITHDRAWN, updated_at=5.0)
    assert rules.withdraw(withdrawn, now=9.0, window=WINDOW) == withdrawn


def test_a_placed_input_cannot_be_withdrawn() -> None:
    refused = rules.withdraw(placed(iteration=3), now=5.0, window=WINDOW)
    assert refused == Refusal("input was placed into iteration 3; it cannot be withdrawn")


def test_an_unanswered_input_cannot_be_withdrawn() -> None:
    assert isinstance(
        rules.withdraw(queued(status=Status.UNANSWERED), now=5.0, window=WINDOW), Refusal
    )


# ---- place and reclaim ----------------------------------------------------------


def test_place_a_queued_input_records_the_dispatch() -> None:
    state = rules.place(queued(), iteration=4, attempt=2, writer="w1", now=7.0)
    assert state == queued(
        status=Status.PLACED,
        placed_iteration=4,
        placed_attempt=2,
        placed_by="w1",
        updated_at=7.0,
    )


@pytest.mark.parametrize("status", [Status.PLACED, Status.WITHDRAWN, Status.UNANSWERED])
def test_only_a_queued_input_can_be_placed(status: Status) -> None:
    state = queued(status=status)
    assert isinstance(rules.place(state, iteration=0, attempt=1, writer="w", now=2.0), Refusal)


def test_another_writer_of_the_same_iteration_reclaims_a_placement() -> None:
    state = rules.reclaim(placed(iteration=2), iteration=2, attempt=3, writer="w2", now=8.0)
    assert isinstance(state, InputState)
    assert (state.status, state.placed_attempt, state.placed_by) == (Status.PLACED, 3, "w2")


def test_reclaim_refuses_another_iteration_or_an_unplaced_input() -> None:
    other = rules.reclaim(placed(iteration=2), iteration=3, attempt=1, writer="w2", now=8.0)
    assert isinstance(other, Refusal)
    unplaced = rules.reclaim(queued(), iteration=0, attempt=1, writer="w2", now=8.0)
    assert isinstance(unplaced, Refusal)


def test_a_fenced_writer_releases_its_unrecorded_claim_to_the_queue() -> None:
    state = rules.release(placed(iteration=2), iteration=2, writer="w1", recorded=(), now=9.0)
    assert state == replace(queued(), updated_at=9.0)


@pytest.mark.parametrize(
    ("iteration", "writer", "recorded"),
    [(2, "w1", ("msg-1",)), (2, "w2", ()), (3, "w1", ())],
    ids=["recorded", "another writer", "another iteration"],
)
def test_release_leaves_a_recorded_or_another_claim(
    iteration: int, writer: str, recorded: tuple[str, ...]
) -> None:
    state = placed(iteration=2)
    assert (
        rules.release(state, iteration=iteration, writer=writer, recorded=recorded, now=9.0) is None
    )
    assert rules.release(queued(), iteration=2, writer="w1", recorded=(), now=9.0) is None


# ---- close ----------------------------------------------------------------------


def test_close_turns_queued_into_unanswered() -> None:
    assert rules.close(queued(), now=6.0, window=WINDOW) == queued(
        status=Status.UNANSWERED, updated_at=6.0
    )


@pytest.mark.parametrize("status", [Status.PLACED, Status.WITHDRAWN, Status.UNANSWERED])
def test_close_leaves_everything_else(status: Status) -> None:
    assert rules.close(queued(status=status), now=6.0, window=WINDOW) is None


# ---- visible status ---------------------------------------------------------------


def seen(state: InputState, status: StepStatus | None, committed: int, now: float = 5.0) -> Status:
    step = None if status is None else StepProgress(status=status, committed=committed)
    return rules.visible(state, step, now=now, window=WINDOW).status


def test_placed_stays_placed_while_its_iteration_runs() -> None:
    assert seen(placed(2), StepStatus.RUNNING, 2) is Status.PLACED


def test_placed_stays_placed_while_its_iteration_waits_for_a_retry() -> None:
    # A retry or a redelivery of the same iteration carries it.
    assert seen(placed(2), StepStatus.WAITING, 2) is Status.PLACED


def test_placed_is_done_once_the_step_moved_on() -> None:
    assert seen(placed(2), StepStatus.RUNNING, 3) is Status.DONE


def test_placed_is_done_when_the_step_completed() -> None:
    progress = rules.step_progress(StepStatus.COMPLETED, iteration=2, iterations=2)
    assert rules.visible(placed(2), progress, now=5.0, window=WINDOW).status is Status.DONE


def test_placed_is_done_when_its_iteration_committed_and_the_loop_failed_at_its_bound() -> None:
    # max_iterations: the continue of iteration 2 was accepted, then the loop failed.
    progress = rules.step_progress(StepStatus.FAILED, iteration=2, iterations=3)
    assert rules.visible(placed(2), progress, now=5.0, window=WINDOW).status is Status.DONE


@pytest.mark.parametrize(
    ("status", "ended"), [(StepStatus.FAILED, "failed"), (StepStatus.CANCELLED, "was cancelled")]
)
def test_placed_is_dropped_when_the_step_ended_in_that_iteration(
    status: StepStatus, ended: str
) -> None:
    progress = rules.step_progress(status, iteration=2, iterations=2)
    shown = rules.visible(placed(2), progress, now=5.0, window=WINDOW)
    assert shown.status is Status.DROPPED
    assert shown.reason == f"placed into iteration 2, which never committed: the step {ended} first"


def test_placed_without_a_step_shows_as_stored() -> None:
    assert seen(placed(2), None, 0) is Status.PLACED


@pytest.mark.parametrize(
    "status", [Status.WITHDRAWN, Status.UNANSWERED, Status.DROPPED, Status.EXPIRED]
)
def test_final_statuses_show_as_stored(status: Status) -> None:
    assert seen(queued(status=status), StepStatus.COMPLETED, 9) is status


def test_queued_shows_as_stored_while_the_step_may_place_it() -> None:
    for status in (StepStatus.PENDING, StepStatus.RUNNING, StepStatus.WAITING):
        assert seen(queued(), status, 0) is Status.QUEUED
    assert seen(queued(), None, 0) is Status.QUEUED


@pytest.mark.parametrize("status", [StepStatus.COMPLETED, StepStatus.FAILED, StepStatus.CANCELLED])
def test_queued_on_a_finished_step_reads_unanswered_before_the_close_stores_it(
    status: StepStatus,
) -> None:
    assert seen(queued(), status, 0) is Status.UNANSWERED


def test_a_queued_input_older_than_the_dedupe_window_reads_expired() -> None:
    assert seen(queued(), StepStatus.WAITING, 0, now=1.0 + WINDOW) is Status.QUEUED
    shown = rules.visible(queued(), None, now=1.0 + WINDOW + 0.5, window=WINDOW)
    assert shown.status is Status.EXPIRED
    assert shown.reason == ("queued for longer than the dedupe window (100 s) without being placed")


# ---- the step's end -----------------------------------------------------------------


def test_at_step_end_every_input_ends_in_a_final_status() -> None:
    failed = StepProgress(status=StepStatus.FAILED, committed=2)
    ended = {
        "queued": rules.at_step_end(queued(), failed, now=6.0, window=WINDOW),
        "placed here": rules.at_step_end(placed(2), failed, now=6.0, window=WINDOW),
        "old queued": rules.at_step_end(queued(), failed, now=500.0, window=WINDOW),
    }
    assert {k: v.status if v else None for k, v in ended.items()} == {
        "queued": Status.UNANSWERED,
        "placed here": Status.DROPPED,
        "old queued": Status.EXPIRED,
    }
    # Placed into a committed iteration: done, nothing to store.
    assert rules.at_step_end(placed(1), failed, now=6.0, window=WINDOW) is None
    for status in (Status.WITHDRAWN, Status.UNANSWERED, Status.DROPPED, Status.EXPIRED):
        assert status.final
        assert rules.at_step_end(queued(status=status), failed, now=6.0, window=WINDOW) is None


def test_a_dropped_or_expired_input_cannot_be_withdrawn() -> None:
    dropped = queued(status=Status.DROPPED, reason="placed into iteration 0, which never committed")
    refused = rules.withdraw(dropped, now=6.0, window=WINDOW)
    assert isinstance(refused, Refusal) and "dropped" in refused.message
    refused = rules.withdraw(queued(), now=500.0, window=WINDOW)
    assert isinstance(refused, Refusal) and "expired" in refused.message


def test_a_finished_step_takes_no_inputs() -> None:
    assert rules.accepts_inputs(True, StepStatus.RUNNING)
    assert rules.accepts_inputs(True, StepStatus.PENDING)
    assert not rules.accepts_inputs(True, StepStatus.COMPLETED)
    assert not rules.accepts_inputs(False, StepStatus.RUNNING)


# ---- validation -------------------------------------------------------------------


def check(**fields: object) -> rules.Submission:
    args: dict[str, object] = {
        "run_id": RUN,
        "step_id": "agent",
        "request_id": "msg-1",
        "mode": Mode.STEER,
        "content": b'{"text": "hi"}',
    }
    args.update(fields)
    return rules.check_submission(**args)  # type: ignore[arg-type]


def test_a_valid_submission_passes() -> None:
    assert check().mode is Mode.STEER


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"run_id": "nope"}, "run_id"),
        ({"step_id": "a.b"}, "step_id"),
        ({"step_id": ""}, "step_id"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * 257}, "request_id"),
        ({"request_id": "\ud800"}, "request_id"),
        # Not addressable again as one segment of the input's URL.
        ({"request_id": "a/b"}, "request_id"),
        ({"request_id": "."}, "request_id"),
        ({"request_id": ".."}, "request_id"),
        ({"mode": None}, "mode"),
        ({"content": b""}, "content"),
        ({"content": b"{not json"}, "content"),
    ],
)
def test_bad_fields_are_named(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check(**fields)
    assert caught.value.field == field


def test_oversized_content_says_how_big() -> None:
    content = b'"' + b"x" * 69998 + b'"'
    with pytest.raises(InvalidArgument, match="content is 70000 bytes; the limit is 65536"):
        check(content=content)
    assert check(content=content[:100] + b'"', max_bytes=200)


def test_a_request_id_of_256_characters_of_any_kind_passes() -> None:
    assert check(request_id="é. *>" * 51 + "z").request_id.startswith("é. *>")


# ---- keys ---------------------------------------------------------------------------


def test_keys_encode_the_request_id_without_padding() -> None:
    key = rules.key(RUN, "agent", "a.b *>")
    assert key.startswith(rules.prefix(RUN, "agent"))
    encoded = key.removeprefix(f"{RUN}.agent.")
    assert "=" not in encoded and "." not in encoded
    assert base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)) == b"a.b *>"


def test_distinct_request_ids_get_distinct_keys() -> None:
    ids = ["a", "a=", "A", "a.b", "a b", "ab", "\u00e9", "e\u0301"]
    assert len({rules.key(RUN, "agent", r) for r in ids}) == len(ids)


def claim(state: InputState, **overrides: object) -> InputState | None:
    args: dict[str, object] = {
        "mode": Mode.STEER,
        "iteration": 2,
        "attempt": 1,
        "writer": "b" * 16,
        "recorded": (),
        "now": 9.0,
        "window": WINDOW,
    }
    args.update(overrides)
    return rules.claim_for(state, **args)  # type: ignore[arg-type]


def test_claim_for_places_a_queued_input_of_the_mode_only() -> None:
    taken = claim(queued())
    assert taken is not None and taken.status is Status.PLACED and taken.placed_by == "b" * 16
    assert claim(queued(), mode=Mode.FOLLOW_UP) is None


def test_claim_for_takes_over_a_placement_that_never_reached_the_journal() -> None:
    left = placed(iteration=2)
    taken = claim(left)
    assert taken is not None and taken.placed_by == "b" * 16
    assert claim(left, recorded=(left.request_id,)) is None, "its record exists: it is placed"
    own = claim(left, writer=left.placed_by)
    assert own is not None, "our own earlier try claimed it and never recorded it"
    assert claim(left, writer=left.placed_by, recorded=(left.request_id,)) is None
    assert claim(left, iteration=3) is None, "another iteration's placement"


def test_claim_for_expires_a_queued_input_older_than_the_dedupe_window() -> None:
    taken = claim(queued(), now=1.0 + WINDOW + 1)
    assert taken is not None and taken.status is Status.EXPIRED and not taken.placed_by
