"""What the inputs service needs of the engine, as the inputs see it.

Whether a step still takes inputs, and whether a placed input is ``done``,
depend on the run; a get that waits follows the run as well as the input.
A submitted input wakes a step that waits for one: an event on the run's
history. The runs bucket and the history stream are the engine's; the
engine implements this (``dagnats.engine.runs.Runs``) and the server
process wires it in, so the inputs' package never imports the engine's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.engine.v1 import internal_pb2 as eipb


class Runs(Protocol):
    async def get_run(self, run_id: str) -> epb.Run | None:
        """The run now: as stored, caught up with the kept iterations its
        journal holds (``dagnats.engine.runs``); None when there is none."""
        ...

    def follow_run(self, run_id: str) -> AsyncGenerator[epb.Run | None, None]:
        """The run now (None when there is none), then after every change
        (None once it is purged), each caught up, until the iterator is closed."""
        ...

    async def publish_event(self, event: eipb.HistoryEvent, msg_id: str) -> None:
        """Append ``event`` to its run's history, deduplicated by ``msg_id``."""
        ...
