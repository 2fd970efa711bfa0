"""The engine's event loops: applying history events, commits' events and
timers to runs, publishing what the rules decided, and reconciling stranded
work.

Every change to a run goes through :meth:`Engine.transition`: the run with
its revision (read, or the guessed run: as this engine last wrote it), any
outbox an earlier writer left published, the pure rules' decision, the new
run *and* its outbox saved with compare-and-swap, then the outbox published.
A crash anywhere leaves the old run (the input is redelivered) or the new run
with its outbox (the next writer or the reconciler publishes it; Msg-Ids make
that safe). The outbox stays in the stored run once published, until the
next write replaces it: whoever reads it publishes it again, a no-op within
JetStream's duplicate window; the reconciler clears one ``outbox_grace`` old,
and a task past the window is never published again (``rules.republishable``).
A decision that writes nothing has no swap to check it, so it is taken on a
read only. What the loops add to that path:

- the deferred write: a kept iteration decided on the guessed run and not
  written until the run's next other change, checked by heard writes
  (:mod:`dagnats.engine.heard`) instead of a swap;
- the reconciler: each pass enters the runs written since the last, takes
  parked runs out of the active-run index, republishes outboxes and applies
  events an engine took and never applied;
- the commit's event, below.

Each is one step of ``docs/architecture.md``, "The life of an iteration",
which names the setting that turns it on or off; the reasons, and the crash
windows each leaves, are in the ADRs its shortcuts table cites.

A journal commit's event comes to one engine of the queue group over core
NATS, not on the history (the event to one engine, ADR 33): it is applied as
a history event is, its sender told, and nothing is acknowledged. Nothing of
it is durable but the commit in the journal and the task message still
leased (its sender releases it once told), so an event lost here (this
engine dies, or is slow) costs the journal service its share of the commit
wait, after which it publishes the event on the history. Such events race
the history's events of the same run; the run's compare-and-swap orders
them, and a commit's event applied twice is stale the second time (its
dispatch has moved on) and dropped. A journal service in the same process
hands such an event to this engine by a call instead (the event by a call,
``take_commit_event``, ADR 36): the same application, the decision returned
rather than sent, while this engine serves commits' events at all. Which
route an event takes is ``dagnats.engine.report.commit_event_route``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from dagnats.core import jetstream as jsx
from dagnats.core import tracing
from dagnats.core.errors import Unavailable
from dagnats.core.partitions import partition_of
from dagnats.core.seam import seam
from dagnats.core.status import FINAL_RUN_STATUSES, step_status_from_proto
from dagnats.core.subjects import (
    HISTORY_SUBJECTS,
    TIMER_SUBJECTS,
    created_subject,
    history_consumer,
    is_inbox,
    partition_filters,
    task_subject,
    timer_consumer,
)
from dagnats.core.timestamps import timestamp
from dagnats.engine import convert, rules
from dagnats.engine import model as m
from dagnats.engine.config import EngineConfig
from dagnats.engine.convert_workflow import stored_workflow
from dagnats.engine.heard import Mark, RunWrites
from dagnats.engine.ownership import Ownership
from dagnats.engine.purge import purge_run
from dagnats.engine.runs import Runs
from dagnats.engine.store import Delivery, EngineStore, StaleRevision, StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.inputs import convert as inputs_convert
from dagnats.inputs.rules import StepProgress, step_progress
from dagnats.inputs.store import InputStore, close_step_inputs
from dagnats.journal.store import JournalStore

log = logging.getLogger(__name__)

MAX_CAS_RETRIES = 100
WRITTEN_RUNS = 4096  # runs whose last write the engine keeps, to decide on without a read
ENDS_PUBLISHED = 4096  # ended runs whose outbox the engine published, known to the reconciler
WRITTEN_BYTES = 16 * 1024  # a larger run is read again instead

Decide = Callable[[m.Run, float], m.Decision]
# The events that report a step's outcome.
_REPORTS = frozenset({"continue", "complete", "fail", "pause"})


class Engine:
    """Applies inputs to runs; shared by the gRPC servicer and the consumer loops."""

    def __init__(
        self,
        store: EngineStore,
        config: EngineConfig,
        *,
        inputs: InputStore | None = None,
        journal: JournalStore | None = None,
        clock: Callable[[], float] = time.time,
        runs: Runs | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        self.store = store
        # The partitions this replica consumes (all of them when it runs alone).
        self.ownership = ownership or Ownership.whole()
        self.inputs = inputs
        self.journal = journal
        self.config = config
        self.clock = clock
        self.options = config.rule_options()
        # Every read of the run now, caught up with the journal (``runs``: the
        # one the process's other services read too); its counters are ours.
        self.runs = runs or Runs(store, journal, options=self.options, clock=clock)
        self.counters: Counter[str] = self.runs.counters
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        # Per owned partition: its history and timer loops, and the event
        # that ends them after their batch; its commits' events' unsubscribe.
        self._loops: dict[int, tuple[asyncio.Event, list[asyncio.Task[None]]]] = {}
        self._unserve: dict[int, Callable[[], Awaitable[None]]] = {}
        self._pulling: set[asyncio.Task[Any]] = set()  # loops waiting on a pull
        self._serving = False
        self._following = asyncio.Lock()
        self._suspects: set[tuple[str, str, int, int]] = set()
        self._missing: set[str] = set()  # indexed runs not found on the last pass
        # Runs whose history had events past the consumer's ack floor on the
        # last pass, with the newest event's sequence; and those the reconciler
        # applied itself, through that sequence.
        self._unapplied: dict[str, int] = {}
        self._publishing: set[asyncio.Task[None]] = set()  # entries behind the first tasks
        self._recovered: dict[str, int] = {}
        # The runs as this engine last wrote them, their outboxes published by
        # it: a guess at what is stored, checked by the next compare-and-swap.
        self._written: OrderedDict[str, StoredRun] = OrderedDict()
        # The ended runs whose last write's outbox this engine published (run
        # id, revision): the reconciler's pass that reads the write has
        # nothing to do for them (``_settle_end``).
        self._ends_published: OrderedDict[str, int] = OrderedDict()
        # Runs whose guess holds kept iterations not written yet (deferred writes):
        # how many, and since when.
        self._deferred: dict[str, tuple[int, float]] = {}
        # Other engines' writes of runs, heard (heard writes), and for each guess
        # the moment its write was sent: nobody wrote the run since, if
        # nothing was heard after it.
        self.heard: RunWrites | None = None
        self._unhear: Callable[[], Awaitable[None]] | None = None
        self._marks: dict[str, Mark] = {}
        # Told each state of a run this engine stores, as it is stored (the
        # run watches of this process).
        self.on_stored: Callable[[StoredRun], None] | None = None
        # Commits' events taken from core NATS and being applied: at most a
        # history fetch's worth at once; more waits in the subscription.
        self._commit_events: set[asyncio.Task[bytes | None]] = set()
        self._commit_event_slots = asyncio.Semaphore(config.history_batch)
        # Runs this engine is creating: their first tasks may be delivered
        # before their write is acknowledged (``create``).
        self._creating: dict[str, asyncio.Future[None]] = {}

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        self.heard, self._unhear = await self.store.hear_run_writes()
        await self.store.enter_created(convert.created_run_entry)
        self._serving = True
        self.ownership.on_change(self._follow)  # before the first follow: no change is missed
        await self._follow()
        self._tasks = [
            asyncio.create_task(self._reconcile_loop()),
            asyncio.create_task(self._write_deferred_loop()),
        ]

    def owns_run(self, run_id: str) -> bool:
        """Whether this engine owns the run's partition now."""
        return self.ownership.owns_run(run_id)

    def consuming(self) -> frozenset[int]:
        """The partitions whose history, timers and commits' events this
        engine consumes now: the owned ones, once it has followed a change."""
        return frozenset(self._loops)

    async def _follow(self, _told: frozenset[int] | None = None) -> None:
        """Consume the partitions this engine owns now and no other (each
        call reads the owned set afresh, so calls in any order end on the
        latest): a partition let go ends its loops after their batch and its
        commits' events, and the deferred writes are written, since the
        runs' next iterations are decided elsewhere; one taken gets its
        consumers and loops."""
        async with self._following:
            if self._stopping.is_set():
                return
            owned = self.ownership.owned()
            gone = sorted(set(self._loops) - owned)
            if gone:
                await self._let_go(gone)
                await self.write_deferred(older_than=0.0)
            for partition in sorted(owned - set(self._loops)):
                await self._take(partition)

    async def _take(self, partition: int) -> None:
        parts = self.ownership.partitions
        history, timers = history_consumer(partition), timer_consumer(partition)
        await self.store.ensure_consumer(
            jsx.HISTORY,
            history,
            self.config.history_ack_wait,
            partition_filters(HISTORY_SUBJECTS, partition, parts),
        )
        await self.store.ensure_consumer(
            jsx.TIMERS,
            timers,
            self.config.timer_ack_wait,
            partition_filters(TIMER_SUBJECTS, partition, parts),
        )
        until = asyncio.Event()
        self._loops[partition] = (
            until,
            [
                asyncio.create_task(self._consume(jsx.HISTORY, history, self._on_event, until)),
                asyncio.create_task(self._consume(jsx.TIMERS, timers, self._on_timer, until)),
            ],
        )
        if self._serving:
            await self._serve_partition(partition)

    async def _let_go(self, partitions: list[int]) -> None:
        """End the loops and the commits' events of ``partitions``, all at
        once: a loop waiting on its pull is cancelled (the pull withdrawn,
        whatever reached it given back at once), one handling a batch ends
        after it."""
        let_go = [self._loops.pop(partition) for partition in partitions]
        for until, _ in let_go:
            until.set()
        for partition in partitions:
            if (unserve := self._unserve.pop(partition, None)) is not None:
                await unserve()
        loops = [task for _, tasks in let_go for task in tasks]
        for task in loops:
            if task in self._pulling:
                task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)

    async def _serve_partition(self, partition: int) -> None:
        if partition not in self._unserve:
            self._unserve[partition] = await self.store.serve_commit_events(
                self._on_commit_event, partition, self.ownership.partitions
            )

    async def serve_commit_events(self) -> None:
        """Take commits' events from the journal services (ADR 33), of the
        owned partitions' runs."""
        self._serving = True
        for partition in list(self._loops):
            await self._serve_partition(partition)

    async def stop_serving_commit_events(self) -> None:
        """Take no more commits' events; those being applied are cut
        short (their journal services publish them on the history)."""
        self._serving = False
        for partition in list(self._unserve):
            await self._unserve.pop(partition)()
        for task in list(self._commit_events):
            task.cancel()
        for task in list(self._commit_events):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        self._stopping.set()
        async with self._following:  # a change being followed finishes first
            await self.stop_serving_commit_events()
            await self.write_deferred(older_than=0.0)
            loops = [task for _, tasks in self._loops.values() for task in tasks]
            self._loops.clear()
        for task in [*self._tasks, *loops]:
            task.cancel()
        for task in [*self._tasks, *loops]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._unhear is not None:
            await self._unhear()

    # ---- the one way a run changes ------------------------------------------------

    async def transition(
        self,
        run_id: str,
        decide: Decide,
        *,
        kept: tuple[str, int] | None = None,
        through_last: bool = False,
    ) -> tuple[m.Run, m.Decision] | None:
        """Apply ``decide`` to the run with compare-and-swap; None if no such run.

        ``kept``: the input is a report of this step whose holder kept task
        message ``kept_seq`` for the next iteration. When the decision only
        carries the step on with that message, and this engine holds the run
        as it wrote it, the write may wait (the deferred write, :meth:`_defers`).
        ``through_last``: a run that is read is caught up through its kept
        step's last commit too (:meth:`caught_up`)."""
        guess = self._written.pop(run_id, None)
        mark = self._marks.pop(run_id, None)
        published = guess.revision if guess is not None else 0  # its outbox, by us
        read: StoredRun | None = None
        for _ in range(MAX_CAS_RETRIES):
            if guess is not None:
                stored, guessed, guess = guess, True, None
            else:
                read = read or await self.store.load_run(run_id)
                if read is None:
                    self._deferred.pop(run_id, None)
                    return None
                stored, guessed, read = read, False, None
                if stored.record.outbox and stored.revision != published and not _ended(stored):
                    # Maybe never published (its writer died first). Not
                    # cleared: the write below replaces it. An ended run's is
                    # the reconciler's (``_settle_end``): no write follows.
                    await self.publish_outbox(stored)
            run = as_stored = stored.run or convert.record_from_proto(stored.record)
            if not guessed:
                run = await self.caught_up(as_stored, stored.record, through_last=through_last)
            decision = decided = decide(run, self.clock())
            if isinstance(decision, m.Dropped):
                if guessed:
                    continue  # nothing to swap checks the guess: decide on a read
                self.counters["dropped"] += 1
                log.info("run %s: dropped input: %s", run_id, decision.reason)
                if run is as_stored:
                    return run, decision
                # Dropped, but the journal was ahead: the run is written caught up.
                decision = m.Accepted(run=run, effects=())
            record = self._record(decision, dict(stored.record.trace_context))
            record.parked_entry = stored.record.parked_entry
            if guessed and kept is not None and self._defers(stored, run, decision, kept):
                # Nobody wrote the run since this engine did: the decision is
                # the one a read would have given.
                if await self._unchanged(stored, mark):
                    self._defer(StoredRun(record, stored.revision, decision.run), mark)
                    await seam("after_kept_unwritten")
                    return decision.run, decision
                self.counters["guess_missed"] += 1
                continue
            mark = self._mark()
            try:
                revision = await self.store.update_run(record, stored.revision)
            except StaleRevision:
                self.counters["guess_missed" if guessed else "cas_conflicts"] += 1
                continue
            await self._publish_written(StoredRun(record, revision, decision.run), mark)
            return decision.run, decided
        raise Unavailable(f"run {run_id} is changing too fast; try again")

    # ---- deferred writes: kept iterations, written later (ADR 37) --------------------

    def _defers(
        self, stored: StoredRun, run: m.Run, decision: m.Decision, kept: tuple[str, int]
    ) -> bool:
        """Whether ``decision``, made on this engine's guess ``stored`` (the
        run ``run``), may go unwritten for now: it carries step ``kept``'s
        loop on to the next iteration with the same kept message, publishes
        nothing, and the run as stored already says that message is kept, so
        a reader knows to look in the journal."""
        step_id, kept_seq = kept
        if self.config.kept_write_batch <= 1:
            return False
        if not rules.carries_kept_loop_on(run, decision, step_id, kept_seq):
            return False
        count, _ = self._deferred.get(stored.record.run.run_id, (0, 0.0))
        return count + 1 < self.config.kept_write_batch

    async def _unchanged(self, stored: StoredRun, mark: Mark | None) -> bool:
        """Whether the run is still as this engine wrote it (``stored``):
        nothing heard of it since the write was sent (``mark``: heard writes), or
        else the revision read is still the one written."""
        run_id = stored.record.run.run_id
        if self.heard is not None and self.heard.quiet_since(run_id, mark):
            self.counters["kept_heard_quiet"] += 1
            return True
        read = await self.store.load_run(run_id)
        return read is not None and read.revision == stored.revision

    def _mark(self) -> Mark | None:
        """Now, in what was heard of other writers: taken before a write is sent."""
        return self.heard.mark() if self.heard is not None else None

    def _defer(self, decided: StoredRun, mark: Mark | None) -> None:
        """Keep ``decided`` as this engine's guess, unwritten; the next write
        of the run, or :meth:`write_deferred`, stores it."""
        run_id = decided.record.run.run_id
        count, since = self._deferred.get(run_id, (0, self.clock()))
        self._deferred[run_id] = (count + 1, since)
        self.counters["kept_unwritten"] += 1
        self._remember(decided, mark)

    async def write_deferred(self, *, older_than: float) -> None:
        """Write the runs whose first unwritten iteration was decided at
        least ``older_than`` seconds ago. A run written meanwhile by another
        engine caught up from the journal (:meth:`caught_up`): the guess is
        dropped."""
        now = self.clock()
        due = [run_id for run_id, (_, since) in self._deferred.items() if now - since >= older_than]
        for run_id in due:
            self._deferred.pop(run_id, None)
            self._marks.pop(run_id, None)
            guess = self._written.pop(run_id, None)
            if guess is None:
                continue
            mark = self._mark()
            try:
                revision = await self.store.update_run(guess.record, guess.revision)
            except StaleRevision:
                self.counters["kept_write_missed"] += 1
                continue
            self.counters["kept_writes"] += 1
            written = StoredRun(guess.record, revision, guess.run)
            self._stored(written)
            self._remember(written, mark)

    async def _write_deferred_loop(self) -> None:
        delay = self.config.kept_write_delay
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay / 2)
            try:
                await self.write_deferred(older_than=delay)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("writing the runs of kept iterations failed")

    async def caught_up(
        self, run: m.Run, record: ipb.RunRecord, *, through_last: bool = False
    ) -> m.Run:
        """``run``, as read, with the kept iterations its journal holds past
        it applied (:meth:`dagnats.engine.runs.Runs.caught_up`)."""
        return await self.runs.caught_up(run, record, through_last=through_last)

    async def read_run(self, run_id: str) -> StoredRun | None:
        """The run now: as stored, caught up with its journal (:class:`Runs`)."""
        return await self.runs.read(run_id)

    async def _publish_written(
        self, written: StoredRun, mark: Mark | None = None, *, published: bool = False
    ) -> None:
        """Publish the outbox of a run this engine just wrote (unless
        ``published``: it was, with the write), and keep the run as the guess
        for its next change: its outbox is then known published. ``mark``:
        taken before the write was sent."""
        self._deferred.pop(written.record.run.run_id, None)
        self._stored(written)
        await seam("after_dispatch_saved")
        if not published:
            await self.publish_outbox(written)
        await seam("after_dispatch_published")
        if _ended(written) and written.record.outbox:
            self._end_published(written)
        self._remember(written, mark)

    def _stored(self, written: StoredRun) -> None:
        if self.on_stored is not None:
            self.on_stored(written)

    def wrote_last(self, stored: StoredRun) -> bool:
        """Whether ``stored`` is the state of its run this engine stored
        last, as far as it knows (another engine may have written since)."""
        mine = self._written.get(stored.record.run.run_id)
        return mine is not None and mine.revision == stored.revision

    def _remember(self, written: StoredRun, mark: Mark | None = None) -> None:
        """Keep the run as written, its outbox published, if it may change
        again; a run that ended is not changed by the hot path any more.
        ``mark``: when its write was sent, if anything heard can tell that
        nobody wrote the run since."""
        run_id = written.record.run.run_id
        record = written.record
        if record.run.status != pb.RUN_STATUS_RUNNING or record.ByteSize() > WRITTEN_BYTES:
            self._forget(run_id)
            return
        self._written[run_id] = written
        self._written.move_to_end(run_id)
        if mark is not None:
            self._marks[run_id] = mark
        else:
            self._marks.pop(run_id, None)
        while len(self._written) > WRITTEN_RUNS:
            # A guess with kept iterations unwritten goes too: a reader of
            # the run catches up from the journal (the catch-up).
            forgotten, _ = self._written.popitem(last=False)
            self._forget(forgotten)

    def _forget(self, run_id: str) -> None:
        """Keep no guess of the run: its next change is decided on a read."""
        self._written.pop(run_id, None)
        self._deferred.pop(run_id, None)
        self._marks.pop(run_id, None)

    async def create(self, accepted: m.Accepted, trace_context: dict[str, str]) -> StoredRun:
        """Store a new run and publish its first dispatches; the run as stored.
        A run that exists already is returned as stored (after finishing its
        outbox).

        The first dispatches are published while the run is written, not after:
        the run's outbox holds them, and the reconciler's next pass
        finds every run written since its last, so a crash that
        stores the run without them leaves it to the reconciler; one that
        stores a task without its run leaves a task that no run claims, which
        a lease gives back while the run's write may still land
        (``rules.awaits_its_run``) and settles after. A lease by this engine
        waits for the write (``creating``)."""
        record = self._record(accepted, trace_context)
        # Its entry in the runs by creation time rides in its first outbox alone.
        record.outbox.append(convert.created_run_entry(record.run))
        if not record.HasField("outbox_since"):
            record.outbox_since.CopyFrom(timestamp(self.clock()))
        run_id = accepted.run.run_id
        mark = self._mark()
        self._creating[run_id] = creating = asyncio.get_running_loop().create_future()
        try:
            written, published = await asyncio.gather(
                self.store.create_run(record),
                self._publish_first(record),
                return_exceptions=True,
            )
            if isinstance(written, BaseException):
                raise written
            if isinstance(published, BaseException):
                raise published  # the run keeps them in its outbox: the reconciler publishes it
            if written is None:
                stored = await self.store.require_run(run_id)
                if stored.record.outbox:
                    stored = await self.flush(stored)
                return stored
            created = StoredRun(record, written)
            await self._publish_written(created, mark, published=True)
            return created
        finally:
            if self._creating.get(run_id) is creating:
                del self._creating[run_id]
            creating.set_result(None)

    async def _publish_first(self, record: ipb.RunRecord) -> None:
        """Publish a new run's outbox: its first dispatches at once, beside
        the run's write, and its entry in the runs by creation time behind
        them, off the start's path (its fsync would wait beside theirs). An
        entry not published stays in the outbox, which the reconciler
        publishes."""
        await seam("before_first_tasks")
        created = created_subject(record.run.run_id)
        first = [e for e in record.outbox if e.subject != created]
        await asyncio.gather(*(self.store.publish(entry) for entry in first))
        for entry in record.outbox:
            if entry.subject == created:
                publishing = asyncio.create_task(self.store.publish(entry))
                self._publishing.add(publishing)
                publishing.add_done_callback(self._entry_published)

    def _entry_published(self, task: asyncio.Task[None]) -> None:
        self._publishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "a run's entry by creation time waits for the reconciler: %s", task.exception()
            )

    async def creating(self, run_id: str) -> None:
        """Return once a create of ``run_id`` by this engine, if one is under
        way, has stored the run or failed: a lease of its first task, which
        may come before the write is acknowledged, then reads what it left."""
        pending = self._creating.get(run_id)
        if pending is not None:
            await asyncio.wait([pending])

    def quiet(self, run_id: str) -> bool:
        """Whether nobody else wrote the run since this engine's last write of
        it, as far as heard writes can tell; False whenever it cannot."""
        return self.heard is not None and self.heard.quiet_since(run_id, self._marks.get(run_id))

    def last_written(self, run_id: str) -> StoredRun | None:
        """The run as this engine last wrote it, if it keeps it: a guess at
        what is stored (see the module's docstring)."""
        return self._written.get(run_id)

    async def publish_outbox(self, stored: StoredRun) -> None:
        """Publish a run's outbox, but for the entries ``rules.republishable``
        keeps back (see the module's docstring)."""
        age = self.clock() - stored.record.outbox_since.ToNanoseconds() / 1e9
        for entry in stored.record.outbox:
            if not rules.republishable(entry.subject, age, jsx.DEDUPE_WINDOW):
                self.counters["old_task_left"] += 1
                log.warning(
                    "run %s: a task of an outbox %.0fs old is not published again (%s); "
                    "if it never was, its step is dispatched anew",
                    stored.record.run.run_id,
                    age,
                    entry.msg_id,
                )
                continue
            await self.store.publish(entry)

    async def flush(self, stored: StoredRun, *, published: bool = False) -> StoredRun:
        """Publish a run's outbox (unless ``published``: this engine did), then
        clear it if nobody changed the run meanwhile. An ended run is left as
        it is: its outbox is the reconciler's (``_settle_end``)."""
        if _ended(stored):
            return stored
        if not published:
            await self.publish_outbox(stored)
        cleared = await self._rewrite(stored, clear=True)
        if cleared is None:
            latest = await self.store.load_run(stored.record.run.run_id)
            return latest if latest is not None else stored
        return cleared

    async def _rewrite(
        self, stored: StoredRun, *, clear: bool, parking: int = 0
    ) -> StoredRun | None:
        """Write the run as it is, its outbox cleared if ``clear``, if nobody
        changed it since; None if somebody did. ``parking``: flagged
        ``unindexed``, for a park that purges the index entry of that
        revision (see :meth:`_park`)."""
        record = ipb.RunRecord()
        record.CopyFrom(stored.record)
        if clear:
            del record.outbox[:]
            record.ClearField("outbox_since")
        record.unindexed = bool(parking)
        if parking:
            record.parked_entry = parking
        try:
            revision = await self.store.update_run(record, stored.revision)
        except StaleRevision:
            return None
        return StoredRun(record, revision)

    def _record(self, accepted: m.Accepted, trace_context: dict[str, str]) -> ipb.RunRecord:
        now = self.clock()
        entries = [
            convert.outbox_entry(effect, _trace_headers(), now) for effect in accepted.effects
        ]
        return convert.record_to_proto(accepted.run, entries, now, dict(trace_context))

    # ---- consumers ------------------------------------------------------------------

    async def _consume(
        self,
        stream: str,
        durable: str,
        handle: Callable[[Delivery], Awaitable[None]],
        until: asyncio.Event,
    ) -> None:
        me = asyncio.current_task()
        assert me is not None  # a loop runs as a task of its own
        while not self._stopping.is_set() and not until.is_set():
            self._pulling.add(me)
            try:
                msgs = await self.store.pull(stream, durable, self.config.history_batch, 1.0)
            except Exception as err:  # the connection is reconnecting; try again shortly
                # One line: a server that is gone fails every half second,
                # and each traceback of nats-py's reconnect runs to pages.
                log.warning("fetch from %s failed: %r", durable, err)
                await asyncio.sleep(0.5)
                continue
            finally:
                self._pulling.discard(me)
            await self._handle_batch(msgs, handle)

    async def _handle_batch(
        self, msgs: list[Delivery], handle: Callable[[Delivery], Awaitable[None]]
    ) -> None:
        """Messages of one subject (one run) in order; different runs concurrently."""
        by_subject: dict[str, list[Delivery]] = {}
        for msg in msgs:
            by_subject.setdefault(msg.subject, []).append(msg)

        async def in_order(group: list[Delivery]) -> None:
            for msg in group:
                await self._guarded(msg, handle)

        await asyncio.gather(*(in_order(g) for g in by_subject.values()))

    async def _guarded(self, msg: Delivery, handle: Callable[[Delivery], Awaitable[None]]) -> None:
        try:
            await handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            delivered = msg.delivered
            if delivered >= self.config.dead_letter_after:
                await self._dead_letter(msg, err)
                return
            log.warning("%s: %r (delivery %d); will retry", msg.subject, err, delivered)
            with contextlib.suppress(Exception):
                await msg.nak(delay=min(0.1 * 2**delivered, 10.0))

    async def _dead_letter(self, msg: Delivery, err: Exception) -> None:
        self.counters["dead_letters"] += 1
        log.error("%s: moved aside after repeated failures: %r", msg.subject, err)
        await self.store.dead_letter(msg, err)

    async def _on_event(self, msg: Delivery) -> None:
        try:
            event = ipb.HistoryEvent.FromString(msg.data)
        except Exception as err:
            await self._dead_letter(msg, err)
            return
        await self._take_event(event)
        await msg.ack()

    async def _take_event(self, event: ipb.HistoryEvent, *, answer: bool = False) -> bytes | None:
        """Apply an event taken from the history or sent to this engine; with
        ``answer``, what its sender is to be told (see ``_apply_event``)."""
        await seam("before_event_applied")
        kind = event.WhichOneof("kind") or "unknown"
        parent = tracing.extract(dict(event.trace_context))
        with tracing.span(f"engine apply {kind}", parent) as span:
            span.set_attribute("dagnats.run_id", event.run_id)
            span.set_attribute("dagnats.step_id", event.step_id)
            return await self._apply_event(event, answer=answer)

    @property
    def takes_commit_events(self) -> bool:
        """Whether this engine takes commits' events now (``serve_commit_events``)."""
        return self._serving

    async def take_commit_event(self, event: ipb.HistoryEvent, *, wait: float) -> bytes | None:
        """Apply a journal commit's event handed over by the journal service
        of this process, as one sent over core NATS is (ADR 36); the
        ``EventDecision`` its sender is told, serialized. None when this engine
        takes no commits' events now, the event was not applied within ``wait``
        seconds, or it leaves nothing to tell: the sender then goes on as if
        no engine had answered."""
        if not self.takes_commit_events:
            return None
        self.counters["local_applied"] += 1
        task = asyncio.create_task(self._take_commit_event(event))
        self._commit_events.add(task)  # cut short with those sent over NATS
        task.add_done_callback(self._commit_events.discard)
        done, _ = await asyncio.wait({task}, timeout=wait)
        if not done:
            self.counters["local_late"] += 1  # its sender goes to the history
            return None
        if task.cancelled():
            return None
        return task.result()

    async def _take_commit_event(self, event: ipb.HistoryEvent) -> bytes | None:
        try:
            return await self._take_event(event, answer=True)
        except Exception:
            log.exception(
                "run %s/%s: a commit's event was not applied", event.run_id, event.step_id
            )
            return None

    async def _on_commit_event(self, data: bytes) -> None:
        """A commit's event from core NATS (ADR 33), applied in a task
        of its own; the subscription hands over the next once a slot is free."""
        await self._commit_event_slots.acquire()
        task = asyncio.create_task(self._apply_commit_event(data))
        self._commit_events.add(task)
        task.add_done_callback(self._commit_event_done)

    def _commit_event_done(self, task: asyncio.Task[None]) -> None:
        self._commit_events.discard(task)
        self._commit_event_slots.release()

    async def _apply_commit_event(self, data: bytes) -> None:
        """Apply a commit's event as the history's, never raising: its
        journal service publishes it on the history when no decision comes."""
        try:
            event = ipb.HistoryEvent.FromString(data)
        except Exception as err:
            self.counters["direct_dropped"] += 1
            log.warning("a direct event that does not decode was dropped: %r", err)
            return
        if not _is_commit_event(event):
            self.counters["direct_dropped"] += 1
            log.warning(
                "run %s: a direct event that is no commit's event was dropped", event.run_id
            )
            return
        self.counters["direct_applied"] += 1
        try:
            await self._take_event(event)
        except Exception:
            log.exception("run %s/%s: a direct event was not applied", event.run_id, event.step_id)

    async def _apply_event(self, event: ipb.HistoryEvent, *, answer: bool = False) -> bytes | None:
        """Apply ``event``. A journal commit's event that names a notice
        subject has its sender told there what became of it; with ``answer``,
        that is returned instead (None: nothing to tell)."""
        kind = event.WhichOneof("kind")
        if kind == "start":
            await self._start_child(event)
        elif kind == "inputs":
            await self._step_inputs(event)
        else:
            run_input = convert.event_to_input(event)
            if run_input is None:
                return None
            kept = (event.step_id, event.kept_seq) if event.kept_seq else None
            applied = await self.apply(event.run_id, run_input, kept=kept)
            if not (answer or event.notify):
                return None
            decision = _decision(event, applied[0] if applied else None)
            if answer:
                return decision
            if decision is not None:
                await self._tell_sender(event, decision)
        return None

    async def _tell_sender(self, event: ipb.HistoryEvent, decision: bytes) -> None:
        """Tell the journal service that sent a commit's event ``decision``,
        now that the run is stored (ADR 33)."""
        if not is_inbox(event.notify):
            log.warning("run %s: a notice subject that is no inbox: %r", event.run_id, event.notify)
            return
        await self.store.notify(event.notify, decision)

    async def apply(
        self, run_id: str, run_input: m.RunInput, *, kept: tuple[str, int] | None = None
    ) -> tuple[m.Run, m.Decision] | None:
        # That a task vanished is decided on the run caught up through its
        # last commit (:meth:`caught_up`).
        vanished = isinstance(run_input, m.TaskVanished)
        return await self.transition(
            run_id,
            lambda run, now: rules.apply(run, run_input, now, self.options),
            kept=kept,
            through_last=vanished,
        )

    async def _step_inputs(self, event: ipb.HistoryEvent) -> None:
        """Close a finished step's queued inputs, or wake a step that began to
        wait for input while one was already queued."""
        if self.inputs is None:
            return
        if event.inputs.close:
            step = await self._ended_step(event)
            if step is not None:
                now = self.clock()
                await close_step_inputs(self.inputs, event.run_id, event.step_id, step, now)
            return
        if await self.inputs.queued(event.run_id, event.step_id, self.clock()):
            await self.apply(event.run_id, m.InputArrived(step_id=event.step_id))

    async def _ended_step(self, event: ipb.HistoryEvent) -> StepProgress | None:
        """What the close of a finished step's inputs needs of the step: how
        it finished and which iterations committed (``at_step_end``). The
        event says so; one of an earlier release does not, and the run, which
        stores the step's end, is read instead (None: it was purged)."""
        closed = event.inputs
        if closed.status:
            status = step_status_from_proto(closed.status)
            return step_progress(status, event.iteration, closed.iterations)
        stored = await self.store.load_run(event.run_id)
        return inputs_convert.progress(stored.record.run if stored else None, event.step_id)

    async def _start_child(self, event: ipb.HistoryEvent) -> None:
        start = event.start
        if await self.store.load_run(event.run_id) is None:
            try:
                workflow = stored_workflow(await self.store.get_workflow(start.workflow))
            except Exception as err:
                await self._child_failed_to_start(event, str(err))
                return
            accepted = rules.start_run(
                run_id=event.run_id,
                workflow=workflow,
                input=start.input,
                now=self.clock(),
                parent_run_id=start.parent_run_id,
                parent_step_id=start.parent_step_id,
            )
            await self.create(accepted, dict(event.trace_context))
            return
        stored = await self.store.require_run(event.run_id)
        if stored.record.outbox:
            await self.flush(stored)

    async def _child_failed_to_start(self, event: ipb.HistoryEvent, error: str) -> None:
        start = event.start
        ended = m.ChildEnded(
            step_id=start.parent_step_id,
            child_run_id=event.run_id,
            status=m.RunStatus.FAILED,
            error=f"could not start: {error}",
        )
        await self.apply(start.parent_run_id, ended)

    async def _on_timer(self, msg: Delivery) -> None:
        timer = ipb.Timer.FromString(msg.data)
        remaining = timer.due.ToNanoseconds() / 1e9 - self.clock()
        if remaining > 0.005:
            await msg.nak(delay=remaining)
            return
        parent = tracing.extract(dict(timer.trace_context))
        if timer.kind == ipb.TIMER_KIND_PURGE:
            with tracing.span("engine purge", parent):
                await self.purge(timer.run_id)
        else:
            with tracing.span("engine timer", parent):
                await self.apply(timer.run_id, convert.timer_to_input(timer))
        await msg.ack()

    async def purge(self, run_id: str) -> None:
        """Purge an ended run whose retention is over (its purge timer fired);
        a run still running, or gone, is left as it is (``purge_run``)."""
        self._forget(run_id)
        if await purge_run(self.store, self.journal, self.inputs, run_id, asked=False):
            self.counters["runs_purged"] += 1
            log.info("run %s: purged, its retention after its end is over", run_id)

    # ---- reconciler -----------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile pass failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.reconcile_interval)

    async def reconcile(self) -> None:
        """Publish forgotten outboxes, and re-dispatch running steps whose task
        vanished (a late acknowledgement from a stalled worker deletes it).

        A step counts as stranded only when two passes in a row see the same
        dispatch with no task in flight and no unapplied event on the run's
        history, so a report still on its way is not mistaken for a lost task.
        It reads the runs of the active-run index (``EngineStore``), not every
        stored run: a pass costs what the running runs cost.
        """
        now = self.clock()
        seen: set[tuple[str, str, int, int]] = set()
        missing: set[str] = set()
        unapplied: dict[str, int] = {}
        recovered: dict[str, int] = {}
        parts = self.ownership.partitions
        applied_in: dict[int, int] = {}
        for partition in sorted(self.ownership.owned()):
            floor = await self.store.history_applied_through(history_consumer(partition))
            if floor is not None:  # else just taken: its consumer is made, then a pass
                applied_in[partition] = floor
        for run_id, entry in (await self.store.indexed_runs(ended=self._settle_end)).items():
            partition = partition_of(run_id, parts)
            if partition not in applied_in:
                continue  # another replica's partition: its reconciler's
            applied = applied_in[partition]
            stored = await self.store.load_run(run_id)
            self.counters["reconcile_reads"] += 1
            if stored is None:
                # Purged by a delete that died before taking its entry out, or
                # indexed by a start from before runs were stored unindexed (ADR 48), not
                # stored yet: missing on two passes in a row, it leaves the index.
                if run_id in self._missing:
                    await self.store.leave_active(run_id)
                else:
                    missing.add(run_id)
                continue
            record = stored.record
            if _ended(stored) and record.outbox:  # indexed while it ran
                await self._settle_end(stored)
                await self.store.leave_active(run_id)
                continue
            unindexed = False  # written flagged, by this pass, after the index was read
            if record.outbox:
                since = record.outbox_since.ToNanoseconds() / 1e9
                if now - since >= self.config.outbox_grace:
                    # Published already, as a rule; cleared here, long before
                    # the duplicate window would let a publish count twice.
                    mine = self._written.get(run_id)
                    published = mine is not None and mine.revision == stored.revision
                    self.counters["outbox_cleared" if published else "outbox_recovered"] += 1
                    stored, unindexed = await self._clear(stored, entry, published=published)
                    record = stored.record
                    if published and not record.outbox:  # nothing in it left to publish
                        self._remember(stored)
            if not self.store.needs_reconciler(record):  # finished for good
                await self.store.leave_active(run_id)
                continue
            if record.run.status != pb.RUN_STATUS_RUNNING:
                continue
            run = convert.record_from_proto(record)
            if rules.parked(run, outbox=bool(record.outbox)):
                await self._park(stored, entry, written=unindexed)
                continue
            last = await self.store.last_history_seq(run_id)
            if last > applied and self._recovered.get(run_id) != last:
                # A report may be on its way, and its task is rightly gone; or
                # an engine took an event and died before applying it.
                if self._unapplied.get(run_id) == last:
                    if await self._recover(run_id, after=applied):
                        recovered[run_id] = last
                    else:
                        unapplied[run_id] = last  # tried again on the next pass
                else:
                    unapplied[run_id] = last
                continue
            if last > applied:
                recovered[run_id] = last  # applied here; the floor is held elsewhere
            for key in await self._stranded(run):
                seen.add(key)
                if key in self._suspects:
                    run_id, step_id, iteration, attempt = key
                    self.counters["redispatched"] += 1
                    log.warning("run %s step %s: task vanished; dispatching again", run_id, step_id)
                    await self.apply(
                        run_id,
                        m.TaskVanished(step_id=step_id, iteration=iteration, attempt=attempt),
                    )
        self._suspects = seen
        self._missing = missing
        self._unapplied = unapplied
        self._recovered = recovered

    def _end_published(self, written: StoredRun) -> None:
        """This engine published the outbox of ``written``, a run's end."""
        run_id = written.record.run.run_id
        self._ends_published[run_id] = written.revision
        self._ends_published.move_to_end(run_id)
        while len(self._ends_published) > ENDS_PUBLISHED:
            self._ends_published.popitem(last=False)

    async def _settle_end(self, stored: StoredRun) -> None:
        """What a reconciler pass does for an ended run whose write holds an
        outbox: publish it, unless this engine published it after that write,
        and write nothing. An ended run never changes again, so its outbox
        is never cleared: nothing else publishes it again (``transition``
        and ``flush`` leave an ended run's alone), and the pass that reads
        the write that ended the run is the one the reconciler owes it; a
        publish beside its writer's is deduplicated by Msg-Id."""
        run_id = stored.record.run.run_id
        if self._ends_published.pop(run_id, None) == stored.revision:
            return
        self.counters["end_outbox_published"] += 1
        await self.publish_outbox(stored)

    async def _recover(self, run_id: str, *, after: int) -> bool:
        """Apply the run's events after the ack floor ``after``, which stood a
        whole pass unacknowledged: an engine that took one died, and its
        redelivery would wait out ``history_ack_wait``.

        Some were applied already (the floor is the oldest event still
        unacknowledged, of any run). Applying those again changes nothing: a
        report names its dispatch, which has moved on; a cancel, a child's end
        or a child's start find them done. An input arrival is applied only if
        inputs are queued, as the engine's own check does. Reports without a
        dispatch identity are left to the redelivery: applied twice they could
        advance a loop twice.

        Returns:
            Whether every event was applied (or left alone on purpose).
        """
        self.counters["history_recovered"] += 1
        done = True
        log.warning("run %s: events past seq %d stood unapplied; applying them", run_id, after)
        async for seq, data in self.store.history_after(run_id, after):
            try:
                event = ipb.HistoryEvent.FromString(data)
                kind = event.WhichOneof("kind")
                if kind == "input":
                    if self.inputs is None or not await self.inputs.queued(
                        event.run_id, event.step_id, self.clock()
                    ):
                        continue
                elif kind in _REPORTS and event.attempt <= 0:
                    continue
                parent = tracing.extract(dict(event.trace_context))
                with tracing.span(f"engine recover {kind}", parent):
                    await self._apply_event(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("run %s: could not apply history event %d", run_id, seq)
                done = False
        return done

    async def _clear(
        self, stored: StoredRun, entry: int, *, published: bool
    ) -> tuple[StoredRun, bool]:
        """Publish a run's outbox (unless ``published``) and clear it, flagged
        ``unindexed`` if that leaves the run parked: the one write then serves
        both (see :meth:`_park`). The run as it is now, and whether this
        wrote it flagged."""
        if not published:
            await self.publish_outbox(stored)
        run = convert.record_from_proto(stored.record)
        park = rules.parked(run, outbox=False)
        cleared = await self._rewrite(stored, clear=True, parking=entry if park else 0)
        if cleared is None:
            latest = await self.store.load_run(stored.record.run.run_id)
            return (latest if latest is not None else stored), False
        return cleared, park

    async def _park(self, stored: StoredRun, entry: int, *, written: bool) -> None:
        """Take a parked run out of the active-run index.

        First a write of the run flagged ``unindexed``, at the revision read
        (``written``: this pass's clear of its outbox was that write), then
        the index entry of revision ``entry``, read before the run, is purged,
        and only that one. The flagged write names that entry
        (``parked_entry``), and so does every later write of the run, each
        decided on it or on a later one. A write that wakes the run either
        lands before the flagged one, which then misses and nothing leaves
        the index; or it clears the flag, and the next reconciler pass that
        reads it enters the run again, unless the index holds a newer entry
        (``EngineStore.indexed_runs``). A crash between the write and
        the purge leaves the run indexed, and the next pass parks it again.
        """
        if not written:
            flagged = await self._rewrite(stored, clear=False, parking=entry)
            if flagged is None:
                return  # it changed: the next pass looks again
            stored = flagged
        run_id = stored.record.run.run_id
        if (mine := self._written.get(run_id)) is not None and mine.revision != stored.revision:
            self._forget(run_id)  # a guess that would miss
        await self.store.leave_active(run_id, through=entry)
        self.counters["parked"] += 1

    async def _stranded(self, run: m.Run) -> list[tuple[str, str, int, int]]:
        """The running steps whose current dispatch has no task in flight."""
        found = []
        for step, task_type in rules.awaiting_a_task(run):
            build = rules.pinned_build(run, step)
            subject = task_subject(task_type, run.run_id, step.step_id, build)
            unpinned = task_subject(task_type, run.run_id, step.step_id) if build else ""
            prefix = convert.task_msg_id(run.run_id, step.step_id, step.iteration, step.attempt)
            kept, on = step.kept_seq, unpinned
            if not await self.store.task_in_flight(subject, prefix, kept_seq=kept, kept_on=on):
                found.append((run.run_id, step.step_id, step.iteration, step.attempt))
        return found


def _ended(stored: StoredRun) -> bool:
    """Whether the run, as stored, has ended: it never changes again."""
    return stored.record.run.status in FINAL_RUN_STATUSES


def _decision(event: ipb.HistoryEvent, run: m.Run | None) -> bytes | None:
    """What the sender of a journal commit's event is told once ``run`` is
    stored with it applied (ADR 33): of a task message kept across the commit,
    the dispatch it carries on to, or that it carries none (ADR 31); of any
    other, that the task may go (``done``). None for a kept message the
    report left carrying the reported dispatch: nothing is told, and the
    holder's lease decides."""
    if not event.kept_seq:
        return ipb.EventDecision(done=True).SerializeToString()
    reported = m.Identity(iteration=event.iteration, attempt=event.attempt)
    step = run.step(event.step_id) if run is not None and run.has_step(event.step_id) else None
    kept = run is not None and rules.kept_decision(step, run.status, event.kept_seq, reported)
    if kept is None:
        return None
    decision = ipb.EventDecision(done=not kept)
    if kept and run is not None and step is not None:
        task = rules.dispatch_task(run, step)
        decision.next.CopyFrom(convert.task_to_proto(task, _trace_headers()))
    return decision.SerializeToString()


def _is_commit_event(event: ipb.HistoryEvent) -> bool:
    """Whether a direct event is what only the journal sends that way: a
    stored commit's event, with its dispatch identity and a notice subject.
    Anything else must come on the durable history."""
    kind = event.WhichOneof("kind") or ""
    return kind in _REPORTS and event.attempt > 0 and bool(event.notify)


def _trace_headers() -> dict[str, str]:
    """The current trace context, for a message that carries out an effect."""
    headers: dict[str, str] = {}
    tracing.inject(headers)
    return headers
