"""The journal audit: every invariant a sound journal keeps, checked in one place.

Pure functions over the records of one step (:mod:`dagnats.journal.model`
values); no I/O. The journal service reads the records and the engine's
iteration counts and serves the findings (``JournalService.Check``, which
``dagnats journal check`` prints).

Invariants, named by the rule a violation reports:

* ``chain``: each record's ``expected_seq`` is the ``seq`` of the record before
  it on the subject (0 for the first). Every append carries
  Nats-Expected-Last-Subject-Sequence, so a record can only follow the tail
  its writer saw. A record that holds two entries (a model response or a
  tool result ahead of an intent or a commit) is one link of the chain; every
  other rule reads its entries as records of their own, in their order.
* A cancel record is the engine's, appended whatever the tail when the run
  ended: it is no link of the chain (the record after it expects it), no
  record of a dispatch, and fences nothing by itself; what follows it is the
  holder's copy of it carrying a tool result (``journal.replay``). A step
  whose journal holds nothing else never journaled, and is not checked.
* ``after_fence``: a claim fences every writer that claimed before it, and no
  record by a fenced writer comes after that claim. A record whose writer
  never claimed is fenced by any claim before it.
* ``commit_count``: a dispatch ``(iteration, attempt)`` commits at most once;
  an iteration has at most one commit that ends it (continue, complete,
  fail_permanent); and no record of an iteration comes after its ending
  commit, nor a record of a dispatch after that dispatch's own commit (a
  retriable failure or a pause ends only its attempt; the retry is a new one).
* ``unanswered_intent``: every tool intent has a result. The journal of a
  running step is exempt where a result may still come: the intents of the
  open dispatch (the last claim's, while no commit ends it), whose tools may
  be running, and the intents of earlier attempts of its iteration while that
  dispatch is still closing them (it has written only claims and results).
* ``double_result``: no tool intent has more than one result.
* ``orphan_result``: every tool result answers (``intent_seq``, and
  ``intent_index`` in a parallel group's record) a tool intent.
* ``group_order``: a parallel group's intents are all stored before any of
  its calls starts: every output and result of a call of the group comes
  after the last intent record of the group (of its dispatch), and the group
  holds one intent per position, within its ``group_size`` positions.
* ``unsafe_started_twice``: an unsafe call starts at most once: no writer but
  the intent's writes output for it, or answers it with anything but
  ``interrupted`` (an honoured intent is a new intent, answered by its own writer).
* ``input_placed_twice``: no input is placed twice (copies carried into a
  retry attempt excepted).
* ``approval``: every call that ran under an approval ran with the approved
  arguments: its digest is the digest of its name and input; the approval
  names the digest of a call that asked for approval before it (the one the
  approver saw), and that digest is the intent's own unless the approver
  edited the arguments. A call that asked for approval never ran: its results
  are ``awaiting_approval`` (or ``interrupted``, a crash before that was
  stored), and an ``awaiting_approval`` result answers only such a call.
* ``iteration_count``: the engine's iteration count of the step equals the
  number of continue commits. When the step is still running or was
  cancelled, the newest commit may be a continue whose event the engine has
  not applied (yet, or ever: a cancel drops it), so one fewer is sound then.
  A running loop moves on while it is audited: the run is read before the
  journal and again after it, and the journal's count must lie between the
  two (it holds at least every continue counted before, and at most those
  counted after, and the one in flight).
* ``outcome``: the engine's step agrees with the last commit, the state of
  record. A completed step completed with the last commit that ends an
  iteration: a ``complete`` of the step's iteration, with the step's output.
  A running or waiting step at iteration ``n > 0`` got there through the
  continue commit of iteration ``n - 1``, and shows its output. A failed or
  cancelled step is not compared: the engine also ends steps on its own
  (timeouts, loop bounds, a cancel).
* ``state_chain``: a commit that stores its state as a delta (the state
  chain) applies to the state of its base commit (the commit that ended the
  iteration before it): that commit carries a state, the delta keeps no more
  of it than it holds, makes the size it says, and stands one further from
  the snapshot; and the state the last commit makes is JSON. A base before
  the first record the step still holds (retention) is not checked.

* ``fork_prefix``: a forked run's journal starts with copies of its source's
  records, ended by the fork's record (``ForkEntry``), which counts them and
  names their digest. The records before it are as many as it says, their
  digest is the one it names, and while the source run exists, the source's
  records through the fork's ``at_seq`` have that digest too (the edge
  computes both digests, ``journal.fork.prefix_digest``): a copy altered
  after the fork, or a fork record altered to match it, is found. A fork's
  record is no writer's: it fences nothing. In a fork of a fork the last
  fork record is the journal's own; the ones before it are copies.

Findings come in sequence order; findings that name no record (seq 0) last.
A broken record is reported once per invariant it breaks: a duplicate commit
is a ``commit_count`` finding once, not again as a record after a commit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, assert_never

from dagnats.core.approvals import call_digest
from dagnats.core.errors import InvalidArgument
from dagnats.core.statechain import ChainBroken, Rebuilt, StoredDelta, rebuild
from dagnats.journal.model import (
    Action,
    AnyEntry,
    CancelEntry,
    ClaimEntry,
    CommitEntry,
    ForkEntry,
    InputEntry,
    IntentEntry,
    ModelEntry,
    OutputEntry,
    ResultEntry,
)

Rule = Literal[
    "chain",
    "after_fence",
    "commit_count",
    "unanswered_intent",
    "double_result",
    "orphan_result",
    "group_order",
    "unsafe_started_twice",
    "input_placed_twice",
    "approval",
    "iteration_count",
    "outcome",
    "state_chain",
    "fork_prefix",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One broken invariant.

    Attributes:
        step_id: The step whose journal breaks it.
        seq: Sequence of the record at fault; 0 when no one record is.
        rule: Which invariant (see the module docstring).
        message: What is wrong, for a person.
    """

    step_id: str
    seq: int
    rule: Rule
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStep:
    """The engine's view of a step, for the ``outcome`` rule.

    Attributes:
        status: ``pending``, ``running``, ``waiting``, ``completed``, ``failed``
            or ``cancelled``.
        iteration: The step's current (or last) iteration.
        output: The step's output as the engine shows it.
    """

    status: str
    iteration: int
    output: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ForkDigests:
    """The digests the ``fork_prefix`` rule compares with a fork's record.

    Attributes:
        copied: Of the records before the fork's record, as this journal holds them.
        source: Of the source's records through the fork's ``at_seq``; None
            when the source run is gone (purged).
    """

    copied: str
    source: str | None


# A finding before it is tied to its step.
_Found = tuple[int, Rule, str]


def check_step(
    step_id: str,
    entries: Sequence[AnyEntry],
    *,
    engine_iterations: int | None = None,
    engine_iterations_after: int | None = None,
    settling: bool = False,
    engine_step: EngineStep | None = None,
    fork: ForkDigests | None = None,
) -> list[Finding]:
    """Audit the journal of one step.

    Args:
        step_id: The step, for the findings.
        entries: Every record on the step's subject (sorted by ``seq`` here).
        engine_iterations: The engine's iteration count of the step (continues
            it accepted), read before the journal; ``None`` skips the
            ``iteration_count`` rule.
        engine_iterations_after: The same count read after the journal (a
            running loop may have moved on); ``None``: ``engine_iterations``.
        settling: The step is running or was cancelled, so the engine may not
            have applied its newest continue commit.
        engine_step: The engine's status, iteration and output of the step;
            ``None`` skips the ``outcome`` rule.
        fork: The digests of a forked step's copied prefix (``fork_prefix``).

    Returns:
        The findings, in sequence order; empty when the journal is sound.
    """
    if all(isinstance(r, CancelEntry) and r.by_engine for r in entries):
        return []  # only the run's end: the step never journaled
    # On seq, and within a record as stored: a handed-over claim, the other
    # leading entry, then its kind's.
    records = sorted(entries, key=lambda r: (r.seq, not r.leading, not isinstance(r, ClaimEntry)))
    found = [
        *_chain(records),
        *_fencing(records),
        *_commits(records),
        *_answers(records),
        *_groups(records),
        *_unsafe_starts(records),
        *_placements(records),
        *_state_chain(records),
        *_approvals(records),
    ]
    if engine_iterations is not None:
        after = engine_iterations if engine_iterations_after is None else engine_iterations_after
        found.extend(_iteration_count(records, engine_iterations, after, settling=settling))
    if engine_step is not None:
        found.extend(_outcome(records, engine_step))
    found.extend(_fork_prefix(records, fork))
    found.sort(key=lambda f: (f[0] == 0, f[0]))
    return [Finding(step_id=step_id, seq=seq, rule=rule, message=msg) for seq, rule, msg in found]


def check_run(
    steps: Mapping[str, Sequence[AnyEntry]],
    engine_iterations: Mapping[str, int],
    settling: Collection[str] = (),
    engine_steps: Mapping[str, EngineStep] | None = None,
    iterations_after: Mapping[str, int] | None = None,
    forks: Mapping[str, ForkDigests] | None = None,
) -> list[Finding]:
    """Audit the journals of a run, step by step (in step id order).

    Args:
        steps: The records of each step that has a journal.
        engine_iterations: The engine's iteration count of each step. A step
            missing here skips ``iteration_count``; a step missing from
            ``steps`` is not checked (it did not opt into a journal).
        settling: Steps that are running or were cancelled (see ``check_step``).
        engine_steps: The engine's view of each step (see ``check_step``); a
            step missing here skips ``outcome``.
        iterations_after: The iteration counts read again after the journals
            (see ``check_step``); a step missing here: its count before.
        forks: The digests of each forked step's prefix (see ``check_step``).

    Returns:
        Every step's findings.
    """
    engine_steps = engine_steps or {}
    return [
        finding
        for step_id in sorted(steps)
        for finding in check_step(
            step_id,
            steps[step_id],
            engine_iterations=engine_iterations.get(step_id),
            engine_iterations_after=(iterations_after or {}).get(step_id),
            settling=step_id in settling,
            engine_step=engine_steps.get(step_id),
            fork=(forks or {}).get(step_id),
        )
    ]


# ---- chain -------------------------------------------------------------------------


def _chain(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    previous = 0
    for r in records:
        if r.leading:
            continue  # its record's link is checked once, on the entry after it
        if isinstance(r, CancelEntry) and r.by_engine:
            previous = r.seq  # appended whatever the tail
            continue
        if r.expected_seq != previous:
            if previous == 0:
                why = f"is the first record but expected the tail at seq {r.expected_seq}"
            elif r.expected_seq == 0:
                why = f"expected an empty subject, but seq {previous} comes before it"
            else:
                why = (
                    f"expected the tail at seq {r.expected_seq}, "
                    f"but the record before it is seq {previous}"
                )
            yield r.seq, "chain", f"seq {r.seq} ({_kind(r)}) {why}"
        previous = r.seq


# ---- the state chain -----------------------------------------------------------------


def _state_chain(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    commits = {r.seq: r for r in records if isinstance(r, CommitEntry)}
    chains: dict[int, tuple[int, int]] = {}  # a commit's seq -> its state's size, depth
    first = records[0].seq if records else 0
    last: CommitEntry | None = None
    for c in commits.values():
        if not c.has_state:
            continue
        if c.ends_iteration:
            last = c
        if c.state_delta is None:
            chains[c.seq] = (len(c.state), 0)
            continue
        found = _applies(c, commits.get(c.base_seq), chains, first)
        if found is not None:
            yield c.seq, "state_chain", f"the commit at seq {c.seq} {found}"
        chains[c.seq] = (c.state_delta.size, c.state_delta.depth)
    if last is not None and last.state_delta is not None and _whole_chain(last, commits):
        state = _state(last, commits)
        if state is not None and not _is_json(state):
            yield last.seq, "state_chain", f"the state at seq {last.seq} is not JSON"


def _applies(
    c: CommitEntry,
    base: CommitEntry | None,
    chains: Mapping[int, tuple[int, int]],
    first: int,
) -> str | None:
    """Why ``c``'s delta does not apply to its base commit's state; None when it does."""
    assert c.state_delta is not None
    if base is None and c.base_seq < first:
        return None  # the base went with the records retention removed
    if base is None or not base.has_state or base.seq not in chains:
        return f"stores a delta on seq {c.base_seq}, which holds no state"
    size, depth = chains[base.seq]
    d = c.state_delta
    if d.delta.keep > size:
        return f"keeps {d.delta.keep:,} bytes of the {size:,} of the state at seq {base.seq}"
    if d.delta.size != d.size:
        return f"makes {d.delta.size:,} bytes of state, but says {d.size:,}"
    if d.depth != depth + 1:
        return f"says it is delta {d.depth} after its snapshot, but it is delta {depth + 1}"
    return None


def _whole_chain(c: CommitEntry, commits: Mapping[int, CommitEntry]) -> bool:
    """Whether every commit of ``c``'s chain back to its snapshot is held."""
    while c.state_delta is not None:
        base = commits.get(c.base_seq)
        if base is None or not base.has_state:
            return False
        c = base
    return True


def _state(c: CommitEntry, commits: Mapping[int, CommitEntry]) -> bytes | None:
    """The state ``c`` makes, rebuilt from its snapshot; None when its chain
    does not apply (reported on the delta that breaks it)."""
    deltas: list[StoredDelta] = []
    while c.state_delta is not None:
        deltas.append(c.state_delta)
        c = commits[c.base_seq]
    result = rebuild(c.state, deltas[::-1])
    match result:
        case Rebuilt(state=state):
            return state
        case ChainBroken():
            return None
        case _:
            assert_never(result)


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


# ---- a fork's prefix ------------------------------------------------------------------


def _fork_prefix(records: Sequence[AnyEntry], digests: ForkDigests | None) -> Iterator[_Found]:
    forks = [r for r in records if isinstance(r, ForkEntry)]
    if not forks:
        return
    # The last is this journal's own; any before it were copied with the
    # prefix (a fork of a fork), and the digest covers them.
    fork = forks[-1]
    before = len({r.seq for r in records if r.seq < fork.seq})
    if before != fork.copied:
        yield (
            fork.seq,
            "fork_prefix",
            f"the fork at seq {fork.seq} copied {_plural(fork.copied, 'record')}, "
            f"but {_plural(before, 'record')} come before it",
        )
    if digests is None:
        return
    if digests.copied != fork.digest:
        yield (
            fork.seq,
            "fork_prefix",
            f"the records before the fork at seq {fork.seq} are not the ones it copied "
            f"(their digest is {digests.copied}, the fork recorded {fork.digest})",
        )
    if digests.source is not None and digests.source != fork.digest:
        yield (
            fork.seq,
            "fork_prefix",
            f"run {fork.source_run}'s records of step {fork.source_step} through seq "
            f"{fork.at_seq} are not the ones the fork at seq {fork.seq} copied",
        )


# ---- fencing -----------------------------------------------------------------------


def _fencing(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    claimed: set[str] = set()
    fenced_by: dict[str, ClaimEntry] = {}
    last_claim: ClaimEntry | None = None
    for r in records:
        if (isinstance(r, CancelEntry) and r.by_engine) or isinstance(r, ForkEntry):
            continue
        if r.writer in fenced_by:
            fence = fenced_by[r.writer]
            yield (
                r.seq,
                "after_fence",
                f"seq {r.seq} ({_kind(r)}) was written by writer {r.writer} after the "
                f"claim at seq {fence.seq} (writer {fence.writer}) fenced it",
            )
        elif last_claim is not None and r.writer not in claimed and not isinstance(r, ClaimEntry):
            yield (
                r.seq,
                "after_fence",
                f"seq {r.seq} ({_kind(r)}) was written by writer {r.writer}, which never "
                f"claimed the step; the claim at seq {last_claim.seq} holds it",
            )
        if isinstance(r, ClaimEntry):
            for writer in claimed - {r.writer}:
                fenced_by.setdefault(writer, r)
            claimed.add(r.writer)
            last_claim = r


# ---- commits -----------------------------------------------------------------------


def _commits(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    commits = [r for r in records if isinstance(r, CommitEntry)]
    reported: set[int] = set()
    for (iteration, attempt), group in _group(commits, lambda c: c.dispatch).items():
        # Duplicates that all end the iteration are reported once, below.
        if len(group) > 1 and not all(c.ends_iteration for c in group):
            reported.update(c.seq for c in group[1:])
            yield (
                group[1].seq,
                "commit_count",
                f"iteration {iteration} attempt {attempt} has {len(group)} commits "
                f"({_seqs(group)})",
            )
    ending = [c for c in commits if c.ends_iteration]
    for iteration, group in _group(ending, lambda c: c.iteration).items():
        if len(group) > 1:
            reported.update(c.seq for c in group[1:])
            yield (
                group[1].seq,
                "commit_count",
                f"iteration {iteration} has {len(group)} commits that end it ({_seqs(group)})",
            )
    for r in records:
        if isinstance(r, CancelEntry):
            continue  # the run's end, no record of a dispatch
        closing = _closing_commit(commits, r)
        if closing is not None and r.seq not in reported:
            yield r.seq, "commit_count", _after_commit_message(r, closing)


def _closing_commit(commits: Sequence[CommitEntry], record: AnyEntry) -> CommitEntry | None:
    """The first commit before ``record`` that ended its iteration or its attempt."""
    for c in commits:
        if c.seq >= record.seq:
            return None
        if c.iteration == record.iteration and (c.ends_iteration or c.attempt == record.attempt):
            return c
    return None


def _after_commit_message(record: AnyEntry, commit: CommitEntry) -> str:
    late = f"seq {record.seq} ({_kind(record)})"
    if commit.ends_iteration:
        return (
            f"iteration {commit.iteration} ended with the commit at seq {commit.seq} "
            f"({commit.action.value}), but {late} of that iteration comes after it"
        )
    return (
        f"iteration {commit.iteration} attempt {commit.attempt} ended with the commit at "
        f"seq {commit.seq} ({commit.action.value}), but {late} of that attempt comes after it"
    )


# ---- tool intents and results --------------------------------------------------------


def _answers(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    by_seq = {r.seq: r for r in records if not r.leading}  # what a record is, by its kind
    intents = {r.ref: r for r in records if isinstance(r, IntentEntry)}
    results = _group([r for r in records if isinstance(r, ResultEntry)], lambda r: r.intent_ref)
    pending = _may_still_be_answered(records)
    for r in records:
        if isinstance(r, ResultEntry):
            if r.intent_ref not in intents:
                target = by_seq.get(r.intent_seq)
                if target is None:
                    what = "not in the journal"
                elif isinstance(target, IntentEntry):
                    what = f"a parallel group's record with no intent at index {r.intent_index}"
                else:
                    what = f"a {_kind(target)}"
                yield (
                    r.seq,
                    "orphan_result",
                    f"tool result at seq {r.seq} answers seq {r.intent_seq}, which is {what}, "
                    "not a tool intent",
                )
        elif isinstance(r, IntentEntry):
            answers = results.get(r.ref, [])
            if not answers and r.ref not in pending:
                yield (
                    r.seq,
                    "unanswered_intent",
                    f"tool intent {r.name!r} at seq {r.seq} (iteration {r.iteration} "
                    f"attempt {r.attempt}) has no result",
                )
            if len(answers) > 1:
                yield (
                    answers[1].seq,
                    "double_result",
                    f"tool intent {r.name!r} at seq {r.seq} has {len(answers)} results "
                    f"({_seqs(answers)})",
                )


def _may_still_be_answered(records: Sequence[AnyEntry]) -> set[tuple[int, int]]:
    """The intents (``IntentEntry.ref``) a running step may still answer (see
    the docstring)."""
    claims = [r for r in records if isinstance(r, ClaimEntry)]
    if not claims:
        return set()
    iteration, attempt = claims[-1].dispatch
    if any(
        isinstance(r, CommitEntry)
        and r.iteration == iteration
        and (r.ends_iteration or r.attempt == attempt)
        for r in records
    ):
        return set()
    first = next(c.seq for c in claims if c.dispatch == (iteration, attempt))
    # A new attempt's claim answers earlier attempts' intents right after it is
    # stored; a holder that crashed in between leaves them to the next claim.
    closing = all(isinstance(r, ClaimEntry | ResultEntry) for r in records if r.seq > first)
    return {
        r.ref
        for r in records
        if isinstance(r, IntentEntry)
        and r.iteration == iteration
        and (r.attempt == attempt or (closing and r.attempt < attempt))
    }


def _groups(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    """``group_order``: a parallel group's intents before any of its calls ran."""
    members = [r for r in records if isinstance(r, IntentEntry) and r.in_group]
    groups = _group(members, lambda r: (r.iteration, r.attempt, r.group_position))
    for (iteration, attempt, start), intents in groups.items():
        last = max(r.seq for r in intents)
        refs = {r.ref for r in intents}
        size = intents[0].group_size
        positions = _group(intents, lambda r: r.position)
        for position, at in positions.items():
            if not start <= position < start + size:
                yield (
                    at[0].seq,
                    "group_order",
                    f"tool intent {at[0].name!r} at seq {at[0].seq} is at position {position}, "
                    f"outside its parallel group's {start}..{start + size - 1}",
                )
            elif len(at) > 1:
                yield (
                    at[1].seq,
                    "group_order",
                    f"position {position} of the parallel group of iteration {iteration} "
                    f"attempt {attempt} has {len(at)} intents ({_seqs(at)})",
                )
        for r in records:
            if isinstance(r, OutputEntry | ResultEntry) and r.intent_ref in refs and r.seq < last:
                yield (
                    r.seq,
                    "group_order",
                    f"{_kind(r)} at seq {r.seq} answers a call of the parallel group at "
                    f"position {start} before the group's last intent (seq {last}) was stored",
                )


def _unsafe_starts(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    """``unsafe_started_twice``: only an unsafe intent's own writer ran it."""
    unsafe = {r.ref: r for r in records if isinstance(r, IntentEntry) and not r.safe}
    for r in records:
        if not isinstance(r, OutputEntry | ResultEntry):
            continue
        intent = unsafe.get(r.intent_ref)
        if intent is None or r.writer == intent.writer:
            continue
        if isinstance(r, ResultEntry) and r.interrupted:
            continue
        yield (
            r.seq,
            "unsafe_started_twice",
            f"{_kind(r)} at seq {r.seq} by another writer than unsafe tool intent "
            f"{intent.name!r} at seq {intent.seq}'s: the call started again",
        )


# ---- the engine's count --------------------------------------------------------------


def _iteration_count(
    records: Sequence[AnyEntry], before: int, after: int, *, settling: bool
) -> Iterator[_Found]:
    commits = [r for r in records if isinstance(r, CommitEntry)]
    continues = [r for r in commits if r.action is Action.CONTINUE]
    unapplied = settling and bool(commits) and commits[-1].action is Action.CONTINUE
    if before <= len(continues) <= max(after, before) + unapplied:
        return
    engine = before if len(continues) < before else after
    where = f" ({_seqs(continues)})" if continues else ""
    yield (
        0,
        "iteration_count",
        f"the engine counts {_plural(engine, 'iteration')} of this step, but the journal "
        f"has {_plural(len(continues), 'continue commit')}{where}",
    )


def _outcome(records: Sequence[AnyEntry], step: EngineStep) -> Iterator[_Found]:
    commits = [r for r in records if isinstance(r, CommitEntry)]
    if step.status == "completed":
        ending = [c for c in commits if c.ends_iteration]
        last = ending[-1] if ending else None
        if last is None or last.action is not Action.COMPLETE:
            what = "no commit" if last is None else f"a {last.action.value} (seq {last.seq})"
            yield 0, "outcome", f"the engine completed the step, but its last commit is {what}"
        elif last.iteration != step.iteration:
            yield (
                last.seq,
                "outcome",
                f"the engine completed the step at iteration {step.iteration}, but the "
                f"complete commit at seq {last.seq} is of iteration {last.iteration}",
            )
        elif last.output != step.output:
            yield last.seq, "outcome", _output_message("complete", last, step)
    elif step.status in ("running", "waiting") and step.iteration > 0:
        previous = [
            c for c in commits if c.action is Action.CONTINUE and c.iteration == step.iteration - 1
        ]
        if not previous:
            yield (
                0,
                "outcome",
                f"the engine is at iteration {step.iteration}, but the journal has no "
                f"continue commit of iteration {step.iteration - 1}",
            )
        elif previous[-1].output != step.output:
            yield previous[-1].seq, "outcome", _output_message("continue", previous[-1], step)


def _output_message(action: str, commit: CommitEntry, step: EngineStep) -> str:
    return (
        f"the engine shows the step's output as {_bytes(step.output)}, but the {action} "
        f"commit at seq {commit.seq} records {_bytes(commit.output)}"
    )


def _bytes(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    return repr(text if len(text) <= 60 else text[:57] + "...")


# ---- wording -----------------------------------------------------------------------

K = TypeVar("K", bound=Hashable)
E = TypeVar("E", bound=AnyEntry)


def _group(items: Iterable[E], key: Callable[[E], K]) -> dict[K, list[E]]:
    groups: dict[K, list[E]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def _placements(records: Sequence[AnyEntry]) -> list[tuple[int, Rule, str]]:
    """Every input placed once: a request id has one original ``input.placed``
    record (carried copies into a retry attempt do not count)."""
    found: list[tuple[int, Rule, str]] = []
    first: dict[str, int] = {}
    for r in records:
        if not isinstance(r, InputEntry) or r.carried:
            continue
        if r.request_id in first:
            found.append(
                (
                    r.seq,
                    "input_placed_twice",
                    f"input {r.request_id!r} was placed at seq {first[r.request_id]} "
                    f"and again at seq {r.seq}",
                )
            )
        else:
            first[r.request_id] = r.seq
    return found


def _approvals(records: Sequence[AnyEntry]) -> Iterator[_Found]:
    asked: list[IntentEntry] = []
    intents = {r.ref: r for r in records if isinstance(r, IntentEntry)}
    for r in records:
        if isinstance(r, IntentEntry) and r.digest:
            yield from _approved_arguments(r, asked)
            if r.asks_approval:
                asked.append(r)
        elif isinstance(r, ResultEntry):
            intent = intents.get(r.intent_ref)  # a parallel group's by its index
            if intent is None:
                continue  # an orphan_result
            if intent.asks_approval and not (r.awaiting_approval or r.interrupted):
                yield (
                    r.seq,
                    "approval",
                    f"tool {intent.name!r} at seq {intent.seq} asked for approval, but the "
                    f"result at seq {r.seq} says it ran",
                )
            if r.awaiting_approval and not intent.asks_approval:
                yield (
                    r.seq,
                    "approval",
                    f"the result at seq {r.seq} awaits approval, but the intent at seq "
                    f"{intent.seq} did not ask for one",
                )


def _approved_arguments(intent: IntentEntry, asked: Sequence[IntentEntry]) -> Iterator[_Found]:
    """The finding on one intent with a digest, if any: it binds its
    arguments, and one under an approval ran with what the approver approved."""
    try:
        digest = call_digest(intent.name, intent.input)
    except InvalidArgument:
        digest = "(input is not JSON)"
    if digest != intent.digest:
        yield (
            intent.seq,
            "approval",
            f"tool intent {intent.name!r} at seq {intent.seq} has digest {intent.digest}, "
            f"but its name and input digest to {digest}",
        )
        return  # one finding per record and rule
    approval = intent.approval
    if approval is None:
        return
    if not any(a.digest == approval.digest for a in asked):
        yield (
            intent.seq,
            "approval",
            f"tool intent {intent.name!r} at seq {intent.seq} runs under an approval of "
            f"digest {approval.digest}, which no call asked for before it",
        )
    elif not approval.edited and approval.digest != intent.digest:
        yield (
            intent.seq,
            "approval",
            f"tool intent {intent.name!r} at seq {intent.seq} ran with digest {intent.digest}, "
            f"but the approval was given for {approval.digest}",
        )


def _kind(r: AnyEntry) -> str:
    match r:
        case ClaimEntry():
            return "claim"
        case ModelEntry():
            return "model response"
        case IntentEntry(name=name):
            return f"tool intent {name!r}"
        case OutputEntry():
            return "tool output"
        case ResultEntry():
            return "tool result"
        case CommitEntry(action=action):
            return f"commit {action.value}"
        case InputEntry(request_id=request_id):
            return f"input {request_id!r} placed"
        case CancelEntry():
            return "cancel"
        case ForkEntry(source_run=source):
            return f"fork of run {source}"
        case _:
            assert_never(r)


def _seqs(records: Sequence[AnyEntry]) -> str:
    """``seq 14 and 19``, ``seq 3, 8 and 12``."""
    numbers = [str(r.seq) for r in records]
    if len(numbers) == 1:
        return f"seq {numbers[0]}"
    return f"seq {', '.join(numbers[:-1])} and {numbers[-1]}"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
