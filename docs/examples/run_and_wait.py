"""Start a run and wait for it: its output in one call, or every change of
the run as it happens, then the finished run.

    python docs/examples/run_and_wait.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

# --8<-- [start:imports]
from dagnats.sdk import Client, RunFailed, TaskContext, Worker

# --8<-- [end:imports]

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
WORKFLOW = {
    "name": "demo-agent",
    "steps": [
        {
            "id": "agent",
            "type": "agent_loop",
            "task": "demo-agent",
            "retry": {"max_attempts": 1},  # a failure fails the run at once
        }
    ],
}


async def demo(tc: TaskContext) -> None:
    """A stand-in agent: it answers, or fails when asked to."""
    if tc.input.get("fail"):
        raise RuntimeError("asked to fail")
    await tc.complete({"answer": f"you said {tc.input['question']!r}"})


async def main(engine: str = ENGINE) -> dict[str, Any]:
    async with Worker(engine, handlers={"demo-agent": demo}):
        async with Client(engine) as setup:
            await setup.register_workflow(WORKFLOW)
        # --8<-- [start:client]
        async with Client(engine) as client:
            answer = await client.run("demo-agent", {"question": "hi"}, timeout=60)  # its output

            run = await client.start_run("demo-agent", {"question": "again?"})
            async for state in client.watch_run(run.run_id):  # now, every change, the end
                print(state.status, [s.status for s in state.steps])
            done = await client.wait_for_run(run.run_id, timeout=60)  # the finished run
            # --8<-- [end:client]
            try:
                await client.run("demo-agent", {"fail": True}, timeout=60)
            except RunFailed as failed:
                print(f"{failed.status}: {failed.error}")
                return {"answer": answer, "done": done, "failed": failed}
    raise AssertionError("the failing run did not fail")


if __name__ == "__main__":
    asyncio.run(main())
