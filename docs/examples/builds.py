"""New handler code under runs in flight: two builds of a review agent.

Build 2026-12-01 drafts a reply and waits for a person; build 2026-12-06
changed the order of its calls. Runs that began on the old build finish on
it; a run whose build has no worker left waits until it is moved.

    python docs/examples/builds.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from typing import Any

from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker, run_output

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
OLD, NEW = "2026-12-01", "2026-12-06"
WORKFLOW = {
    "name": "review",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "review"}],
}


async def lookup(run: ToolRun) -> Any:
    return {"customer": run.call.input["ticket"]}


async def draft(run: ToolRun) -> Any:
    return {"text": f"reply to {run.call.input['ticket']}"}


def review_agent(build: str) -> Any:
    # The new build drafts before it looks the customer up: replayed against
    # an iteration the old build began, it would be a ReplayMismatch.
    order = ["lookup", "draft"] if build == OLD else ["draft", "lookup"]
    tools = {"lookup": lookup, "draft": draft}

    async def agent(tc: TaskContext) -> None:
        j = await tc.journal()
        for name in order:
            await j.tool(ToolCall(name=name, input={"ticket": tc.input}), Replay.SAFE, tools[name])
        if tc.iteration == 0:
            await tc.continue_({"drafted_by": build}, until_input=True)  # a person reviews
        else:
            await tc.complete({"sent_by": build})

    return agent


# --8<-- [start:worker]
def worker(build: str, engine: str = ENGINE) -> Worker:
    # build_id: this code's release (or DAGNATS_BUILD_ID); one token, at most 64 characters.
    return Worker(engine, handlers={"review": review_agent(build)}, build_id=build)


# --8<-- [end:worker]


async def waiting_for(client: Client, run_id: str, what: str) -> Any:
    """Poll the run until its step waits for an input or for its build."""
    while True:
        step = (await client.get_run(run_id)).steps[0]
        if getattr(step, what):
            return step
        await asyncio.sleep(0.05)


async def main(engine: str = ENGINE) -> dict[str, str]:
    """Roll out the new build under two runs in flight; who sent each reply."""
    sent: dict[str, str] = {}
    async with Client(engine) as client, AsyncExitStack() as new_build:
        await client.register_workflow(WORKFLOW)
        # --8<-- [start:deploy]
        async with worker(OLD, engine):
            first = await client.start_run("review", "T-1")
            second = await client.start_run("review", "T-2")
            for run in (first, second):
                await waiting_for(client, run.run_id, "waiting_for_input")
            # Roll out the new build beside the old one.
            await new_build.enter_async_context(worker(NEW, engine))
            await client.submit_input(first.run_id, "agent", "ok", "approved")
            done = await client.wait_for_run(first.run_id, timeout=60)  # on the old build
            sent["first"] = run_output(done)["sent_by"]
        # --8<-- [end:deploy]
        # --8<-- [start:upgrade]
        # The old build is gone with T-2 still waiting: once answered, it
        # waits for its build, visibly, until an operator moves it.
        await client.submit_input(second.run_id, "agent", "ok", "approved")
        step = await waiting_for(client, second.run_id, "waiting_for_build")
        print(f"{second.run_id} waits for build {step.build_id}")
        await client.upgrade_run(second.run_id, NEW)  # dagnats run upgrade RUN --build ...
        # --8<-- [end:upgrade]
        done = await client.wait_for_run(second.run_id, timeout=60)
        sent["second"] = run_output(done)["sent_by"]
    return sent


if __name__ == "__main__":
    print(asyncio.run(main()))
