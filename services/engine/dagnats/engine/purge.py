"""Purging an ended run and everything of it: on request (``PurgeRun``), and
when its retention after its end is over (the purge timer its end set,
``model.PurgeLater``).

Nothing of a running run is purged, whoever asks: a purge resets the fence of
every journal subject it empties (docs/architecture.md, F4), and a live run
would wake with its state of record gone. The retention therefore counts from
a run's end, never during its life: no stream or bucket that holds a run's
state expires anything by age.
"""

from __future__ import annotations

from dagnats.core import errors
from dagnats.core import jetstream as jsx
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.core.subjects import history_subject, purge_timer_subject, run_tasks, run_timers
from dagnats.engine.store import EngineStore
from dagnats.inputs.store import InputStore
from dagnats.journal.store import JournalStore


async def purge_run(
    store: EngineStore,
    journal: JournalStore | None,
    inputs: InputStore | None,
    run_id: str,
    *,
    asked: bool,
) -> bool:
    """Remove an ended run and everything of it: its child runs that ended,
    checkpoints, inputs, history, timers, tasks, journal, idempotency key,
    and last the run itself (so a purge cut short is done again in full by
    the next one). Whether it purged anything.

    ``asked``: a caller asked for this run (``PurgeRun``), and is told why
    nothing was purged. Otherwise (a purge timer, a child of a purged run) a
    run that is gone, or still running, is left as it is; a child still
    ending is purged by its own timer.

    Raises:
        NotFound: ``asked``, and there is no such run.
        Conflict: ``asked``, and the run is still running.
    """
    stored = await store.load_run(run_id)
    if stored is None:
        if asked:
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        return False
    run = stored.record.run
    if run.status not in FINAL_RUN_STATUSES:
        if asked:
            raise errors.Conflict(f"run {run_id} is still running; cancel it before purging")
        return False
    for step in run.steps:
        if step.child_run_id:
            await purge_run(store, journal, inputs, step.child_run_id, asked=False)
        await store.delete_checkpoint(run_id, step.step_id)
    if inputs is not None:
        await inputs.purge_run(run_id)
    await store.purge_subject(jsx.HISTORY, history_subject(run_id))
    await store.purge_subject(jsx.TIMERS, run_timers(run_id))
    await store.purge_subject(jsx.TASKS, run_tasks(run_id))
    if journal is not None:
        await journal.purge(run_id)
    if run.idempotency_key:
        await store.release_run_key(run.workflow, run.idempotency_key, run_id)
    await store.delete_run(run_id)
    # Its purge timer last: a purge cut short before here is done again when
    # the timer comes back. A purge asked for leaves no timer to fire later.
    await store.purge_subject(jsx.TIMERS, purge_timer_subject(run_id))
    return True
