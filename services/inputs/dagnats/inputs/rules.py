"""Every rule of the inputs state machine, in one place.

Pure functions over :class:`InputState` values: no I/O, no ``async``, no
``nats``, no ``grpc``. The clock is passed in (``now``), and so is the dedupe
window (``window``). The service reads a record, asks these functions what it
becomes, and writes the answer with a compare-and-swap on the record's
revision, so two writers never both win.

Stored states and the only transitions between them::

    queued ──withdraw──> withdrawn      (withdraw again: unchanged)
    queued ──place─────> placed         (by one dispatch: iteration, attempt, writer)
    queued ──close─────> unanswered     (the step finished first)
    queued ──expire────> expired        (queued longer than the dedupe window)
    placed ──reclaim───> placed         (same iteration, another writer)
    placed ──release───> queued         (a fenced writer's claim never recorded)
    placed ──drop──────> dropped        (the step ended; the placing iteration
                                         never committed)

Invariants:

* A record is created ``queued``; it goes back to ``queued`` only by a
  release of a claim that never reached the journal.
* ``withdrawn``, ``unanswered``, ``expired`` and ``dropped`` are final;
  ``placed`` changes only by a reclaim within the iteration that placed it,
  a release, or a drop once the step ended. So a withdrawal that won is never
  followed by a placement, and a placed input is never withdrawn.
* Every input ends in a status a client sees as final: ``done``,
  ``unanswered``, ``withdrawn``, ``expired`` or ``dropped``
  (:func:`at_step_end` decides it when the step ends). While the step may
  still retry the iteration that placed an input, the input stays
  ``placed``: a retry or a redelivery carries it (the journal's record).
* A queued input older than the dedupe window is never placed: it reads as
  ``expired`` (:func:`visible`) and is stored so by whoever meets it first.
* ``done`` is never stored. A client sees ``done`` once the placing
  iteration committed (:func:`visible`). The journal's ``input.placed``
  record, not this record, is the truth about placement.
* A refused transition changes nothing and says why (:class:`Refusal`).
* Every key is ``{run}.{step}.{base64url(request_id)}``: the caller's
  request id never reaches a key or subject raw, whatever characters it has.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Collection
from dataclasses import dataclass, replace

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_request_id, check_run_id, check_token
from dagnats.core.status import StepStatus as StepStatus
from dagnats.core.usage import parse_raise

MAX_CONTENT_BYTES = 64 * 1024
MAX_WAIT = 60.0
"""The longest a get may wait for a status change, in seconds."""
DEDUPE_WINDOW = 7 * 24 * 3600.0
"""How long a repeat of a request_id is promised the original, and an input
may wait queued, in seconds, unless set otherwise (``DAGNATS_INPUT_DEDUPE_WINDOW``)."""


class Mode(enum.Enum):
    """Where an input enters the conversation."""

    STEER = "steer"
    FOLLOW_UP = "follow_up"
    APPROVAL = "approval"
    """An approval or denial of a tool call (its content names the call)."""
    BUDGET = "budget"
    """Raises the run's budget (its content says by how much)."""


class Status(enum.Enum):
    """Where an input is. ``DONE`` is only ever computed, never stored."""

    QUEUED = "queued"
    PLACED = "placed"
    DONE = "done"
    UNANSWERED = "unanswered"
    WITHDRAWN = "withdrawn"
    DROPPED = "dropped"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        """Whether nothing more happens to an input of this status."""
        return self not in (Status.QUEUED, Status.PLACED)


@dataclass(frozen=True, slots=True, kw_only=True)
class InputState:
    """One submission, as stored (mirrors ``dagnats.inputs.v1.Input``)."""

    run_id: str
    step_id: str
    request_id: str
    mode: Mode
    content: bytes
    status: Status = Status.QUEUED
    created_at: float = 0.0
    updated_at: float = 0.0
    placed_iteration: int = 0
    placed_attempt: int = 0
    placed_by: str = ""
    created_by: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepProgress:
    """What the inputs of a step depend on of it: its status, and how many of
    its iterations committed (an input placed into an earlier one is done)."""

    status: StepStatus
    committed: int


def step_progress(status: StepStatus, iteration: int, iterations: int) -> StepProgress:
    """A step's progress from its run's view: ``iterations`` continues were
    accepted (the last one may have failed the loop at its bound without a
    next iteration), and a completed step's own iteration committed too."""
    committed = max(iterations, iteration)
    if status is StepStatus.COMPLETED:
        committed = max(committed, iteration + 1)
    return StepProgress(status=status, committed=committed)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A transition that does not apply; ``message`` says why, for the caller."""

    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """A validated submission."""

    run_id: str
    step_id: str
    request_id: str
    mode: Mode
    content: bytes


# ---- transitions ----------------------------------------------------------------


def new_input(submission: Submission, *, created_by: str, now: float) -> InputState:
    """The queued record a submission creates; ``created_by`` is the caller's nonce."""
    return InputState(
        run_id=submission.run_id,
        step_id=submission.step_id,
        request_id=submission.request_id,
        mode=submission.mode,
        content=submission.content,
        status=Status.QUEUED,
        created_at=now,
        updated_at=now,
        created_by=created_by,
    )


def withdraw(state: InputState, *, now: float, window: float) -> InputState | Refusal:
    """Queued -> withdrawn; withdrawn stays as it is (a repeat is fine)."""
    if expired(state, now=now, window=window):
        return Refusal(f"input expired: {_expired_reason(window)}; it cannot be withdrawn")
    match state.status:
        case Status.QUEUED:
            return replace(state, status=Status.WITHDRAWN, updated_at=now)
        case Status.WITHDRAWN:
            return state
        case Status.PLACED | Status.DONE:
            return Refusal(
                f"input was placed into iteration {state.placed_iteration}; it cannot be withdrawn"
            )
        case Status.UNANSWERED:
            return Refusal("the step finished before the input was placed; it cannot be withdrawn")
        case Status.DROPPED | Status.EXPIRED:
            return Refusal(f"input {state.status.value}: {state.reason}; it cannot be withdrawn")


def place(
    state: InputState, *, iteration: int, attempt: int, writer: str, now: float
) -> InputState | Refusal:
    """Queued -> placed by the dispatch ``(iteration, attempt)`` of ``writer``.
    The caller has checked that it has not expired (:func:`claim_for`)."""
    if state.status is not Status.QUEUED:
        return Refusal(f"input is {state.status.value}; only a queued input can be placed")
    return _placed(state, iteration=iteration, attempt=attempt, writer=writer, now=now)


def reclaim(
    state: InputState, *, iteration: int, attempt: int, writer: str, now: float
) -> InputState | Refusal:
    """Placed -> placed by another writer of the same iteration.

    For an input whose placement never reached the journal (its writer was
    fenced or crashed first); the journal service decides when that is so.
    """
    if state.status is not Status.PLACED:
        return Refusal(f"input is {state.status.value}; only a placed input can be reclaimed")
    if state.placed_iteration != iteration:
        return Refusal(f"input was placed into iteration {state.placed_iteration}, not {iteration}")
    return _placed(state, iteration=iteration, attempt=attempt, writer=writer, now=now)


def claim_for(
    state: InputState,
    *,
    mode: Mode,
    iteration: int,
    attempt: int,
    writer: str,
    recorded: Collection[str],
    now: float,
    window: float,
) -> InputState | None:
    """What a dispatch placing ``mode`` inputs does to ``state``, if anything.

    A queued input is placed, unless it waited longer than the dedupe window:
    then it is expired instead, and the caller records nothing of it (it
    comes back with another status than ``placed``). An input placed into
    this same iteration whose ``input.placed`` record is not in the journal
    (``recorded`` lists the request ids that are, this writer's own records
    included) was left by a holder that was fenced or crashed between its
    claim and its record -- an earlier try of this writer's own call
    included: it is reclaimed. Everything else is not this dispatch's to take.
    """
    if state.mode is not mode:
        return None
    if state.status is Status.QUEUED:
        if expired(state, now=now, window=window):
            return expire(state, now=now, window=window)
        moved = place(state, iteration=iteration, attempt=attempt, writer=writer, now=now)
    elif state.request_id not in recorded:
        moved = reclaim(state, iteration=iteration, attempt=attempt, writer=writer, now=now)
    else:
        return None
    return moved if isinstance(moved, InputState) else None


def release(
    state: InputState, *, iteration: int, writer: str, recorded: Collection[str], now: float
) -> InputState | None:
    """Placed -> queued, for a claim of a fenced ``writer`` in ``iteration``
    that never got its ``input.placed`` record (``recorded`` lists the request
    ids that have one in the iteration); None when ``state`` is not such a claim.

    The successor may have placed the step's inputs before this claim was made,
    and would never take it over: left placed, it reads as done once the
    iteration commits, though no turn ever saw it.
    """
    if (
        state.status is not Status.PLACED
        or state.placed_by != writer
        or state.placed_iteration != iteration
        or state.request_id in recorded
    ):
        return None
    return replace(
        state,
        status=Status.QUEUED,
        placed_iteration=0,
        placed_attempt=0,
        placed_by="",
        updated_at=now,
    )


def _placed(
    state: InputState, *, iteration: int, attempt: int, writer: str, now: float
) -> InputState:
    return replace(
        state,
        status=Status.PLACED,
        placed_iteration=iteration,
        placed_attempt=attempt,
        placed_by=writer,
        updated_at=now,
    )


def expired(state: InputState, *, now: float, window: float) -> bool:
    """Whether ``state`` is a queued input that waited longer than the dedupe
    window: it is never placed, and ends ``expired``."""
    return state.status is Status.QUEUED and now - state.created_at > window


def expire(state: InputState, *, now: float, window: float) -> InputState | None:
    """Queued -> expired, once it waited longer than the dedupe window; None
    when nothing changes."""
    if not expired(state, now=now, window=window):
        return None
    return replace(state, status=Status.EXPIRED, reason=_expired_reason(window), updated_at=now)


def _expired_reason(window: float) -> str:
    return f"queued for longer than the dedupe window ({window:g} s) without being placed"


def close(state: InputState, *, now: float, window: float) -> InputState | None:
    """Queued -> unanswered, because the step finished (expired, if it
    waited longer than the dedupe window); None when nothing changes."""
    if state.status is not Status.QUEUED:
        return None
    return expire(state, now=now, window=window) or replace(
        state, status=Status.UNANSWERED, updated_at=now
    )


def _dropped_reason(state: InputState, step: StepProgress) -> str:
    ended = "was cancelled" if step.status is StepStatus.CANCELLED else "failed"
    return (
        f"placed into iteration {state.placed_iteration}, which never committed: "
        f"the step {ended} first"
    )


def at_step_end(
    state: InputState, step: StepProgress, *, now: float, window: float
) -> InputState | None:
    """What an input becomes once its step finished (``step``): queued, it is
    closed (:func:`close`); placed into an iteration that never committed,
    it is dropped, with the reason. None when nothing changes: placed into a
    committed iteration (done), or final already."""
    match state.status:
        case Status.QUEUED:
            return close(state, now=now, window=window)
        case Status.PLACED if state.placed_iteration >= step.committed:
            reason = _dropped_reason(state, step)
            return replace(state, status=Status.DROPPED, reason=reason, updated_at=now)
    return None


def visible(
    state: InputState, step: StepProgress | None, *, now: float, window: float
) -> InputState:
    """The input as a client sees it: ``placed`` reads as ``done`` once the
    placing iteration committed, and as ``dropped`` once the step finished
    without it committing; ``queued`` reads as ``expired`` past the dedupe
    window, and as ``unanswered`` once the step finished. ``step`` is None
    when the step is gone. What only reads so is stored so by the engine's
    close at the step's end, or by the first placement or close that meets
    it."""
    if state.status is Status.QUEUED:
        if step is not None and step.status.finished:
            return close(state, now=now, window=window) or state
        return expire(state, now=now, window=window) or state
    if state.status is not Status.PLACED or step is None:
        return state
    if state.placed_iteration < step.committed:
        return replace(state, status=Status.DONE)
    if step.status.finished:
        return at_step_end(state, step, now=now, window=window) or state
    return state


def accepts_inputs(run_running: bool, step_status: StepStatus) -> bool:
    """Whether a step takes new inputs: its run runs and it has not finished."""
    return run_running and not step_status.finished


# ---- validation -----------------------------------------------------------------


def check_content(content: bytes, *, max_bytes: int = MAX_CONTENT_BYTES) -> bytes:
    """Return ``content`` if it is one JSON value of at most ``max_bytes``.

    Raises:
        InvalidArgument: naming ``content`` otherwise.
    """
    if len(content) > max_bytes:
        raise InvalidArgument(
            f"content is {len(content)} bytes; the limit is {max_bytes}", field="content"
        )
    try:
        json.loads(content)
    except ValueError as err:
        raise InvalidArgument(f"content must be JSON: {err}", field="content") from None
    return content


def check_submission(
    run_id: str,
    step_id: str,
    request_id: str,
    mode: Mode | None,
    content: bytes,
    *,
    max_bytes: int = MAX_CONTENT_BYTES,
) -> Submission:
    """Validate a submission; ``mode`` is None when the caller named none.

    Returns:
        The validated submission.

    Raises:
        InvalidArgument: naming the first offending field.
    """
    check_run_id(run_id)
    check_token(step_id, field="step_id")
    check_request_id(request_id)
    if mode is None:
        raise InvalidArgument("mode must be steer or follow_up", field="mode")
    check_content(content, max_bytes=max_bytes)
    if mode is Mode.BUDGET:
        parse_raise(json.loads(content or b"null"))  # checked JSON above
    return Submission(
        run_id=run_id, step_id=step_id, request_id=request_id, mode=mode, content=content
    )


# ---- keys -----------------------------------------------------------------------


def encode_request_id(request_id: str) -> str:
    """base64url of the UTF-8 request id without padding: safe in a key or subject."""
    return base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")


def prefix(run_id: str, step_id: str) -> str:
    """The key prefix shared by every input of a step (ends with a dot)."""
    return f"{run_id}.{step_id}."


def key(run_id: str, step_id: str, request_id: str) -> str:
    """The key of one input: ``{run}.{step}.{encoded request_id}``."""
    return prefix(run_id, step_id) + encode_request_id(request_id)
