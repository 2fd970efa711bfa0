"""Replay recorded runs against new code: record a few runs of an agent,
export their journals, then replay the agent as it is (it passes) and a
version that calls its tool before the model (it diverges), calling no model
and no tool.

    python docs/examples/replay_in_ci.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dagnats.sdk import Client, JournalClient, Replay, TaskContext, ToolCall, ToolRun, Worker
from dagnats.sdk.export import open_export
from dagnats.sdk.testing import ReplayReport, replay

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")


async def model(question: str) -> dict[str, Any]:
    """A stand-in for a model: it asks for the weather."""
    return {"tool": "weather", "input": {"city": question.split()[-1]}}


async def weather(run: ToolRun) -> dict[str, Any]:
    return {"city": run.call.input["city"], "celsius": 21}


# --8<-- [start:handler]
async def triage(tc: TaskContext) -> None:
    j = await tc.journal()
    ask = await j.model(lambda: model(tc.input["question"]))
    found = await j.tool(ToolCall(name=ask["tool"], input=ask["input"]), Replay.SAFE, weather)
    await tc.complete(found.output)


# --8<-- [end:handler]


# --8<-- [start:changed]
async def triage_v2(tc: TaskContext) -> None:
    """The new code: it looks the weather up before asking the model."""
    j = await tc.journal()
    city = tc.input["question"].split()[-1]
    found = await j.tool(ToolCall(name="weather", input={"city": city}), Replay.SAFE, weather)
    await j.model(lambda: model(tc.input["question"]))
    await tc.complete(found.output)


# --8<-- [end:changed]


# --8<-- [start:test]
async def test_the_new_code_replays_the_recorded_runs() -> None:
    report = await replay("recorded/", {"triage": triage_v2})
    assert report.ok, "\n".join(report.lines())


# --8<-- [end:test]


WORKFLOW = {
    "name": "triage",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "triage"}],
}


async def record(engine: str, directory: Path, runs: int = 3) -> None:
    """Run the agent ``runs`` times and export each run's journal into ``directory``
    (as ``dagnats journal export RUN -o directory/RUN.jsonl`` does)."""
    async with (
        Client(engine) as client,
        JournalClient(engine) as journal,
        Worker(engine, handlers={"triage": triage}),
    ):
        await client.register_workflow(WORKFLOW)
        for city in ["Lisbon", "Porto", "Faro"][:runs]:
            run = await client.start_run("triage", {"question": f"How warm is {city}"})
            await client.wait_for_run(run.run_id, timeout=60)
            export = await open_export(client, journal, run.run_id)
            with (directory / f"{run.run_id}.jsonl").open("w") as out:
                async for line in export.lines(journal):
                    out.write(line)


async def main(engine: str = ENGINE, directory: Path | None = None) -> tuple[ReplayReport, ...]:
    """Record, then replay both versions: their reports."""
    directory = directory or Path(tempfile.mkdtemp(prefix="recorded-"))
    await record(engine, directory)
    same = await replay(directory, {"triage": triage})
    changed = await replay(directory, {"triage": triage_v2})
    return same, changed


if __name__ == "__main__":
    same, changed = asyncio.run(main())
    print("\n".join(same.lines()))
    print("\n".join(changed.lines()))
    sys.exit(0 if same.ok and not changed.ok else 1)
