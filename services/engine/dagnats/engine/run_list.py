"""The rules of the lists of runs: a page of the newest (``ListRuns``: which
runs it shows, and when the runs read so far settle it, see
:func:`page_is_whole`), and a live list (``WatchRuns``): which runs one
watcher shows, and what it must be told when a run is stored. Every rule is
in this file; it does no I/O and knows no protobuf: a run is a
:class:`Listed` (what the rules look at) carrying an opaque ``view`` (what
the caller is sent).

The list is the newest ``limit`` runs matching the watcher's filter, as
``ListRuns`` answers: ordered by creation time, newest first (the run id
breaks ties). It is seeded from a read of the stored runs, then each stored
state of any run is applied:

- a state at or below the revision the list holds for its run is old news
  (the seeding read saw a later one) and is ignored;
- a state of a listed run that still matches replaces it; one whose view
  equals the view shown is no change (a write that only the engine sees);
- a state that matches, of a run not listed, enters the list when the list
  has room or the run is newer than its oldest; the oldest then leaves when
  the list is over ``limit``; an older run is not shown;
- a state that no longer matches, or a purge (``None``), takes its run out.
  Nothing older takes its place: the list shows fewer runs until it is read
  again.

Changes wait in the list until :meth:`RunList.take` and are coalesced per
run: the latest view of each run that changed or entered, and the runs that
left, but only those the watcher was told of. A run that entered and left
between two takes is never mentioned. So what waits is bounded by about twice
``limit``, however many runs are stored or how fast, and a slow watcher gets
the latest state of each run instead of a backlog.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class Filter:
    """Which runs a list shows: of ``workflow`` and with ``status`` when set
    (empty, 0: any), at most ``limit``."""

    workflow: str = ""
    status: int = 0
    limit: int = DEFAULT_LIMIT


@dataclass(frozen=True, slots=True, kw_only=True)
class Listed(Generic[V]):
    """A stored state of a run, as the rules see it."""

    run_id: str
    workflow: str
    status: int
    created: int  # creation time, in nanoseconds
    revision: int  # the stored revision of this state
    view: V  # what a watcher is sent; compared with == to find no-change writes

    @property
    def order(self) -> tuple[int, str]:
        return (self.created, self.run_id)


def matches(filter: Filter, run: Listed[V]) -> bool:
    """Whether ``filter`` shows ``run`` (its limit aside)."""
    return (not filter.workflow or run.workflow == filter.workflow) and (
        not filter.status or run.status == filter.status
    )


# ---- a page of the newest runs (ListRuns) --------------------------------------
#
# ``ListRuns`` reads the runs bucket back from its newest writes rather than
# all of it. A run is stored after it is created and each later write moves it
# to the end, so a run that was not read was last stored, by nats-server's
# clock, before the oldest write that was; and it was created before that. The
# creation times are an engine's clock, so the comparison allows that clock a
# lead (``skew``) over nats-server's; an engine further ahead can see one of its
# runs left out of a page that newer runs fill.


def newest(runs: Iterable[Listed[V]], filter: Filter) -> list[Listed[V]]:
    """The runs ``filter`` shows, newest first, at most its limit."""
    shown = [run for run in runs if matches(filter, run)]
    shown.sort(key=lambda run: run.order, reverse=True)
    return shown[: filter.limit]


def page_is_whole(
    page: list[Listed[V]], filter: Filter, *, unread_before: int | None, skew: int
) -> bool:
    """Whether ``page`` (:func:`newest` of the runs read) is what every stored
    run would give. ``unread_before``: every run not read was last stored
    before this time (nanoseconds, nats-server's clock); None when none was
    left unread. ``skew``: the most an engine's clock is ahead of
    nats-server's, in nanoseconds.

    A run not read was created before ``unread_before + skew``; it belongs in
    the page only when the page has room or its oldest run is no newer.
    """
    if unread_before is None:
        return True
    return len(page) == filter.limit and page[-1].created > unread_before + skew


# ---- the page read through the runs by creation time ---------------------------
#
# Every run created since ``RUNS_CREATED`` exists has an entry there, written
# with its create and never rewritten, so that stream's newest entries are the
# newest runs whatever else was written since. A page reads the newest
# entries, orders them by the creation time each carries, and loads only the
# runs it needs, newest first. An entry is written with the run's first
# outbox: beside the run's write, or after it by the reconciler when the
# create stopped between the two (the run is left out of pages until that
# pass, as it is while its create is under way). An entry whose run is not
# stored (the run's write never landed, or the run was purged and its entry is
# about to be) is skipped. A run stored before the stream existed is given an
# entry once, by the first engine that starts (``EngineStore.enter_created``):
# late, at the stream's end, which only makes pages read back further until
# newer runs cover it.
#
# The stream's order is the order its entries were stored (nats-server's
# clock); a creation time is an engine's. An entry not read was stored before
# the oldest entry read, after its run was created: its run was created
# before that time plus the allowance ``skew``, as :func:`page_is_whole` has it.


@dataclass(frozen=True, slots=True)
class Created:
    """A run's entry in the runs by creation time."""

    run_id: str
    workflow: str
    created: int  # creation time, in nanoseconds

    @property
    def order(self) -> tuple[int, str]:
        return (self.created, self.run_id)


def created_data(workflow: str, created: int) -> bytes:
    """What a run's entry holds: its creation time and its workflow."""
    return f"{created} {workflow}".encode()


def created_entry(run_id: str, data: bytes) -> Created | None:
    """The entry ``data`` of ``run_id`` holds; None when it is not one."""
    created, _, workflow = data.decode(errors="replace").partition(" ")
    if not created.isdigit() or not workflow:
        return None
    return Created(run_id, workflow, int(created))


def candidates(entries: Iterable[Created], filter: Filter) -> list[Created]:
    """The entries of runs ``filter`` may show, newest first, each run once:
    the order a page loads runs in (the status is the run's, not the entry's)."""
    seen: dict[str, Created] = {}
    for entry in entries:
        if not filter.workflow or entry.workflow == filter.workflow:
            seen[entry.run_id] = entry
    return sorted(seen.values(), key=lambda entry: entry.order, reverse=True)


def most_loaded(filter: Filter) -> int:
    """How many runs a page loads through the entries before it reads every
    run instead: a filter on a status few runs have would load them one by
    one, where one read of the runs bucket costs less a run."""
    return 4 * filter.limit + 100


@dataclass(frozen=True, slots=True)
class PageWhole:
    """The page is what every stored run would give."""


@dataclass(frozen=True, slots=True)
class ReadMoreEntries:
    """A run whose entry was not read may belong in the page: read about
    ``entries`` more, further back than those read."""

    entries: int


@dataclass(frozen=True, slots=True)
class ReadEveryRun:
    """The filter matched too few of the runs loaded (a status few runs
    have): read the runs bucket from its newest writes instead
    (:func:`page_is_whole`'s read), which costs less a run."""


PageStep = PageWhole | ReadMoreEntries | ReadEveryRun


def settle_by_creation(
    page: list[Listed[V]],
    filter: Filter,
    *,
    unread_before: int | None,
    loaded: int,
    skew: int,
    read: int,
    newest: int,
) -> PageStep:
    """What a page read through the entries needs next. ``page``: :func:`newest`
    of the runs loaded, which were the candidates' first ``loaded``, newest
    first; ``unread_before``: every entry not read was stored before this time
    (nanoseconds, nats-server's clock), None when every entry was read;
    ``read`` entries were read, the newest stored at ``newest``.

    A full page needs the entries stored back to its oldest run's creation
    less ``skew``: as many more as were stored over that stretch at the rate
    of those read, and a quarter over. A page with room reads three times as
    many again."""
    if page_is_whole(page, filter, unread_before=unread_before, skew=skew):
        return PageWhole()
    if loaded >= most_loaded(filter):
        return ReadEveryRun()
    assert unread_before is not None  # else the page was whole
    if len(page) < filter.limit:
        return ReadMoreEntries(max(3 * read, filter.limit))
    stretch = unread_before + skew - page[-1].created + 1
    per_ns = read / max(newest - unread_before, 1_000_000)
    return ReadMoreEntries(max(math.ceil(stretch * per_ns * 5 / 4), filter.limit))


@dataclass(frozen=True, slots=True)
class Changes(Generic[V]):
    """What a watcher is told at once: ``runs`` changed or entered (newest
    first), ``removed`` left."""

    runs: list[V]
    removed: list[str]


@dataclass(slots=True)
class RunList(Generic[V]):
    """One watcher's list and the changes it has yet to be told."""

    filter: Filter
    _listed: dict[str, Listed[V]] = field(default_factory=dict)
    _order: list[tuple[int, str]] = field(default_factory=list)  # ascending: oldest first
    _told: set[str] = field(default_factory=set)  # runs the watcher knows are listed
    _changed: dict[str, Listed[V]] = field(default_factory=dict)
    _left: set[str] = field(default_factory=set)

    def matches(self, run: Listed[V]) -> bool:
        return matches(self.filter, run)

    def seed(self, runs: list[Listed[V]]) -> list[V]:
        """Fill the list from a read of the stored runs; returns the list
        (newest first), which the watcher is told as a whole."""
        for run in runs:
            self.apply(run)
        self._changed.clear()
        self._left.clear()
        self._told = set(self._listed)
        return [self._listed[run_id].view for _, run_id in reversed(self._order)]

    def apply(self, run: Listed[V] | None, *, run_id: str = "") -> None:
        """A stored state of a run; None (with ``run_id``) when it was purged."""
        key = run.run_id if run is not None else run_id
        held = self._listed.get(key)
        if run is None or not self.matches(run):
            if held is not None and (run is None or run.revision > held.revision):
                self._drop(key)
            return
        if held is not None:
            if run.revision <= held.revision:
                return
            self._listed[key] = run
            if run.view != held.view:
                self._changed[key] = run
            return
        full = len(self._order) >= self.filter.limit
        if full and run.order < self._order[0]:
            return  # older than everything shown
        self._listed[key] = run
        bisect.insort(self._order, run.order)
        self._changed[key] = run
        self._left.discard(key)
        if len(self._order) > self.filter.limit:
            self._drop(self._order[0][1])

    def _drop(self, run_id: str) -> None:
        run = self._listed.pop(run_id)
        del self._order[bisect.bisect_left(self._order, run.order)]
        self._changed.pop(run_id, None)
        if run_id in self._told:
            self._left.add(run_id)

    def take(self) -> Changes[V] | None:
        """The changes since the last take, or None when there are none."""
        if not self._changed and not self._left:
            return None
        changed = sorted(self._changed.values(), key=lambda r: r.order, reverse=True)
        removed = sorted(self._left)
        self._told.difference_update(self._left)
        self._told.update(self._changed)
        self._changed.clear()
        self._left.clear()
        return Changes([r.view for r in changed], removed)

    def __len__(self) -> int:
        return len(self._listed)
