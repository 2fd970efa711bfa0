"""A run's usage ledger and budget: each model call records what it spent;
the run's budget pauses it when spent, and an input raises it.

    python docs/examples/usage_budget.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from dagnats.sdk import (
    Budget,
    Client,
    InputMode,
    TaskContext,
    Usage,
    WithUsage,
    Worker,
)

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")


async def my_model(turn: int) -> dict[str, Any]:
    """A stand-in for a model the handler calls itself, with the counts its
    provider would report."""
    return {"text": f"turn {turn}", "usage": {"in": 1000, "out": 200, "model": "my-model"}}


# --8<-- [start:handler]
async def agent(tc: TaskContext) -> None:
    j = await tc.journal()

    async def call() -> WithUsage:
        answer = await my_model(tc.iteration)
        spent = answer["usage"]
        usage = Usage(input_tokens=spent["in"], output_tokens=spent["out"], model=spent["model"])
        return WithUsage(answer["text"], usage)  # recorded with the response

    text = await j.model(call)  # the response alone
    if tc.iteration < 3:
        await tc.continue_(text)
    else:
        await tc.complete(text)


# --8<-- [end:handler]


WORKFLOW = {
    "name": "usage-budget",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "usage-budget"}],
}


async def main(engine: str = ENGINE) -> tuple[int, Any]:
    """Run the agent under a budget of 2,000 tokens, raise it once the run
    paused, and return the run's status and its usage."""
    async with (
        Client(engine) as client,
        Worker(engine, handlers={"usage-budget": agent}),
    ):
        await client.register_workflow(WORKFLOW)
        # --8<-- [start:budget]
        budget = Budget(tokens=2_000, policy="pause")  # or cost=0.50, policy="fail"
        run = await client.start_run("usage-budget", budget=budget)
        # --8<-- [end:budget]
        await paused(client, run.run_id)
        # --8<-- [start:raise]
        await client.submit_input(
            run.run_id, "agent", "raise-1", {"tokens": 3_000}, mode=InputMode.BUDGET
        )
        # --8<-- [end:raise]
        done = await client.wait_for_run(run.run_id, timeout=60)
        # --8<-- [start:usage]
        usage = await client.run_usage(run.run_id)
        spent = usage.total.spent  # kept + retried + fenced: what was spent
        print(f"{spent.calls} calls, {spent.input_tokens} in, {spent.output_tokens} out")
        for step in usage.steps:
            print(step.step_id, step.usage.kept.calls, "kept", step.usage.fenced.calls, "fenced")
        # --8<-- [end:usage]
    return done.status, usage


async def paused(client: Client, run_id: str) -> None:
    """Until the step waits for an input that raises its budget."""
    async for run in client.watch_run(run_id):
        if run.steps[0].waiting_for_input:
            return


if __name__ == "__main__":
    print(asyncio.run(main())[0])
