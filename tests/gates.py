"""Runs whose every change the test causes: each step's handler waits for a
gate the test opens, so the changes of the run come one at a time, in an
order the test knows. :func:`engine_counting_get_runs` starts an engine
that counts the ``GetRun`` calls it serves, to show that a wait polls none
(and the ``StartRun`` and ``WatchRun`` calls, to show what ``Client.run`` makes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.service import EngineServicer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import PermanentError, TaskContext
from tests.stack import FAST


class Gates:
    """One gate per step id: its handler completes (or fails, when the step is
    in ``failing``) once the test opens the gate."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.failing: set[str] = set()

    def open(self, *step_ids: str) -> None:
        for step_id in step_ids:
            self.gate(step_id).set()

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    def gate(self, step_id: str) -> asyncio.Event:
        return self.gates.setdefault(step_id, asyncio.Event())

    async def handle(self, tc: TaskContext) -> None:
        await self.gate(tc.step_id).wait()
        if tc.step_id in self.failing:
            raise PermanentError("told to fail")
        await tc.complete({"step": tc.step_id})


def two_steps(name: str, task: str) -> dict[str, Any]:
    """A workflow of two task steps, ``first`` then ``second``."""
    return {
        "name": name,
        "steps": [
            {"id": "first", "task": task},
            {"id": "second", "task": task, "depends_on": ["first"]},
        ],
    }


@contextlib.asynccontextmanager
async def engine_counting_get_runs(
    nats_url: str, calls: Counter[str], methods: Counter[str] | None = None
) -> AsyncIterator[EngineServer]:
    """An engine that adds each ``GetRun`` it serves to ``calls``, by run id,
    and each ``StartRun`` and ``WatchRun`` to ``methods``, by name. The
    servicer's methods are bound when the server starts, so the count is
    installed before it."""
    served = EngineServicer.GetRun
    start, watch = EngineServicer.StartRun, EngineServicer.WatchRun
    seen = Counter[str]() if methods is None else methods

    async def counted(self: EngineServicer, request: pb.GetRunRequest, context: Any) -> Any:
        calls[request.run_id] += 1
        return await served(self, request, context)

    async def started(self: EngineServicer, request: pb.StartRunRequest, context: Any) -> Any:
        seen["StartRun"] += 1
        return await start(self, request, context)

    async def watched(
        self: EngineServicer, request: pb.WatchRunRequest, context: Any
    ) -> AsyncIterator[Any]:
        seen["WatchRun"] += 1
        async for response in watch(self, request, context):
            yield response

    EngineServicer.GetRun = counted  # type: ignore[method-assign]
    EngineServicer.StartRun = started  # type: ignore[method-assign]
    EngineServicer.WatchRun = watched  # type: ignore[method-assign]
    try:
        server = await start_engine(nats_url, config=FAST)
    finally:
        EngineServicer.GetRun = served  # type: ignore[method-assign]
        EngineServicer.StartRun = start  # type: ignore[method-assign]
        EngineServicer.WatchRun = watch  # type: ignore[method-assign]
    try:
        yield server
    finally:
        await server.stop()
