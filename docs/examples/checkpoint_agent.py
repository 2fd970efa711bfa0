"""A handler without the journal: it keeps its state in a checkpoint.

    python docs/examples/checkpoint_agent.py

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

# --8<-- [start:handler]
from dagnats.sdk import Client, TaskContext, Worker


async def turn(tc: TaskContext) -> None:
    history = await tc.load_checkpoint() or [tc.input]
    reply = await call_model(history)  # your model call
    if reply.done:
        await tc.complete(reply.answer)
        return
    await tc.checkpoint([*history, reply.as_json()])
    await tc.continue_()  # the engine dispatches the next iteration


# --8<-- [end:handler]

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")


@dataclass(frozen=True)
class Reply:
    text: str
    done: bool

    @property
    def answer(self) -> str:
        return self.text

    def as_json(self) -> dict[str, Any]:
        return {"role": "assistant", "content": self.text}


async def call_model(history: list[Any]) -> Reply:
    """A stand-in for a model: it thinks twice, then answers."""
    if len(history) < 3:
        return Reply(text=f"thinking ({len(history)})", done=False)
    return Reply(text="It is 21 C in Lisbon.", done=True)


WORKFLOW = {
    "name": "my-agent",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "my-agent"}],
}


async def main(engine: str = ENGINE) -> Any:
    # --8<-- [start:worker]
    async with Client(engine) as client, Worker(engine, handlers={"my-agent": turn}):
        await client.register_workflow(WORKFLOW)  # its one agent_loop step's task is my-agent
        answer = await client.run("my-agent", "How warm is Lisbon?", timeout=60)
    # --8<-- [end:worker]
    print(f"answer: {answer}")
    return answer


if __name__ == "__main__":
    asyncio.run(main())
