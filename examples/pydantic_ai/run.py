"""Run the pydantic-ai example against a running engine (``make dev``).

Registers ``workflow.yaml``, serves the agent in a worker, starts a run, and
prints the answer. The model is ``$DAGNATS_MODEL`` when set (``provider:model``
or ``provider:model@base-url``, as for the SDK's adapters: ``openai:gpt-4.1-mini``
with ``OPENAI_API_KEY`` set, or ``openai:llama3.1:8b@http://localhost:11434/v1``),
else a scripted stand-in without streaming, so it works offline. From the repository
root: ``.venv/bin/python -m examples.pydantic_ai.run``. The engine is
``$DAGNATS_ENGINE``, else ``127.0.0.1:7233``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.integrations.pydantic_ai import model_from_env
from dagnats.sdk import Client, Worker, run_output
from examples.pydantic_ai.agent import handler

TARGET = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
WORKFLOW = Path(__file__).with_name("workflow.yaml")


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """What a model would say: look the weather up, mail ops, answer."""
    rounds = sum(isinstance(m, ModelResponse) for m in messages)
    if rounds == 0:
        return ModelResponse(parts=[ToolCallPart("lookup", {"city": "Lisbon"})])
    if rounds == 1:
        body = {"to": "ops@example.com", "body": "Lisbon: 21 °C, clear"}
        return ModelResponse(parts=[ToolCallPart("send_email", body)])
    return ModelResponse(parts=[TextPart("It is 21 °C and clear in Lisbon; ops has been told.")])


def model() -> Model:
    return model_from_env() or FunctionModel(scripted)


def real() -> bool:
    return bool(os.environ.get("DAGNATS_MODEL"))


async def main() -> int:
    # Entering the model opens its provider's HTTP client once, for every
    # dispatch the worker serves, and closes it at the end.
    async with Client(TARGET) as client, model() as agent_model:
        workflow = await client.register_workflow(WORKFLOW.read_text())
        task = workflow.steps[0].task
        async with Worker(
            TARGET, handlers={task: handler(agent_model, stream=real(), follow_up_window=None)}
        ):
            run = await client.start_run(workflow.name, "How warm is it in Lisbon? Tell ops.")
            print(f"run {run.run_id}; tokens: dagnats run watch {run.run_id} --stream")
            done = await client.wait_for_run(run.run_id, timeout=300)
    if done.status != pb.RUN_STATUS_COMPLETED:
        print(f"failed: {done.error}")
        return 1
    print(f"answer: {run_output(done)}")
    print(f"audit the journal with: dagnats journal check {run.run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
