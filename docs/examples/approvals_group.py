"""A call needing approval inside a parallel group: the group's other calls
run while it waits, and the iteration the approval wakes makes only it.

    python docs/examples/approvals_group.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233, and the gateway
$DAGNATS_GATEWAY, else http://127.0.0.1:8080 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx

from dagnats.sdk import ApprovalPending, Client, Replay, TaskContext, ToolCall, ToolRun, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
GATEWAY = os.environ.get("DAGNATS_GATEWAY", "http://127.0.0.1:8080")
RAN: list[str] = []  # the tools that ran, in order


async def lookup(run: ToolRun) -> Any:
    RAN.append("lookup")
    return {"email": f"{run.call.input['who']}@example.com"}


async def attach(run: ToolRun) -> Any:
    RAN.append("attach")
    return {"attached": run.call.input["file"]}


async def send_email(run: ToolRun) -> Any:
    RAN.append("send_email")  # unsafe: a real service would deduplicate on run.call.key
    return {"sent": run.call.input["to"]}


async def mailer(tc: TaskContext) -> None:
    j = await tc.journal()
    state = await tc.load_checkpoint() or {"results": {}}
    email = {"to": "bob", "body": "your invoice"}  # what a model asked for, say
    # --8<-- [start:group]
    group = [
        (ToolCall(name="lookup", input={"who": "bob"}), Replay.SAFE, lookup),
        (ToolCall(name="attach", input={"file": "invoice.pdf"}), Replay.UNSAFE, attach),
        (ToolCall(name="send_email", input=email), Replay.UNSAFE, send_email, True),
    ]
    todo = [i for i in range(len(group)) if str(i) not in state["results"]]
    try:
        results = await j.tools([group[i] for i in todo])
    except ApprovalPending as waiting:
        for i, result in zip(todo, waiting.results, strict=True):
            if not result.awaiting_approval:
                state["results"][str(i)] = result.output
        await tc.checkpoint(state)  # the step waits; the approval wakes it
        raise
    # --8<-- [end:group]
    for i, result in zip(todo, results, strict=True):
        state["results"][str(i)] = result.output
    await tc.complete([state["results"][str(i)] for i in range(len(group))])


WORKFLOW = {
    "name": "mailer",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "mailer"}],
}


async def approve_the_waiting_call(client: Client, gateway: str, run_id: str) -> None:
    async for run in client.watch_run(run_id):
        if run.steps[0].waiting_for_input:
            break
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        approvals = f"/runs/{run_id}/steps/agent/approvals"
        [call] = (await http.get(approvals)).json()["approvals"]
        print("asked:", call["tool"], json.dumps(call["args"]), "; ran so far:", RAN)
        decision = {"call": call["call"], "digest": call["digest"], "decision": "approve"}
        (await http.post(approvals, json=decision)).raise_for_status()


async def main(engine: str = ENGINE, gateway: str = GATEWAY) -> Any:
    async with Client(engine) as client, Worker(engine, handlers={"mailer": mailer}):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("mailer", "mail bob his invoice")
        await approve_the_waiting_call(client, gateway, run.run_id)
        done = await client.wait_for_run(run.run_id, timeout=60)
        print("result:", done.output.decode())
        return json.loads(done.output)


if __name__ == "__main__":
    asyncio.run(main())
