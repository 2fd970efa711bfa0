"""Steering, follow-ups and waiting for a person: an agent drafts a reply,
then waits, holding no worker, until a person approves it or asks for more.

    python docs/examples/steering.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, InputMode, InputsQueued, TaskContext, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")


async def write_draft(state: dict[str, Any]) -> str:
    """A stand-in for a model call: the topic and every note so far."""
    return " / ".join([state["topic"], *state["notes"]])


# --8<-- [start:handler]
async def writer(tc: TaskContext) -> None:
    j = await tc.journal()
    state = await tc.load_checkpoint() or {"topic": tc.input, "notes": [], "draft": None}
    placed = await tc.place_inputs(InputMode.STEER)  # sent while the agent works
    if state["draft"] is not None:  # woken after a draft: a person answered it
        placed += await tc.place_inputs(InputMode.FOLLOW_UP)
    for p in placed:
        if p.content == "approve":
            await tc.complete(state["draft"])
            return
        state["notes"].append(p.content)
    state["draft"] = await j.model(lambda: write_draft(state))
    await tc.checkpoint(state)
    try:  # wait for a person: no worker is held, for up to an hour
        await tc.continue_(state["draft"], until_input=True, delay=3600)
    except InputsQueued:  # someone answered already: the next turn places it
        await tc.continue_(state["draft"])


# --8<-- [end:handler]


WORKFLOW = {
    "name": "writer",
    "steps": [{"id": "draft", "type": "agent_loop", "task": "writer"}],
}


# --8<-- [start:waiting]
async def draft_awaiting_reply(client: Client, run_id: str, containing: str) -> str:
    """The draft, once the step waits for a person with one that says ``containing``."""
    async for run in client.watch_run(run_id):  # the run now, then every change
        step = run.steps[0]
        if step.waiting_for_input and containing in json.loads(step.output or b"null"):
            return str(json.loads(step.output))
    raise RuntimeError(f"the run ended first: {run.error}")


# --8<-- [end:waiting]


# --8<-- [start:main]
async def main(engine: str = ENGINE) -> Any:
    async with Client(engine) as client, Worker(engine, handlers={"writer": writer}):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("writer", "Lisbon weather for ops")
        # Steer it while it works (or waits): it joins the next turn.
        await client.submit_input(run.run_id, "draft", "r-1", "in celsius", mode=InputMode.STEER)
        print("draft:", await draft_awaiting_reply(client, run.run_id, "in celsius"))

        # A person asks for more: a follow-up wakes the waiting step.
        await client.submit_input(
            run.run_id, "draft", "r-2", "add the sky", mode=InputMode.FOLLOW_UP
        )
        print("draft:", await draft_awaiting_reply(client, run.run_id, "add the sky"))

        await client.submit_input(run.run_id, "draft", "r-3", "approve", mode=InputMode.FOLLOW_UP)
        done = await client.wait_for_run(run.run_id, timeout=60)
        assert done.status == pb.RUN_STATUS_COMPLETED, done.error
        answer = json.loads(done.output)
        print("approved:", answer)
        return answer


if __name__ == "__main__":
    asyncio.run(main())
# --8<-- [end:main]
