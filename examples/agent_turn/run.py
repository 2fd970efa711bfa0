"""Run the agent-turn example against a running engine (``make dev``).

Registers ``workflow.yaml``, runs the handler in a worker with a scripted model
and two stand-in tools, starts a run and prints its output. From the repository
root: ``.venv/bin/python -m examples.agent_turn.run``. The engine is
``$DAGNATS_ENGINE``, else ``127.0.0.1:7233``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from dagnats.sdk import Client, Worker, run_output
from dagnats.sdk.testing import ScriptedModel
from examples.agent_turn.handler import make_agent_turn

TARGET = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
WORKFLOW = Path(__file__).with_name("workflow.yaml")

# What a model would say: look something up, send a message, answer.
SCRIPT: list[dict[str, Any]] = [
    {"done": False, "tool": "search", "input": {"q": "Lisbon weather"}},
    {"done": False, "tool": "send_email", "input": {"to": "ops@example.com", "body": "21 °C"}},
    {"done": True, "answer": "It is 21 °C in Lisbon; ops has been told."},
]


async def run_tool(name: str, input: Any, key: str) -> Any:
    """Stand-in tools. A real ``send_email`` would pass ``key`` to the mail
    provider as its idempotency key."""
    print(f"  tool {name}({input}) key={key}")
    if name == "search":
        return {"results": ["Lisbon: 21 °C, clear"]}
    if name == "send_email":
        return {"sent": True, "message_id": key}
    raise LookupError(f"no tool named {name!r}")


def workflow_text() -> str:
    return WORKFLOW.read_text()


async def main() -> None:
    async with Client(TARGET) as client:
        workflow = await client.register_workflow(workflow_text())
        handler = make_agent_turn(ScriptedModel(SCRIPT), run_tool)
        async with Worker(TARGET, handlers={workflow.steps[0].task: handler}):
            run = await client.start_run(workflow.name, "How warm is it in Lisbon?")
            print(f"run {run.run_id} of workflow {workflow.name}")
            run = await client.wait_for_run(run.run_id)
    if run.error:
        print(f"failed: {run.error}")
    else:
        print(f"output: {run_output(run)}")
    print(f"audit the journal with: dagnats journal check {run.run_id}")


if __name__ == "__main__":
    asyncio.run(main())
