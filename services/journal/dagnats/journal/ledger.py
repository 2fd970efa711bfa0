"""The usage ledger's rules: what each model call of a step spent, by what
became of it, and whether a run's budget lets the next call start.

Pure: data in, decisions out. The journal is the ledger: a model call's
usage is stored in its record (``ModelCall.usage``), and a call whose holder
the fence stopped has its usage stored on the step's spent subject
(``journal.<run>.<step>.spent``), since the fence refuses its record on the
step's own subject.

Every call is charged once, as one of a closed set of kinds (:class:`Spend`):

- ``KEPT``: its record is the journal's: a replay reuses the response.
- ``RETRIED``: its attempt ended in a retriable failure or a pause, or a later
  attempt of its iteration started: its record stays, and a retry calls
  again (positions are an attempt's own).
- ``FENCED``: its holder was fenced before the record was stored; the entry
  comes from the spent subject. The same call (writer, dispatch, position)
  found in the step's records, or twice on the spent subject, is charged
  once: a fenced call is never charged twice.
- ``COPIED``: its record is one a fork copied from its source run (the
  records before the journal's last fork record): the source spent it, so
  the forked run's replay reuses it and spends nothing.

A budget counts every kind but ``COPIED``: what this run spent, not only
what it kept.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import assert_never

from dagnats.core.errors import InvalidArgument
from dagnats.core.usage import Budget, Raise, Totals, Usage, parse_raise
from dagnats.journal.model import (
    AnyEntry,
    ClaimEntry,
    CommitEntry,
    ForkEntry,
    InputEntry,
    ModelEntry,
)

# InputPlaced.mode of an input that raises the run's budget (inputs.v1.MODE_BUDGET).
BUDGET_MODE = 100


class Spend(enum.Enum):
    """What became of a model call's usage."""

    KEPT = "kept"
    RETRIED = "retried"
    FENCED = "fenced"
    COPIED = "copied"


@dataclass(frozen=True, slots=True, kw_only=True)
class Charge:
    """One model call's usage, charged once."""

    spend: Spend
    usage: Usage
    iteration: int
    attempt: int
    position: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    """Totals by kind; ``spent`` is all of them but ``copied`` (the source
    run's)."""

    kept: Totals = field(default_factory=Totals)
    retried: Totals = field(default_factory=Totals)
    fenced: Totals = field(default_factory=Totals)
    copied: Totals = field(default_factory=Totals)

    @property
    def spent(self) -> Totals:
        return self.kept.plus(self.retried).plus(self.fenced)

    def add(self, charge: Charge) -> Split:
        match charge.spend:
            case Spend.KEPT:
                return replace(self, kept=self.kept.add(charge.usage))
            case Spend.RETRIED:
                return replace(self, retried=self.retried.add(charge.usage))
            case Spend.FENCED:
                return replace(self, fenced=self.fenced.add(charge.usage))
            case Spend.COPIED:
                return replace(self, copied=self.copied.add(charge.usage))
            case _:
                assert_never(charge.spend)

    def plus(self, other: Split) -> Split:
        return Split(
            kept=self.kept.plus(other.kept),
            retried=self.retried.plus(other.retried),
            fenced=self.fenced.plus(other.fenced),
            copied=self.copied.plus(other.copied),
        )


Call = tuple[str, int, int, int]  # writer, iteration, attempt, position


def charges(
    records: Sequence[AnyEntry],
    spent: Sequence[ModelEntry] = (),
    stored: Collection[Call] = (),
) -> list[Charge]:
    """Each model call of one step, charged once: ``records`` are the step's
    entries (its journal subject), ``spent`` the model entries of its spent
    subject; ``stored`` names calls of records charged already (a reader
    that folded an ended iteration's charges), which a spent entry does not
    charge again. A call whose usage was not reported is not charged."""
    retried = _retried_attempts(records)
    copied = _copied(records)
    found: list[Charge] = []
    seen: set[Call] = set(stored)
    for index, entry in enumerate(records):
        if not isinstance(entry, ModelEntry):
            continue
        seen.add(_call(entry))
        if entry.usage is None:
            continue
        if index < copied:
            kind = Spend.COPIED
        elif entry.dispatch in retried:
            kind = Spend.RETRIED
        else:
            kind = Spend.KEPT
        found.append(_charge(kind, entry, entry.usage))
    for entry in spent:
        if entry.usage is None or _call(entry) in seen:
            continue  # the same call stored, or reported twice: charged once
        seen.add(_call(entry))
        found.append(_charge(Spend.FENCED, entry, entry.usage))
    return found


def _copied(records: Sequence[AnyEntry]) -> int:
    """How many of ``records`` a fork copied: those before the journal's own
    fork record, its last (a fork of a fork copies its source's too)."""
    for index in range(len(records) - 1, -1, -1):
        if isinstance(records[index], ForkEntry):
            return index
    return 0


def split(found: Iterable[Charge]) -> Split:
    """The charges added up by kind."""
    total = Split()
    for charge in found:
        total = total.add(charge)
    return total


def by_model(found: Iterable[Charge]) -> dict[str, Totals]:
    """Every charge this run spent (not a fork's copied calls) added up per
    model."""
    totals: dict[str, Totals] = {}
    for charge in found:
        if charge.spend is Spend.COPIED:
            continue
        name = charge.usage.model
        totals[name] = totals.get(name, Totals()).add(charge.usage)
    return totals


def raises(records: Iterable[AnyEntry]) -> Raise:
    """What the budget inputs placed in these records add to the budget; a
    carried copy of an earlier attempt's placement is the same input, and an
    input that is not a raise adds nothing (the inputs service refuses one)."""
    total = Raise()
    seen: set[str] = set()
    for entry in records:
        if not isinstance(entry, InputEntry) or entry.mode != BUDGET_MODE:
            continue
        if entry.request_id in seen:
            continue
        seen.add(entry.request_id)
        try:
            total = total.plus(parse_raise(json.loads(entry.content or b"null")))
        except (InvalidArgument, ValueError):
            continue
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class WithinBudget:
    """The call may start."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OverBudget:
    """The run spent its budget: the call is refused."""

    spent: Totals
    budget: Budget
    reason: str


BudgetDecision = WithinBudget | OverBudget


def decide_budget(spent: Totals, budget: Budget) -> BudgetDecision:
    """Whether a model call may start after ``spent``: it may while the run
    spent less than the budget of each kind it bounds. The call that crosses
    the budget runs (its size is known only once it answered); the next one
    is refused."""
    if budget.tokens and spent.tokens >= budget.tokens:
        reason = f"the run spent {spent.tokens} tokens of a budget of {budget.tokens}"
        return OverBudget(spent=spent, budget=budget, reason=reason)
    if budget.cost_micros and spent.cost_micros >= budget.cost_micros:
        reason = (
            f"the run spent {spent.cost_micros / 1e6:g} of a budget of {budget.cost_micros / 1e6:g}"
        )
        return OverBudget(spent=spent, budget=budget, reason=reason)
    return WithinBudget()


def _retried_attempts(records: Sequence[AnyEntry]) -> set[tuple[int, int]]:
    """The dispatches whose calls a retry replaced: an attempt that committed
    a retriable failure or a pause, or one with a later attempt of its
    iteration in the records."""
    latest: dict[int, int] = {}
    ended: set[tuple[int, int]] = set()
    for entry in records:
        if isinstance(entry, ClaimEntry | ModelEntry | CommitEntry):
            latest[entry.iteration] = max(latest.get(entry.iteration, 0), entry.attempt)
        if isinstance(entry, CommitEntry) and not entry.ends_iteration:
            ended.add(entry.dispatch)
    later = {
        e.dispatch for e in records if isinstance(e, ModelEntry) and e.attempt < latest[e.iteration]
    }
    return ended | later


def call_of(entry: ModelEntry) -> Call:
    """The identity of a model call: its writer, dispatch and position."""
    return _call(entry)


def _call(entry: ModelEntry) -> Call:
    return (entry.writer, entry.iteration, entry.attempt, entry.position)


def _charge(kind: Spend, entry: ModelEntry, usage: Usage) -> Charge:
    return Charge(
        spend=kind,
        usage=usage,
        iteration=entry.iteration,
        attempt=entry.attempt,
        position=entry.position,
    )
