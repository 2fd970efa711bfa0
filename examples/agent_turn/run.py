"""Run the agent-turn example against a running engine (``make dev``).

Registers ``workflow.yaml``, runs the handler in a worker with the model
``$DAGNATS_MODEL`` names (``examples/agent_turn/model.py``; a scripted model
when it names none) and two stand-in tools, starts a run and prints the
agent's answer. The agent
then waits for a follow-up, holding no worker; the script sends one, prints
the second answer, and cancels the run. From the repository root:
``.venv/bin/python -m examples.agent_turn.run``. The engine is
``$DAGNATS_ENGINE``, else ``127.0.0.1:7233``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, InputMode, Worker
from dagnats.sdk.models import model_from_env
from dagnats.sdk.testing import ScriptedModel
from dagnats.sdk.views import decode_payload
from examples.agent_turn.handler import CallModel, make_agent_turn
from examples.agent_turn.model import call_model_with

TARGET = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
WORKFLOW = Path(__file__).with_name("workflow.yaml")
STEP = "agent"

# What a model would say: look something up, send a message, answer; then
# answer the follow-up.
SCRIPT: list[dict[str, Any]] = [
    {"done": False, "tool": "search", "input": {"q": "Lisbon weather"}},
    {"done": False, "tool": "send_email", "input": {"to": "ops@example.com", "body": "21 °C"}},
    {"done": True, "answer": "It is 21 °C in Lisbon; ops has been told."},
    {"done": True, "answer": "Tomorrow: 23 °C and clear."},
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


def chosen_model() -> CallModel:
    """The model ``DAGNATS_MODEL`` names (key from the environment), else the script."""
    model = model_from_env()
    if model is None:
        return ScriptedModel(SCRIPT)
    print(f"model {model.name}")
    return call_model_with(model)


def workflow_text() -> str:
    return WORKFLOW.read_text()


async def answer(client: Client, run_id: str, *, after: int = -1) -> pb.Run:
    """The run once its agent answered in an iteration after ``after`` and
    waits for a follow-up, or once the run ended."""
    async for run in client.watch_run(run_id):  # each change, pushed by the engine
        step = step_of(run)
        if run.status != pb.RUN_STATUS_RUNNING:
            return run
        if step.waiting_for_input and step.iteration > after:
            return run
    raise AssertionError("a run watch ends only with the run's end")


def step_of(run: pb.Run) -> pb.StepState:
    return next(s for s in run.steps if s.step_id == STEP)


async def main() -> int:
    async with Client(TARGET) as client:
        workflow = await client.register_workflow(workflow_text())
        handler = make_agent_turn(chosen_model(), run_tool)
        async with Worker(TARGET, handlers={workflow.steps[0].task: handler}):
            run = await client.start_run(workflow.name, "How warm is it in Lisbon?")
            print(f"run {run.run_id} of workflow {workflow.name}")
            run = await asyncio.wait_for(answer(client, run.run_id), timeout=120)
            if run.status != pb.RUN_STATUS_RUNNING:
                print(f"failed: {run.error}")
                return 1
            print(f"answer: {decode_payload(step_of(run).output)}")
            print("the agent waits for a follow-up; sending one")
            await client.submit_input(
                run.run_id, STEP, "follow-up-1", "And tomorrow?", mode=InputMode.FOLLOW_UP
            )
            answered = step_of(run).iteration
            run = await asyncio.wait_for(answer(client, run.run_id, after=answered), timeout=120)
            print(f"answer: {decode_payload(step_of(run).output)}")
            await client.cancel_run(run.run_id, "the example is over")
    print(f"audit the journal with: dagnats journal check {run.run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
