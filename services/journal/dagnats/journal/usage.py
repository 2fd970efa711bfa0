"""Reading the usage ledger of a run: its journals' model calls and raises,
read once and then only what was written since.

The journal is the ledger (see :mod:`dagnats.journal.ledger` for its rules);
this module reads it. :class:`RunLedgers` keeps, per run, the stream
sequence read up to, so a budget check reads only the records written since
the last one (the records of the run's other steps included, since a budget
bounds the whole run), and per step the entries the rules need of its open
iteration (model calls without their responses, claims, commits without
their state), the budget inputs, and an ended iteration's charges folded
into totals (:class:`StepLedger`). A process that lost its cache reads the
run again: the stream is the truth.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from dagnats.core.subjects import SPENT
from dagnats.core.usage import Raise, Totals
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.journal import convert, ledger
from dagnats.journal import model as jm
from dagnats.journal.store import JournalStore

RUNS = 1024  # runs whose ledger a process keeps


@dataclass(slots=True)
class StepLedger:
    """One step's ledger: the entries of its iterations not ended yet, as the
    ledger's rules read them, and the charges of the ended ones folded into
    totals (an ended iteration's calls are kept or retried for good), so a
    long run's ledger holds its open iteration and a key per call."""

    open: list[jm.AnyEntry] = field(default_factory=list)
    spent: list[jm.ModelEntry] = field(default_factory=list)
    raises: list[jm.InputEntry] = field(default_factory=list)
    settled: ledger.Split = field(default_factory=ledger.Split)
    settled_by_model: dict[str, Totals] = field(default_factory=dict)
    stored: set[ledger.Call] = field(default_factory=set)

    def add(self, entry: jm.AnyEntry) -> None:
        """Take one entry of the step's journal, in order."""
        match entry:
            case jm.InputEntry():
                self.raises.append(entry)
            case jm.CommitEntry() if entry.ends_iteration:
                self.open.append(entry)
                self._fold(entry.iteration)
            case jm.ForkEntry():
                # Every call before it is a copy of the source run's: what
                # ended iterations charged is copied, not spent; the open
                # iteration's are charged copied by the rules.
                self.settled = ledger.Split(copied=self.settled.spent.plus(self.settled.copied))
                self.settled_by_model = {}
                self.open.append(entry)
            case _:
                self.open.append(entry)

    def _fold(self, iteration: int) -> None:
        ended = [e for e in self.open if e.iteration == iteration]
        self.open = [e for e in self.open if e.iteration != iteration]
        folded = ledger.charges(ended)
        self.settled = self.settled.plus(ledger.split(folded))
        for name, totals in ledger.by_model(folded).items():
            self.settled_by_model[name] = self.settled_by_model.get(name, Totals()).plus(totals)
        self.stored.update(ledger.call_of(e) for e in ended if isinstance(e, jm.ModelEntry))

    def _open_charges(self) -> list[ledger.Charge]:
        return ledger.charges(self.open, self.spent, self.stored)

    def split(self) -> ledger.Split:
        return self.settled.plus(ledger.split(self._open_charges()))

    def by_model(self) -> dict[str, Totals]:
        totals = dict(self.settled_by_model)
        for name, more in ledger.by_model(self._open_charges()).items():
            totals[name] = totals.get(name, Totals()).plus(more)
        return totals


@dataclass(slots=True)
class RunLedger:
    """A run's steps' ledgers, read through ``seq``."""

    seq: int = 0
    steps: dict[str, StepLedger] = field(default_factory=dict)

    def spent(self) -> Totals:
        return self.split().spent

    def split(self) -> ledger.Split:
        total = ledger.Split()
        for step in self.steps.values():
            total = total.plus(step.split())
        return total

    def raised(self) -> Raise:
        return ledger.raises(e for s in self.steps.values() for e in s.raises)


class RunLedgers:
    """The ledgers of the runs this process checked lately."""

    def __init__(self, store: JournalStore) -> None:
        self._store = store
        self._runs: OrderedDict[str, RunLedger] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    async def read(self, run_id: str) -> RunLedger:
        """The run's ledger caught up with its journals."""
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            found = self._runs.pop(run_id, None) or RunLedger()
            self._runs[run_id] = found
            while len(self._runs) > RUNS:
                gone, _ = self._runs.popitem(last=False)
                self._locks.pop(gone, None)
            await catch_up(self._store, run_id, found)
            return found


async def read_ledger(store: JournalStore, run_id: str) -> RunLedger:
    """A run's whole ledger, read from its journals."""
    found = RunLedger()
    await catch_up(store, run_id, found)
    return found


async def catch_up(store: JournalStore, run_id: str, into: RunLedger) -> None:
    """Read the records written after ``into.seq`` into ``into``."""
    for tail, record in await store.read_run(run_id, after=into.seq):
        into.seq = max(into.seq, record.seq)
        spent = tail.endswith(SPENT)
        step = into.steps.setdefault(tail.removesuffix(SPENT), StepLedger())
        for entry in convert.entries(record):
            if spent:
                if isinstance(entry, jm.ModelEntry):
                    step.spent.append(replace(entry, response=b""))
            elif (kept := _kept(entry)) is not None:
                step.add(kept)


def _kept(entry: jm.AnyEntry) -> jm.AnyEntry | None:
    """What the ledger keeps of an entry: nothing of a response or a state."""
    match entry:
        case jm.ModelEntry():
            return replace(entry, response=b"")
        case jm.CommitEntry():
            return replace(entry, state=b"", state_delta=None, output=b"")
        case jm.ClaimEntry():
            return entry
        case jm.InputEntry(mode=ledger.BUDGET_MODE):
            return entry
    return None


def run_usage(found: RunLedger, step_order: list[str]) -> epb.RunUsage:
    """A run's ledger as ``GetRun`` answers it: each step in ``step_order``
    (then any other step the journal holds), and the run's total."""
    steps = [s for s in step_order if s in found.steps]
    steps += sorted(set(found.steps) - set(steps))
    answer = epb.RunUsage()
    total = ledger.Split()
    for step_id in steps:
        step = found.steps[step_id]
        step_split = step.split()
        total = total.plus(step_split)
        item = answer.steps.add(step_id=step_id)
        item.usage.CopyFrom(_split(step_split))
        for name, totals in step.by_model().items():
            item.by_model[name].CopyFrom(_totals(totals))
    answer.total.CopyFrom(_split(total))
    return answer


def _split(split: ledger.Split) -> epb.UsageSplit:
    return epb.UsageSplit(
        kept=_totals(split.kept),
        retried=_totals(split.retried),
        fenced=_totals(split.fenced),
        copied=_totals(split.copied),
        spent=_totals(split.spent),
    )


def _totals(totals: Totals) -> epb.UsageTotals:
    return epb.UsageTotals(
        calls=totals.calls,
        input_tokens=totals.input_tokens,
        output_tokens=totals.output_tokens,
        cached_tokens=totals.cached_tokens,
        cost_micros=totals.cost_micros,
    )
