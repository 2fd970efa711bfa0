"""Runs whose every change the test causes: each step's handler waits for a
gate the test opens, so the changes of the run come one at a time, in an
order the test knows."""

from __future__ import annotations

import asyncio
from typing import Any

from dagnats.sdk import PermanentError, TaskContext


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
