"""Approvals bound to their arguments: an agent's tool that sends money runs
only once a person approved exactly these arguments.

    python docs/examples/approvals.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233, and the gateway
$DAGNATS_GATEWAY, else http://127.0.0.1:8080 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx

from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
GATEWAY = os.environ.get("DAGNATS_GATEWAY", "http://127.0.0.1:8080")
PAID: list[Any] = []


async def pay(run: ToolRun) -> Any:
    """A stand-in for a payment API, keyed on the call's idempotency key."""
    PAID.append(run.call.input)
    return {"paid": run.call.input["cents"], "key": run.call.key}


# --8<-- [start:handler]
async def payer(tc: TaskContext) -> None:
    j = await tc.journal()
    state = await tc.load_checkpoint() or {}
    if "call" not in state:  # a stand-in for the model asking for the tool
        state["call"] = await j.model(lambda: asyncio.sleep(0, {"to": "acme", "cents": 1200}))
        await tc.checkpoint(state)  # saved first: the next iteration makes the same call
    call = ToolCall(name="pay", input=state["call"])
    # Waits, holding no worker, until a person approves these exact arguments.
    # --8<-- [start:tool]
    result = await j.tool(call, Replay.UNSAFE, pay, approval=True)
    # --8<-- [end:tool]
    await tc.complete(result.output)  # a denial is {"denied": true, "reason": ...}


# --8<-- [end:handler]

WORKFLOW = {
    "name": "payer",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "payer"}],
}


# --8<-- [start:approve]
async def approve_when_asked(client: Client, gateway: str, run_id: str) -> dict[str, Any]:
    """Once the step waits for an approval, approve the call it lists, with
    the digest of the arguments shown."""
    async for run in client.watch_run(run_id):  # the run now, then every change
        if run.steps[0].waiting_for_input:  # its output names the waiting call
            break
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        approvals = f"/runs/{run_id}/steps/agent/approvals"
        [call] = (await http.get(approvals)).json()["approvals"]
        print("asked:", call["tool"], json.dumps(call["args"]), call["digest"])
        answer = await http.post(
            approvals,
            json={"call": call["call"], "digest": call["digest"], "decision": "approve",
                  "approver": "finance"},
        )  # fmt: skip
        answer.raise_for_status()  # 409 if the digest is not the call's
        return dict(answer.json())


# --8<-- [end:approve]


# --8<-- [start:main]
async def main(engine: str = ENGINE, gateway: str = GATEWAY) -> Any:
    async with Client(engine) as client, Worker(engine, handlers={"payer": payer}):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("payer", "pay acme")
        await approve_when_asked(client, gateway, run.run_id)
        done = await client.wait_for_run(run.run_id, timeout=60)
        print("result:", done.output.decode())
        return json.loads(done.output)


if __name__ == "__main__":
    asyncio.run(main())
# --8<-- [end:main]
