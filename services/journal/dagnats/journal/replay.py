"""Every replay rule of the journal, in one place.

Pure functions over the records of one iteration (all its attempts, in
sequence order). No I/O: the journal service reads the records, asks these
functions what to do, and writes what they say. The same answers serve the
Python SDK, stub-based workers in other languages and the HTTP bridge.

Claim (one dispatch ``(iteration, attempt)`` opening the journal), one step
at a time: ``claim_step`` takes what the claim asked (``ClaimAsked``) and
what it found so far (``ClaimSeen``) and says what it does next, a read or
its answer; the service does it, adds what it found, and asks again.

* Where it starts. A claim with the lease (the engine's, as it leases the
  task) that could not ride -> ``NoClaim``: its holder claims. One of a
  run's first dispatch, first delivery -> ``RideFirstRecord`` before
  anything is read: no holder came before it. Iteration 0 ->
  ``ReadTail(with_run=True)``, the run read at once. A claim that may not
  ride, when the last commit this replica stored on the step ended the
  iteration just before -> ``UseGuessedTail``. Else ``ReadTail``.
* The tail is a cancel -> ``Cancelled`` (the claim is refused).
* Iteration 0 of a run that has ended -> ``Stale``: a purge resets a step's
  fence (docs/architecture.md, F4), so a journal is never opened afresh for
  an ended run. A later iteration follows a commit on the subject, which a
  purge would have removed.
* The tail is of the iteration or later -> ``ReadRecords``, the iteration's.
* Then the records decide (``decide_claim``): the tail belongs to a later
  dispatch -> ``Stale`` (a late redelivery; settle the task without
  running); the iteration has a commit that ends it, or this attempt has a
  commit -> ``AlreadyCommitted`` (the holder crashed between commit and
  event; republish the commit's event and settle); else ``Proceed``.
* On the guessed tail, only a stored claim stands: its fenced append checks
  the guessed tail. Any other answer, or an append the fence refused (it
  wrote nothing), -> ``ReadTail``: the tail is read then.
* ``Proceed`` on nothing of its iteration, for the first delivery of the
  iteration's first attempt, fences and closes nothing: every earlier holder
  is of an earlier iteration, fenced by the tail already. Asked to, it rides
  the holder's first record (``RideFirstRecord``, ``claim_may_ride``),
  unless it alone would reach the restart limit.
* A claim with the lease answers nothing else -> ``NoClaim``.
* Otherwise the claim is appended, which fences every earlier holder:
  ``RestartLimit`` when with it the iteration ends in ``limit`` deliveries in
  a row that made no progress (``restart_limit_reached``: its trailing
  claims, a claim repeated for the same delivery counted once, and the first
  delivery's claim that rode and was never stored, when the iteration holds
  nothing but claims of later deliveries, ``deliveries_without_progress``),
  a failure committed after the claim; else ``StoreClaim``, closing every
  intent of an *earlier attempt* that has no result with an ``interrupted``
  result.

Calls, by position within the attempt (model calls, tool calls and
place-inputs calls share one position counter):

* A recorded model response at the position is reused.
* A recorded tool result is reused, whatever the declarations say.
* An intent without a result is run again only if the recorded and the
  current declaration are both safe; otherwise the call gets an
  ``interrupted`` result carrying the partial output the holder wrote.
* A different call at a recorded position is ``Mismatch``; nothing is written.
  A call's approval is part of the call (a call that asks for one, a call
  under one, and which approval); but a call under an approval at a position
  that recorded the same call asking for one is its decision: ``RunNew`` there
  (a redelivery placed the approval its earlier delivery had not).
* At or past ``replay_positions`` of the claim's records, nothing is
  recorded: a model call there is ``CallModel`` whatever the attempt.
* A new attempt (an engine retry) runs model calls and safe tools fresh, but a
  tool call matching an earlier attempt's *unsafe* intent by name and input
  honours it: the earlier result (or ``interrupted``) is used and the tool is
  not started. Each earlier intent is honoured at most once.

Cancellation (``cancel_of``, ``fenced_out_write``): the engine appends a
cancel record to the journal of each step its run's end stopped, whatever the
tail, before the cancel is answered; from then on the tail is always a cancel:

* A claim whose tail is a cancel -> ``Cancelled``, before anything is read.
* A write refused by the fence (its writer's tail moved on) whose tail is a
  cancel -> ``Cancelled``, and nothing is written; but for a tool result (on
  its own, or ahead of a commit) that answers an intent its writer saw, when
  the first record after the writer's tail is the engine's cancel (no
  successor wrote in between): it is stored after the tail, ahead of a copy
  of the cancel (``StoreAfterCancel``), once (``StoredAfterCancel``). A tool
  already running when the cancel came thus keeps its result.
* A refused write whose tail is no cancel -> ``Fenced``, as before.

Why a writer was fenced (``why_fenced``), from the records after its last
seen sequence: a record of a later dispatch -> ``stale``; a commit that ends
the writer's dispatch -> ``committed``; another writer's record -> ``fenced``;
only its own records -> ``own`` (its token was behind its own write).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dagnats.journal.limits import MAX_PARTIAL_BYTES
from dagnats.journal.model import (
    Action,
    AnyEntry,
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

DEFAULT_RESTART_LIMIT = 5

# ---- claim ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Stale:
    """Settle the task without running: the journal is past the dispatch, or
    the run ended before its first iteration was claimed."""

    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AlreadyCommitted:
    """Settle the task with ``commit``'s event: its holder committed, then
    died before the event was published."""

    commit: CommitEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class Proceed:
    """Claim, then answer these earlier-attempt intents as interrupted."""

    close: tuple[IntentEntry, ...] = ()


ClaimDecision = Stale | AlreadyCommitted | Proceed


def decide_claim(
    *, tail: AnyEntry | None, records: Sequence[AnyEntry], iteration: int, attempt: int
) -> ClaimDecision:
    """What the records say of a dispatch that opens the journal.

    Args:
        tail: the last record on the subject, whatever its iteration.
        records: every record of ``iteration``, in order.
    """
    if tail is not None and tail.dispatch > (iteration, attempt):
        return Stale(
            detail=f"the journal is at dispatch {tail.dispatch}, past ({iteration}, {attempt})"
        )
    for record in records:
        if isinstance(record, CommitEntry) and (record.ends_iteration or record.attempt == attempt):
            return AlreadyCommitted(commit=record)
    return Proceed(close=tuple(_unanswered(records, before_attempt=attempt)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancelled:
    """The run was cancelled: refuse the call, write nothing."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimAsked:
    """A claim as asked: by a worker's ``Claim``, or by the engine as it
    leases the task (``with_lease``: the claim with the lease).

    ``may_ride``: the claim may be stored with its holder's first record.
    ``first_dispatch``: the engine knows the run running and the task the
    first delivery of its step's first dispatch (the claim with the lease
    only). ``guessed_tail``: the iteration of the last commit this replica
    stored on the step (None: none it remembers).
    """

    iteration: int
    attempt: int
    delivery: int
    worker_id: str
    limit: int
    may_ride: bool
    with_lease: bool = False
    first_dispatch: bool = False
    guessed_tail: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimSeen:
    """What a claim has found so far; the service adds to it as each step says.

    ``tail``: the entries of the tail record the claim decides on, in order
    (``()``: the journal is empty; None: no tail yet). ``guessed``: that tail
    is the guessed tail, not read. ``run_ended``: how the run ended, for a
    claim of iteration 0 (empty: it runs). ``records``: the entries of the
    iteration's records (None: not read). ``guess_missed``: the claim's
    append on the guessed tail was refused, and nothing was written.
    """

    tail: tuple[AnyEntry, ...] | None = None
    guessed: bool = False
    run_ended: str = ""
    records: tuple[AnyEntry, ...] | None = None
    guess_missed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadTail:
    """Read the step's tail; with ``with_run`` (a claim of iteration 0), the
    run at once: only then may the run's end decide the claim."""

    with_run: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class UseGuessedTail:
    """Decide on the guessed tail: the last commit this replica stored on the
    step, which ended the iteration before. The claim's fenced append checks
    it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadRecords:
    """Read the iteration's records: those after ``base`` through ``through``
    (the tail)."""

    base: int
    through: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RideFirstRecord:
    """Answer the claim without a write: the holder's first record stores it,
    fenced on the tail it was made on (nothing read: an empty journal).
    ``base``: the sequence of the commit that ended the iteration before."""

    base: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreClaim:
    """Append the claim, which fences every earlier holder, then answer
    ``close`` (earlier attempts' intents) as interrupted. ``guessed``: the
    append is fenced on the guessed tail; refused, it wrote nothing, and the
    claim reads the tail then."""

    base: int
    close: tuple[IntentEntry, ...]
    guessed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartLimit:
    """Append the claim (as ``StoreClaim``), then commit the retriable failure
    of the restart limit: with it, ``limit`` deliveries in a row made no
    progress."""

    base: int
    guessed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class NoClaim:
    """A claim with the lease that would not ride: nothing is written, and
    the holder's own ``Claim`` stores it, settles the task or is refused."""


ClaimStep = (
    ReadTail
    | UseGuessedTail
    | ReadRecords
    | RideFirstRecord
    | StoreClaim
    | RestartLimit
    | Stale
    | AlreadyCommitted
    | Cancelled
    | NoClaim
)


def claim_step(asked: ClaimAsked, seen: ClaimSeen) -> ClaimStep:
    """What a claim does next, given what it has found so far: a read, or its
    answer. The service asks again after each read, until an answer."""
    rides = asked.may_ride and claim_may_ride(asked.attempt, asked.delivery, asked.limit)
    if seen.tail is None:
        return _where_a_claim_starts(asked, rides=rides)
    if (cancel := cancel_of(seen.tail)) is not None:
        return NoClaim() if asked.with_lease else cancel
    if asked.iteration == 0 and seen.run_ended:
        # A purge resets a step's fence: a journal is never opened afresh for
        # an ended run. A later iteration follows a commit a purge removes.
        return NoClaim() if asked.with_lease else Stale(detail=seen.run_ended)
    tail = seen.tail[-1] if seen.tail else None
    base = base_before(tail, asked.iteration)
    if seen.records is None and tail is not None and tail.iteration >= asked.iteration:
        return ReadRecords(base=base, through=tail.seq)
    records = seen.records or ()
    decision = decide_claim(
        tail=tail, records=records, iteration=asked.iteration, attempt=asked.attempt
    )
    if seen.guessed and (seen.guess_missed or not isinstance(decision, Proceed)):
        # Only a claim's fenced append checks the guessed tail: an answer that
        # writes nothing, or an append it refused, needs the tail read.
        return ReadTail(with_run=False)
    if rides and not records and isinstance(decision, Proceed):
        return RideFirstRecord(base=base)
    if asked.with_lease:
        return NoClaim()
    match decision:
        case Proceed(close=close):
            if restart_limit_reached([*records, _claim_of(asked)], asked.limit):
                return RestartLimit(base=base, guessed=seen.guessed)
            return StoreClaim(base=base, close=close, guessed=seen.guessed)
        case Stale() | AlreadyCommitted():
            return decision


def _where_a_claim_starts(asked: ClaimAsked, *, rides: bool) -> ClaimStep:
    """The first step of a claim: which tail it decides on."""
    if asked.with_lease and not rides:
        return NoClaim()  # a redelivery or a retry: its claim is stored, by its holder
    if asked.with_lease and asked.first_dispatch and asked.iteration == 0:
        # No holder came before the first delivery of a first dispatch: the
        # journal holds nothing, and the holder's first record, fenced on an
        # empty tail, would be refused were a record there after all.
        return RideFirstRecord(base=0)
    if asked.iteration == 0:
        return ReadTail(with_run=True)
    # A claim that may ride appends nothing to check a guessed tail with.
    if not rides and asked.guessed_tail is not None and asked.guessed_tail == asked.iteration - 1:
        return UseGuessedTail()
    return ReadTail(with_run=False)


def _claim_of(asked: ClaimAsked) -> ClaimEntry:
    """The claim ``asked`` appends, as the restart limit counts it."""
    return ClaimEntry(
        seq=0,
        iteration=asked.iteration,
        attempt=asked.attempt,
        writer="",
        delivery=asked.delivery,
        worker_id=asked.worker_id,
    )


def base_before(tail: AnyEntry | None, iteration: int) -> int:
    """Sequence of the commit that ended the iteration before ``iteration``: the
    records of ``iteration`` come after it. Every record carries the base of
    its own iteration, so the tail alone tells."""
    if tail is None:
        return 0
    if tail.iteration < iteration and isinstance(tail, CommitEntry) and tail.ends_iteration:
        return tail.seq
    return tail.base_seq


def claim_may_ride(attempt: int, delivery: int, limit: int) -> bool:
    """Whether a claim that finds no record of its iteration may be stored
    with the holder's first record: it is the first delivery (not 0, which is
    unknown) of the first attempt, and it alone does not reach ``limit``."""
    return attempt == 1 and delivery == 1 and limit > 1


def restart_limit_reached(records: Sequence[AnyEntry], limit: int) -> bool:
    """Whether the iteration ends in ``limit`` deliveries in a row that made no
    progress (``deliveries_without_progress``)."""
    return deliveries_without_progress(records) >= limit


def deliveries_without_progress(records: Sequence[AnyEntry]) -> int:
    """How many deliveries in a row the iteration's trailing claims stand for.

    Each claim of another delivery than the claim after it counts one: a claim
    that repeats the one before it (the same attempt, delivery and worker: its
    answer never reached the worker, which claimed again) is no restart. And
    when the iteration holds nothing but claims, and the first was stored on
    its own by a later delivery of the first attempt than the first, one more
    delivery came before it whose claim was to ride its holder's first record
    (a first delivery's claim, or one handed over with the commit before) and
    was never stored: its holder died before writing anything."""
    trailing = 0
    after: ClaimEntry | None = None
    for record in reversed(records):
        if not isinstance(record, ClaimEntry):
            return trailing
        if after is None or not _same_delivery(record, after):
            trailing += 1
        after = record
    if after is not None and _followed_an_unstored_claim(after):
        trailing += 1
    return trailing


def _followed_an_unstored_claim(first: ClaimEntry) -> bool:
    """Whether ``first``, the iteration's first record, was stored by a
    delivery that came after one whose claim rode and was never stored. Only
    the first attempt's claims ride, and they are stored with their holder's
    first record (``leading``): a claim of the first attempt stored on its own
    by a later delivery than the first had one before it that left nothing."""
    return not first.leading and first.attempt == 1 and first.delivery > 1


def _same_delivery(a: ClaimEntry, b: ClaimEntry) -> bool:
    return a.delivery > 0 and (a.attempt, a.delivery, a.worker_id) == (
        b.attempt,
        b.delivery,
        b.worker_id,
    )


def partial_output(records: Sequence[AnyEntry], intent_seq: int, intent_index: int = 0) -> str:
    """What a tool reported while it ran, in order, cut to fit a record."""
    ref = (intent_seq, intent_index)
    return cut_partial(
        "".join(r.chunk for r in records if isinstance(r, OutputEntry) and r.intent_ref == ref)
    )


def cut_partial(text: str, limit: int = MAX_PARTIAL_BYTES) -> str:
    """``text`` if its UTF-8 fits ``limit`` bytes, else its end behind a note of
    how much was cut: an interrupted result must fit a record, or no claim
    could close its intent."""
    data = text.encode()
    if len(data) <= limit:
        return text
    tail = data[len(data) - limit :].decode(errors="ignore")
    return f"[{len(data) - len(tail.encode())} bytes cut]{tail}"


def _unanswered(records: Sequence[AnyEntry], *, before_attempt: int) -> list[IntentEntry]:
    answered = {r.intent_ref for r in records if isinstance(r, ResultEntry)}
    return [
        r
        for r in records
        if isinstance(r, IntentEntry) and r.attempt < before_attempt and r.ref not in answered
    ]


# ---- a fork's resume point -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeAt:
    """Where a step forked after a record resumes: the dispatch whose claim
    replays the copied records (the record's own, or the next iteration's
    after a continue), the continues before it, the output of the last of
    them, and the commit its state is rebuilt from (``base_seq``)."""

    iteration: int
    attempt: int
    output: bytes
    base_seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NoResume:
    """No run can resume after the record: why."""

    reason: str


ForkDecision = ResumeAt | NoResume


def fork_point(records: Sequence[AnyEntry], at_seq: int) -> ForkDecision:
    """Where a fork of a step's journal after the record at ``at_seq``
    resumes. ``records``: the step's entries through ``at_seq``, in order.

    A continue commit resumes at the next iteration, on its state; any other
    record at its own dispatch, on the state of the commit before it, so its
    claim replays the records of that dispatch copied before it. A cancel, or
    a commit that ends the step or its attempt, has nothing to resume."""
    at = [r for r in records if r.seq == at_seq]
    if not at:
        return NoResume(reason=f"seq {at_seq} is not a record of this step's journal")
    last = at[-1]
    match last:
        case CancelEntry():
            return NoResume(
                reason=f"seq {at_seq} is the cancel that ended the run; fork at a record before it"
            )
        case CommitEntry(action=Action.CONTINUE):
            return ResumeAt(
                iteration=last.iteration + 1, attempt=1, output=last.output, base_seq=at_seq
            )
        case CommitEntry(action=action):
            return NoResume(
                reason=(
                    f"seq {at_seq} is a commit ({action.value}) that ends the "
                    f"{'attempt' if action in (Action.FAIL, Action.PAUSE) else 'step'}: "
                    "fork at a record before it"
                )
            )
    base = next((r for r in records if r.seq == last.base_seq), None)
    output = base.output if isinstance(base, CommitEntry) else b""
    return ResumeAt(
        iteration=last.iteration, attempt=last.attempt, output=output, base_seq=last.base_seq
    )


# ---- model calls --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Mismatch:
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UseResponse:
    response: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CallModel:
    pass


ModelDecision = UseResponse | CallModel | Mismatch


def replay_positions(records: Iterable[AnyEntry]) -> int:
    """One past the last position of a call recorded in ``records`` (one
    iteration, every attempt); 0 when no call is recorded."""
    positions = [
        r.position for r in records if isinstance(r, ModelEntry | IntentEntry | InputEntry)
    ]
    return max(positions, default=-1) + 1


def decide_model(records: Sequence[AnyEntry], *, attempt: int, position: int) -> ModelDecision:
    """A model call at ``position`` of ``attempt``."""
    at = _at(records, attempt, position)
    match at:
        case ModelEntry(response=response):
            return UseResponse(response=response)
        case IntentEntry(name=name):
            return Mismatch(reason=f"position {position} recorded tool {name!r}, not a model call")
    return CallModel()


# ---- inputs -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayPlaced:
    inputs: tuple[InputEntry, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceNew:
    """Carry these earlier-attempt placements, then claim queued inputs; the
    request ids in ``recorded`` already have a record in this iteration."""

    carry: tuple[InputEntry, ...]
    recorded: frozenset[str]


PlaceDecision = ReplayPlaced | PlaceNew | Mismatch


def decide_place(
    records: Sequence[AnyEntry], *, attempt: int, position: int, mode: int
) -> PlaceDecision:
    """A place-inputs call at ``position`` of ``attempt``."""
    here = [
        r
        for r in records
        if isinstance(r, InputEntry) and (r.attempt, r.position) == (attempt, position)
    ]
    if here:
        return ReplayPlaced(inputs=tuple(here))
    at = _at(records, attempt, position)
    if at is not None:
        return Mismatch(reason=f"position {position} recorded another call, not place_inputs")
    mine = {r.request_id for r in records if isinstance(r, InputEntry) and r.attempt == attempt}
    carry: dict[str, InputEntry] = {}
    for r in records:
        if (
            isinstance(r, InputEntry)
            and r.attempt < attempt
            and r.mode == mode
            and r.request_id not in mine
        ):
            carry.setdefault(r.request_id, r)
    recorded = frozenset(r.request_id for r in records if isinstance(r, InputEntry))
    return PlaceNew(carry=tuple(carry.values()), recorded=recorded)


def placed_by_earlier_try(records: Sequence[AnyEntry], *, position: int) -> bool:
    """Whether ``records`` -- a writer's own records after the token a
    place-inputs call at ``position`` came with, one entry each (its kind's)
    -- are what an earlier try of that very call wrote: input placements at
    ``position`` and nothing else. Any other record (the writer's commit, a
    later call's) says the writer went on past the call, answered by another
    try: this one is a late copy, its token behind, and it may write nothing
    (placed after the commit, an input would be in an ended iteration)."""
    return all(isinstance(r, InputEntry) and r.position == position for r in records)


# ---- tool calls ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class UseResult:
    result: ResultEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class RunAgain:
    """Both declarations are safe: run the tool again under the same intent."""

    intent: IntentEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupt:
    """Record an interrupted result for ``intent`` and hand it to the model."""

    intent: IntentEntry
    partial: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Honour:
    """Record an intent at the position that honours ``earlier``, answered by
    a copy of ``result``; do not start the tool."""

    earlier: IntentEntry
    result: ResultEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class RunNew:
    """Record an intent, then run the tool."""


ToolDecision = UseResult | RunAgain | Interrupt | Honour | RunNew | Mismatch


def decide_tool(
    records: Sequence[AnyEntry],
    *,
    attempt: int,
    position: int,
    call: ToolCall,
    honoured: Collection[int] = (),
    honoured_members: Collection[tuple[int, int]] = (),
) -> ToolDecision:
    """A tool call at ``position`` of ``attempt``; ``honoured`` lists earlier
    intents this writer honoured already (they are not in ``records``), and
    ``honoured_members`` those of parallel groups (``IntentEntry.ref``)."""
    at = _at(records, attempt, position, call)
    if isinstance(at, ModelEntry):
        return Mismatch(reason=f"position {position} recorded a model call, not tool {call.name!r}")
    if isinstance(at, IntentEntry) and at.in_group:
        return Mismatch(
            reason=(
                f"position {position} recorded a parallel group of {at.group_size} calls; "
                f"the handler now calls {call.name!r} alone"
            )
        )
    if isinstance(at, IntentEntry):
        if _decides_the_ask(records, at, call):
            return RunNew()  # the approved (or denied) call, at the position that asked
        if not call.same_as(at):
            return Mismatch(
                reason=(
                    f"position {position} recorded tool {at.name!r} with other input; "
                    f"the handler now calls {call.name!r}"
                )
            )
        return _recorded(records, at, call)
    earlier = _honourable(records, attempt, call, _refs(honoured, honoured_members))
    if earlier is not None:
        result = _result_of(records, earlier.ref)
        assert result is not None, "a claim answers every earlier-attempt intent"
        return Honour(earlier=earlier, result=result)
    return RunNew()


def _at(
    records: Sequence[AnyEntry], attempt: int, position: int, call: ToolCall | None = None
) -> AnyEntry | None:
    """The call recorded at ``position``: the intent that records ``call``
    when one does (a position that asked for approval holds the decided call
    after the ask), else the first."""
    found = [
        r
        for r in records
        if isinstance(r, ModelEntry | IntentEntry)
        and (r.attempt, r.position) == (attempt, position)
    ]
    same = [r for r in found if isinstance(r, IntentEntry) and call is not None and call.same_as(r)]
    return (same or found or [None])[0]


def _decides_the_ask(records: Sequence[AnyEntry], at: IntentEntry, call: ToolCall) -> bool:
    """Whether ``call`` is the decision on the ask recorded at its position:
    the same tool, input and digest, now under an approval, and no decision
    recorded there yet (one position is decided once). A redelivery that placed
    the approval the delivery before it had not yet gets it there."""
    decided = any(
        isinstance(r, IntentEntry)
        and r.approval is not None
        and (r.attempt, r.position) == (at.attempt, at.position)
        for r in records
    )
    return (
        at.asks_approval
        and not decided
        and bool(call.approval_id)
        and (at.name, at.input, at.digest) == (call.name, call.input, call.digest)
    )


def _refs(honoured: Collection[int], members: Collection[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(seq, 0) for seq in honoured} | set(members)


def _recorded(records: Sequence[AnyEntry], at: IntentEntry, call: ToolCall) -> ToolDecision:
    """A call whose intent ``at`` (the same call) is recorded at its position:
    its result, else run again if both declarations are safe, else interrupted."""
    result = _result_of(records, at.ref)
    if result is not None:
        return UseResult(result=result)
    if at.safe and call.safe:
        return RunAgain(intent=at)
    return Interrupt(intent=at, partial=partial_output(records, at.seq, at.index))


def _result_of(records: Sequence[AnyEntry], ref: tuple[int, int]) -> ResultEntry | None:
    for r in records:
        if isinstance(r, ResultEntry) and r.intent_ref == ref:
            return r
    return None


def _honourable(
    records: Sequence[AnyEntry],
    attempt: int,
    call: ToolCall,
    honoured: Collection[tuple[int, int]],
) -> IntentEntry | None:
    used = {
        (r.honours_seq, r.honours_index)
        for r in records
        if isinstance(r, IntentEntry) and r.attempt == attempt
    }
    used.update(honoured)
    for r in records:
        if (
            isinstance(r, IntentEntry)
            and r.attempt < attempt
            and not r.safe
            and r.honours_seq == 0
            and call.same_as(r)
            and r.ref not in used
        ):
            return r
    return None


# ---- parallel groups ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """What each call of a parallel group does, in the response's order: one
    call's decision each, as if it were made alone at its position."""

    calls: tuple[UseResult | RunAgain | Interrupt | Honour | RunNew, ...]


GroupDecision = Group | Mismatch


def decide_tools(
    records: Sequence[AnyEntry],
    *,
    attempt: int,
    position: int,
    calls: Sequence[ToolCall],
    honoured: Collection[int] = (),
    honoured_members: Collection[tuple[int, int]] = (),
) -> GroupDecision:
    """A parallel group of ``calls`` at positions ``position``, ``position + 1``,
    ... (the model response's order) of ``attempt``.

    Each call follows the rules of one call alone: a recorded result is reused,
    a recorded intent without one runs again only if both declarations are
    safe (else ``Interrupt``), a new call honours an earlier attempt's unsafe
    intent of the same name and input (each at most once), else ``RunNew``.
    A call's approval is part of the call, and a call under an approval at
    the position of the group where it asked for one is its decision
    (``RunNew``), as for a call alone.
    The group as a whole must be the one recorded there: a model call, a call
    made alone, or a group of another size or start at any of its positions,
    or a call of another name or input, is ``Mismatch``, and nothing is
    written. Positions without an intent are new calls: a group's intents may
    take several records, and a crash may fall between them.
    """
    if not calls:
        return Mismatch(reason="a parallel group needs at least one call")
    decided: list[UseResult | RunAgain | Interrupt | Honour | RunNew] = []
    used = _refs(honoured, honoured_members)
    for i, call in enumerate(calls):
        here = position + i
        at = _at(records, attempt, here, call)
        if at is None:
            earlier = _honourable(records, attempt, call, used)
            if earlier is None:
                decided.append(RunNew())
                continue
            result = _result_of(records, earlier.ref)
            assert result is not None, "a claim answers every earlier-attempt intent"
            used.add(earlier.ref)
            decided.append(Honour(earlier=earlier, result=result))
            continue
        if (mismatch := _group_mismatch(at, here, position, calls)) is not None:
            return mismatch
        assert isinstance(at, IntentEntry)
        if _decides_the_ask(records, at, call):
            decided.append(RunNew())  # the approved (or denied) call, where it asked
            continue
        if not call.same_as(at):
            return Mismatch(
                reason=(
                    f"position {here} recorded tool {at.name!r} under another approval; "
                    f"the handler now calls {call.name!r}"
                )
            )
        decision = _recorded(records, at, call)
        assert not isinstance(decision, Mismatch | Honour | RunNew)
        decided.append(decision)
    return Group(calls=tuple(decided))


def _group_mismatch(
    at: AnyEntry, here: int, position: int, calls: Sequence[ToolCall]
) -> Mismatch | None:
    """Why the entry recorded at ``here`` is not this group's call there."""
    call = calls[here - position]
    if not isinstance(at, IntentEntry):
        return Mismatch(reason=f"position {here} recorded a model call, not tool {call.name!r}")
    if not at.in_group:
        return Mismatch(
            reason=f"position {here} recorded tool {at.name!r} called alone, not a parallel group"
        )
    if (at.group_position, at.group_size) != (position, len(calls)):
        return Mismatch(
            reason=(
                f"position {here} recorded a parallel group of {at.group_size} calls from "
                f"position {at.group_position}; the handler now makes {len(calls)} from {position}"
            )
        )
    if (at.name, at.input) != (call.name, call.input):
        return Mismatch(
            reason=(
                f"position {here} recorded tool {at.name!r} with other input; "
                f"the handler now calls {call.name!r}"
            )
        )
    return None


# ---- cancellation -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FencedWrite:
    """No cancel: the writer was fenced by a successor (or its own write)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreAfterCancel:
    """Store the write's tool result after ``after`` (the tail), ahead of a
    copy of the cancel; then refuse the rest of the write, if it has more."""

    after: int
    cancel: CancelEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredAfterCancel:
    """The write's tool result is stored after the cancel already, at ``seq``."""

    seq: int


RefusedWrite = Cancelled | FencedWrite | StoreAfterCancel | StoredAfterCancel


def cancel_of(tail: Sequence[AnyEntry]) -> Cancelled | None:
    """``Cancelled`` when the step's tail record (its entries, in order) is a
    cancel; None otherwise."""
    if tail and isinstance(last := tail[-1], CancelEntry):
        return Cancelled(reason=last.reason)
    return None


def fenced_out_write(
    *,
    tail: Sequence[AnyEntry],
    first: AnyEntry | None,
    writer: str,
    result_for: int,
    result_index: int = 0,
) -> RefusedWrite:
    """What a write the fence refused must do.

    Args:
        tail: The entries of the step's tail record.
        first: The first record after the writer's last seen sequence (its
            kind's entry); None when there is none.
        writer: The writer's nonce.
        result_for: The intent a tool result the write carries answers; 0
            when it carries none. The service checked that the writer saw it.
        result_index: The index of that intent in its record (a parallel
            group's); 0 otherwise.
    """
    cancelled = cancel_of(tail)
    if cancelled is None:
        return FencedWrite()
    if not result_for or not (isinstance(first, CancelEntry) and first.by_engine):
        return cancelled  # no result, or a successor wrote before the cancel
    for entry in tail:
        if isinstance(entry, ResultEntry) and entry.intent_ref == (result_for, result_index):
            if entry.writer != writer:
                return cancelled
            return StoredAfterCancel(seq=entry.seq)
    cancel = tail[-1]
    assert isinstance(cancel, CancelEntry)
    return StoreAfterCancel(after=cancel.seq, cancel=cancel)


FenceReason = Literal["own", "stale", "committed", "fenced"]


def fence_reason(record: AnyEntry, *, writer: str, dispatch: tuple[int, int]) -> FenceReason:
    """What one record after a writer's last seen sequence says about it."""
    if record.writer == writer:
        return "own"
    if record.dispatch > dispatch:
        return "stale"
    if (
        isinstance(record, CommitEntry)
        and record.iteration == dispatch[0]
        and (record.attempt == dispatch[1] or record.ends_iteration)
    ):
        return "committed"
    return "fenced"


def why_fenced(
    records: Iterable[AnyEntry], *, writer: str, dispatch: tuple[int, int]
) -> FenceReason:
    """Why ``writer`` of ``dispatch`` was refused, given the records after its
    last seen sequence: the first ``stale`` or ``committed`` decides, else any
    other writer's record makes it ``fenced``, else it is ``own``."""
    seen: FenceReason = "own"
    for record in records:
        reason = fence_reason(record, writer=writer, dispatch=dispatch)
        if reason in ("stale", "committed"):
            return reason
        if reason == "fenced":
            seen = reason
    return seen


# ---- approvals ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AskedCall:
    """A tool call that asked for approval (an intent with a digest and no
    approval): its key, as an approver names it, and what it would run.
    ``decided``: the intent that ran (or was denied) under an approval given
    for its digest after it asked, if one did."""

    key: str
    intent: IntentEntry
    decided: IntentEntry | None = None


def call_key(run_id: str, step_id: str, intent: IntentEntry) -> str:
    """The idempotency key of the call ``intent`` records."""
    return f"{run_id}.{step_id}.{intent.iteration}.{intent.position}"


def asked_calls(run_id: str, step_id: str, records: Sequence[AnyEntry]) -> list[AskedCall]:
    """Every call of the step that asked for approval, in order, each with the
    decision that followed it: the first intent after it carrying an approval
    of its digest (the approver may have named this key, or a later ask of the
    same call after a retry; the digest binds them all)."""
    asked: list[AskedCall] = []
    for r in records:
        if isinstance(r, IntentEntry) and r.asks_approval and not r.honours_seq:
            decided = next(
                (
                    d
                    for d in records
                    if isinstance(d, IntentEntry)
                    and d.seq > r.seq
                    and d.approval is not None
                    and d.approval.digest == r.digest
                ),
                None,
            )
            asked.append(AskedCall(key=call_key(run_id, step_id, r), intent=r, decided=decided))
    return asked


def waiting_calls(run_id: str, step_id: str, records: Sequence[AnyEntry]) -> list[AskedCall]:
    """The calls that wait for approval now: asked and not decided, the newest
    ask of each digest only (a call asked again by a later iteration waits
    under its newest key; an approval of an older one still applies)."""
    newest: dict[str, AskedCall] = {}
    for call in asked_calls(run_id, step_id, records):
        if call.decided is None:
            newest[call.intent.digest] = call
    return sorted(newest.values(), key=lambda c: c.intent.seq)
