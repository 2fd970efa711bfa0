"""Many runs waiting for a person, and the newest of them listed: each run
waits holding no worker; a page of the newest costs the page, however many
wait or how often they were rewritten since.

    python docs/examples/many_waiting.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, InputsQueued, TaskContext, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
WORKFLOW = {
    "name": "ticket",
    "steps": [{"id": "triage", "type": "agent_loop", "task": "ticket"}],
}


async def ticket(tc: TaskContext) -> None:
    """Triage a ticket, then wait for a person's answer, holding no worker."""
    if tc.iteration == 0:
        try:
            await tc.continue_({"triaged": tc.input["ticket"]}, until_input=True, delay=3600)
        except InputsQueued:  # answered already: the next turn takes it
            await tc.continue_({"triaged": tc.input["ticket"]})
        return
    await tc.complete("answered")


async def main(engine: str = ENGINE, tickets: int = 20) -> dict[str, Any]:
    async with Worker(engine, handlers={"ticket": ticket}), Client(engine) as client:
        await client.register_workflow(WORKFLOW)
        started = [(await client.start_run("ticket", {"ticket": n})).run_id for n in range(tickets)]
        await client.cancel_run(started[0], "duplicate")
        # --8<-- [start:list]
        newest = await client.list_runs(workflow="ticket", limit=5)  # newest first
        for run in newest:
            print(run.run_id, pb.RunStatus.Name(run.status))
        # Filters: by workflow and by status; at most `limit` (1 to 10,000).
        cancelled = await client.list_runs(
            workflow="ticket", status=pb.RUN_STATUS_CANCELLED, limit=10
        )
        # --8<-- [end:list]
        return {"started": started, "newest": newest, "cancelled": cancelled}


if __name__ == "__main__":
    asyncio.run(main())
