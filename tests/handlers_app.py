"""Handlers for ``--handlers tests.handlers_app:HANDLERS`` in the tests."""

from __future__ import annotations

from typing import Any

from dagnats.sdk import TaskContext


async def echo(tc: TaskContext) -> None:
    """Two journaled iterations: a model call each, then the input echoed."""
    j = await tc.journal()
    i = tc.iteration

    async def model() -> dict[str, Any]:
        return {"turn": i}

    await j.model(model)
    if i == 0:
        await tc.continue_()
    else:
        await tc.complete({"echo": tc.input["say"], "iterations": i + 1})


HANDLERS = {"hosted-echo": echo}
NOT_A_MAPPING = echo
