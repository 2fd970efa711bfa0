"""A conversation of any length: each turn appends to the state, and the
journal stores what the turn added, not the history again.

    python docs/examples/long_conversation.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, JournalClient, TaskContext, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
TURNS = 300


async def read_file(turn: int) -> str:
    """A stand-in for a tool whose output joins the history: 20 KB a turn."""
    return f"file {turn}: " + "x" * 20_000


# --8<-- [start:handler]
async def reader(tc: TaskContext) -> None:
    j = await tc.journal()
    state = await tc.load_checkpoint()  # the whole state, as it always was
    turn = len(state["messages"]) if state is not None else 0
    output = await j.model(lambda: read_file(turn))
    # Append: the commit stores this turn's message (and the fields set),
    # not the history again; the worker keeps the whole state in memory.
    await tc.append_state("messages", [{"role": "tool", "content": output}], turns=turn + 1)
    if turn + 1 == TURNS:
        await tc.complete({"turns": turn + 1})
    else:
        await tc.continue_()


# --8<-- [end:handler]


WORKFLOW = {
    "name": "reader",
    "steps": [
        {
            "id": "read",
            "type": "agent_loop",
            "task": "reader",
            "agent_loop": {"max_iterations": TURNS},
        }
    ],
}


# --8<-- [start:main]
async def main(engine: str = ENGINE) -> dict[str, Any]:
    async with Client(engine) as client, Worker(engine, handlers={"reader": reader}):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("reader")
        done = await client.wait_for_run(run.run_id, timeout=120)
        assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    async with JournalClient(engine) as journal:
        commits = [r.commit async for r in journal.read(run.run_id, "read") if r.HasField("commit")]
        state = json.loads(await journal.state(run.run_id, "read") or b"null")
        check = await journal.check(run.run_id)
    stored = sum(len(c.state) + len(c.state_delta.tail) for c in commits)
    whole = len(json.dumps(state, separators=(",", ":")))
    print(f"{len(state['messages'])} messages, a state of {whole:,} bytes")
    print(f"the commits stored {stored:,} bytes of state in all")
    print(f"journal check: {len(check.violations)} violations")
    return {
        "turns": len(commits),
        "state": whole,
        "stored": stored,
        "violations": len(check.violations),
    }


if __name__ == "__main__":
    asyncio.run(main())
# --8<-- [end:main]
