"""Following a step's journal until the step has finished.

A step that has finished (it completed, failed or was cancelled, or its run
ended) writes no more records, so a follower can stop: once the step is seen
finished, the journal's tail is read (after the status, so no record the step
wrote before it finished is left out), and when every record up to that tail
was delivered, :func:`follow_step` yields one :class:`Ending` and stops.

The run's watch (``Client.watch_run``: the run now, then each change) says
when the step has finished or its run ended, a cancel included, which writes
no commit; nothing polls. The HTTP gateway's journal events and ``dagnats
journal read --follow`` both follow this way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dagnats.core.errors import DagnatsError
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._client import Client
from dagnats.sdk._journal_client import JournalClient

# Seconds of silence after which a follower is handed a None for its upkeep.
POLL_SECONDS = 5.0

_FINAL_STEP = frozenset(
    {epb.STEP_STATUS_COMPLETED, epb.STEP_STATUS_FAILED, epb.STEP_STATUS_CANCELLED}
)
_DONE = object()


@dataclass(frozen=True, slots=True, kw_only=True)
class Ending:
    """The step finished and every record was delivered."""

    run_status: epb.RunStatus.ValueType
    step_status: epb.StepStatus.ValueType


async def follow_step(
    client: Client,
    journal: JournalClient,
    run_id: str,
    step_id: str,
    *,
    from_seq: int = 0,
    poll: float = POLL_SECONDS,
) -> AsyncIterator[jpb.Record | Ending | None]:
    """Yield the step's records from ``from_seq`` on as they are written, then
    one :class:`Ending` once the step has finished. ``None`` is yielded every
    ``poll`` seconds while nothing arrives, so a caller can do its own upkeep.

    Raises:
        DagnatsError: a service failed the read or the run's watch.
    """
    queue: asyncio.Queue[jpb.Record | DagnatsError | object] = asyncio.Queue(256)

    async def pump() -> None:
        try:
            async for record in journal.read(run_id, step_id, from_seq=from_seq, follow=True):
                await queue.put(record)
        except DagnatsError as err:
            await queue.put(err)
        await queue.put(_DONE)

    async def watch() -> None:
        try:
            async for run in client.watch_run(run_id):
                if _step_finished(run, step_id):
                    await queue.put(run)
                    return
        except DagnatsError as err:
            await queue.put(err)

    reader = asyncio.create_task(pump(), name=f"journal-follow-{run_id}-{step_id}")
    watcher = asyncio.create_task(watch(), name=f"journal-follow-run-{run_id}")
    sent = max(from_seq, 1) - 1  # the last sequence delivered, or the one before the cursor
    ending: tuple[Ending, int] | None = None
    try:
        while True:
            if ending is not None and sent >= ending[1]:
                yield ending[0]
                return
            try:
                item = await asyncio.wait_for(queue.get(), poll)
            except TimeoutError:
                yield None
                continue
            if isinstance(item, epb.Run):
                ending = await _ending(journal, item, step_id, after=sent)
                continue
            if item is _DONE:
                return
            if isinstance(item, DagnatsError):
                raise item
            assert isinstance(item, jpb.Record)
            sent = item.seq
            yield item
    finally:
        for task in (reader, watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _step_finished(run: epb.Run, step_id: str) -> bool:
    step = next((s for s in run.steps if s.step_id == step_id), None)
    return run.status != epb.RUN_STATUS_RUNNING or (step is not None and step.status in _FINAL_STEP)


async def _ending(
    journal: JournalClient, run: epb.Run, step_id: str, *, after: int
) -> tuple[Ending, int]:
    """The ending of a step that ``run`` shows finished, and the last sequence
    of its journal, read after that state was stored."""
    step = next((s for s in run.steps if s.step_id == step_id), None)
    tail = after
    async for record in journal.read(run.run_id, step_id, from_seq=after + 1):
        tail = record.seq
    status = step.status if step is not None else epb.STEP_STATUS_PENDING
    return Ending(run_status=run.status, step_status=status), tail
