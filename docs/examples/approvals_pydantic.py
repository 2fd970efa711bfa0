"""A pydantic-ai tool that needs approval, under durable_agent: the round
stops, the step waits holding no worker, and the approval runs the tool once.

    python docs/examples/approvals_pydantic.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233, and the gateway
$DAGNATS_GATEWAY, else http://127.0.0.1:8080 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dagnats.integrations.pydantic_ai import durable_agent
from dagnats.sdk import Client, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
GATEWAY = os.environ.get("DAGNATS_GATEWAY", "http://127.0.0.1:8080")
SENT: list[dict[str, str]] = []  # stands in for a mail provider


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A stand-in for a model: mail ops, then say so."""
    if not any(isinstance(m, ModelResponse) for m in messages):
        body = {"to": "ops@example.com", "body": "Lisbon: 21 C"}
        return ModelResponse(parts=[ToolCallPart("send_email", body)])
    return ModelResponse(parts=[TextPart("ops has been told.")])


def make_agent() -> Agent[None, str]:
    agent = Agent(FunctionModel(scripted))

    # --8<-- [start:tool]
    @agent.tool_plain(requires_approval=True)
    async def send_email(to: str, body: str) -> str:
        """Send an email: runs once a person approved these arguments."""
        SENT.append({"to": to, "body": body})
        return f"sent to {to}"

    # --8<-- [end:tool]

    return agent


WORKFLOW = {
    "name": "mail-ops",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "mail-ops"}],
}


async def approve_the_waiting_call(client: Client, gateway: str, run_id: str) -> None:
    async for run in client.watch_run(run_id):
        if run.steps[0].waiting_for_input:
            break
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        approvals = f"/runs/{run_id}/steps/agent/approvals"
        [call] = (await http.get(approvals)).json()["approvals"]
        print("asked:", call["tool"], call["args"], "; sent so far:", SENT)
        decision = {"call": call["call"], "digest": call["digest"], "decision": "approve"}
        (await http.post(approvals, json=decision)).raise_for_status()


async def main(engine: str = ENGINE, gateway: str = GATEWAY) -> Any:
    handler = durable_agent(make_agent(), follow_up_window=None)  # end at the answer
    async with Client(engine) as client, Worker(engine, handlers={"mail-ops": handler}):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("mail-ops", "Tell ops the weather in Lisbon.")
        await approve_the_waiting_call(client, gateway, run.run_id)
        done = await client.wait_for_run(run.run_id, timeout=60)
        print("result:", done.output.decode())
        return done


if __name__ == "__main__":
    asyncio.run(main())
