"""Fork a run with another model, and compare: the same journal up to a
record, then each run on its own.

    python docs/examples/fork_and_diff.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import os
from typing import Any

from dagnats.sdk import Client, JournalClient, Replay, TaskContext, ToolCall, ToolRun, Worker
from dagnats.sdk.diff import diff_runs, format_diff
from dagnats.sdk.views import record_dict, run_dict

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
CALLS: list[str] = []  # which model answered each call


def stand_in(name: str) -> Any:
    """A stand-in for a model called ``name``: it searches, then answers."""

    async def call(history: list[Any]) -> dict[str, Any]:
        CALLS.append(name)
        if len(history) == 1:
            return {"tool": "search", "input": {"q": history[0]}}
        return {"answer": f"{name} says: {history[-1]['found']}"}

    return call


MODELS = {"small": stand_in("small"), "large": stand_in("large")}


async def search(run: ToolRun) -> dict[str, Any]:
    return {"found": f"3 results for {run.call.input['q']}"}


# --8<-- [start:handler]
async def agent(tc: TaskContext) -> None:
    model = MODELS[tc.settings.get("model", "small")]  # the run's settings
    j = await tc.journal()
    history = await tc.load_checkpoint() or [tc.input]
    reply = await j.model(lambda: model(history))
    if "answer" in reply:
        await tc.complete(reply["answer"])
        return
    result = await j.tool(ToolCall(name=reply["tool"], input=reply["input"]), Replay.SAFE, search)
    await tc.checkpoint([*history, reply, result.output])
    await tc.continue_()


# --8<-- [end:handler]


WORKFLOW = {"name": "fork-demo", "steps": [{"id": "agent", "type": "agent_loop", "task": "fork"}]}


async def main(engine: str = ENGINE) -> tuple[str, str, list[str]]:
    """Run the agent on the small model, fork it after its search with the
    large one; both answers, the diff as text, and the models called."""
    async with (
        Client(engine) as client,
        JournalClient(engine) as journal,
        Worker(engine, handlers={"fork": agent}),
    ):
        await client.register_workflow(WORKFLOW)
        # --8<-- [start:fork]
        run = await client.start_run("fork-demo", "durable agents", settings={"model": "small"})
        first = await client.wait_for_run(run.run_id)
        records = [r async for r in journal.read(run.run_id, "agent")]
        commit = next(r for r in records if r.HasField("commit"))  # the end of iteration 0
        forked = await client.fork_run(run.run_id, "agent", commit.seq, settings={"model": "large"})
        second = await client.wait_for_run(forked.run.run_id)
        # --8<-- [end:fork]
        # --8<-- [start:diff]
        journals = {}
        for r in (first, second):
            journals[r.run_id] = {
                "agent": [record_dict(x) async for x in journal.read(r.run_id, "agent")]
            }
        found = diff_runs(
            run_dict(first), run_dict(second), journals[first.run_id], journals[second.run_id]
        )
        print(format_diff(found))
        # --8<-- [end:diff]
    return first.output.decode(), second.output.decode(), list(CALLS)
