"""The run now: a run as stored, caught up with its journal.

A loop on a kept task may have iterations an engine decided and has not
written to the runs bucket yet (a kept iteration is written with the run's
next change): the journal's continue commits hold them, so the bucket alone
can be a few iterations behind. Every reader of a run outside the engine's
own decision reads it here, caught up: ``GetRun``, each state a watch sends,
the journal service (a claim of iteration 0, reads, the audit) and the
inputs service (is the step open, is a placed input done). The raw bucket
read stays the engine store's own (``EngineStore.load_run``), for the
engine's decisions, which catch up themselves (``Engine.transition``).

Catching up reads the journal's last record of each step that runs on a
kept message. If it is of a later iteration than the run's, the reader walks
back the chain of continue commits (each record names the commit that ended
the iteration before it, ``base_seq``) to the run's iteration and applies
each, in order, through the same rules as its event (``rules.catch_up``).
Only commits with a record after them are applied: that record proves an
engine decided the commit. The last commit, with nothing after it, is left to
its own event unless the caller asks for it (``through_last``).

:class:`Runs` is what the other services' ports of the engine are given
(``dagnats.journal.peers.Runs``, ``dagnats.inputs.peers.Runs``), in one
process or apart: it needs only the runs bucket and the journal's stream.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable

from dagnats.engine import convert, rules
from dagnats.engine import model as m
from dagnats.engine.report import commit_event
from dagnats.engine.store import EngineStore, StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.journal.store import JournalStore, Written

log = logging.getLogger(__name__)

CATCH_UP_MAX = 1024  # kept iterations a reader applies from the journal at most


class Runs:
    """The runs as they are now: each read of the bucket caught up with the
    journal (``journal`` None: as stored, for a process with no journal).

    ``counters["kept_caught_up"]`` counts the iterations applied from the
    journal; an engine shares its counters with its reads."""

    def __init__(
        self,
        store: EngineStore,
        journal: JournalStore | None,
        *,
        options: m.RuleOptions = rules.DEFAULT_OPTIONS,
        clock: Callable[[], float] = time.time,
        counters: Counter[str] | None = None,
    ) -> None:
        self.store = store
        self.journal = journal
        self.options = options
        self.clock = clock
        self.counters: Counter[str] = counters if counters is not None else Counter()

    async def read(self, run_id: str) -> StoredRun | None:
        """The run now: as stored, caught up with its journal; None when
        there is none."""
        stored = await self.store.load_run(run_id)
        return None if stored is None else await self.caught_up_stored(stored)

    async def caught_up_stored(self, stored: StoredRun) -> StoredRun:
        """``stored`` caught up with its journal, at the same revision."""
        run = stored.run or convert.record_from_proto(stored.record)
        caught = await self.caught_up(run, stored.record)
        if caught is run:
            return stored
        record = convert.record_to_proto(caught, [], None, dict(stored.record.trace_context))
        record.unindexed = stored.record.unindexed
        record.parked_entry = stored.record.parked_entry
        return StoredRun(record, stored.revision)

    async def caught_up(
        self, run: m.Run, record: ipb.RunRecord, *, through_last: bool = False
    ) -> m.Run:
        """``run``, as read, with the kept iterations its journal holds past
        it applied. Only a step running on a kept message can be behind, and
        only while the run has no outbox.

        ``through_last``: the last commit too, which has no record after it
        to show that it was decided. A decision about the step's task, that
        it vanished, needs it: the commit's event may have been decided,
        unwritten, by an engine whose holder then lost the message before it
        wrote the next iteration's first record."""
        if self.journal is None or record.outbox or run.status is not m.RunStatus.RUNNING:
            return run
        for step in run.steps:
            if step.status is m.StepStatus.RUNNING and step.held_seq:
                run = await self._catch_up(run, step, through_last=through_last)
        return run

    # ---- the ports of the journal and inputs services --------------------------------

    async def get_run(self, run_id: str) -> pb.Run | None:
        """The run now (:meth:`read`), as the other services see it."""
        stored = await self.read(run_id)
        return stored.record.run if stored is not None else None

    async def follow_run(self, run_id: str) -> AsyncGenerator[pb.Run | None, None]:
        """The run now (None when there is none), then after every write of
        it, each caught up (None once purged), for the inputs' waits."""
        async for stored in self.store.follow_run(run_id):
            yield None if stored is None else (await self.caught_up_stored(stored)).record.run

    async def publish_event(self, event: ipb.HistoryEvent, msg_id: str) -> None:
        """Append ``event`` to its run's history (an input arrived)."""
        await self.store.publish_event(event, msg_id)

    # ---- the walk back --------------------------------------------------------------

    async def _catch_up(self, run: m.Run, step: m.Step, *, through_last: bool) -> m.Run:
        """Apply the continue commits of ``step`` that the journal holds past
        the run's iteration and that an engine decided (module docstring)."""
        assert self.journal is not None
        tail = await self.journal.last_written(run.run_id, step.step_id)
        if tail is None:
            return run
        last = tail.record
        if through_last and last.HasField("commit"):
            seq, want = last.seq, last.iteration
        else:
            seq, want = last.base_seq, last.iteration - 1
        if want < step.iteration:
            return run
        now = self.clock()
        reports: list[m.StepReport] = []
        while want >= step.iteration:
            if len(reports) >= CATCH_UP_MAX:
                log.warning("run %s step %s: too far behind its journal", run.run_id, step.step_id)
                return run
            if seq == last.seq:
                written: Written | None = tail
            else:
                written = await self.journal.written_at(run.run_id, step.step_id, seq)
            commit = written.record if written is not None else None
            if commit is None or commit.iteration != want or not commit.HasField("commit"):
                return run  # not a chain of kept iterations: left to the events
            event = commit_event(commit, now)
            event.held_seq = step.held_seq
            report = convert.event_to_input(event)
            assert isinstance(report, m.StepReport)
            reports.append(report)
            seq, want = commit.base_seq, want - 1
        reports.reverse()
        caught = rules.catch_up(run, reports, now, self.options)
        self.counters["kept_caught_up"] += caught.step(step.step_id).iterations - step.iterations
        return caught
