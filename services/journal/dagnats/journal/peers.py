"""What the journal service needs of the engine, as the journal sees it.

A claim of iteration 0 checks that its run has not ended (a purge would have
reset the step's fence), a read names a run that must exist, and the audit
compares the engine's steps with the journal: all read the run. A commit, or
a claim answered ``settled``, that carries its task's lease settles that task
behind the answer: the commit's lifecycle event on the run's history, then
the lease released (or handed back at once when that failed).

The runs bucket and the history and task streams are the engine's; the engine
implements these (``dagnats.engine.runs.Runs`` and
``dagnats.engine.report.TaskSettler``) and the server process wires them in,
so the journal's package never imports the engine's.
"""

from __future__ import annotations

from typing import Protocol

from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.journal.v1 import journal_pb2 as pb


class Runs(Protocol):
    async def get_run(self, run_id: str) -> epb.Run | None:
        """The run now: as stored, caught up with the kept iterations its
        journal holds (``dagnats.engine.runs``); None when there is none."""
        ...


class Tasks(Protocol):
    async def settle(self, lease: str, commit: pb.Record, *, wait: float) -> None:
        """Send the stored ``commit``'s lifecycle event to the engine by its
        route (on the history when no engine answers within its share of
        ``wait`` seconds: the commit wait), then release the task."""
        ...

    async def keep(self, lease: str, commit: pb.Record, *, wait: float) -> epb.Task | None:
        """Send the stored continue ``commit``'s event keeping the task
        message for the next iteration to the engine by its route (on the
        history when no engine answers within its share); the next dispatch
        it carries once the engine decided within ``wait`` seconds, else None
        (the message was released if it carries no current dispatch, or is
        left to its lease)."""
        ...

    async def release(self, lease: str) -> None:
        """Release the task with nothing to report (a stale delivery)."""
        ...

    async def redeliver(self, lease: str) -> None:
        """Hand the task back at once, for its next claim to settle."""
        ...
