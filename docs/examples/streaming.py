"""Streaming a model's tokens to readers while it runs, and reading them over
the gateway's server-sent events.

    python docs/examples/streaming.py [GATEWAY_URL]

The engine is $DAGNATS_ENGINE, else 127.0.0.1:7233, and the gateway
http://127.0.0.1:8080 (what `make dev` runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import httpx

from dagnats.sdk import Client, TaskContext, TokenStream, Worker

ENGINE = os.environ.get("DAGNATS_ENGINE", "127.0.0.1:7233")
GATEWAY = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"


# --8<-- [start:handler]
async def generate(stream: TokenStream) -> str:
    """A stand-in for a streaming model call: a word every 50 ms."""
    words = []
    for word in ["It", "is", "21", "C", "and", "clear", "in", "Lisbon."]:
        await asyncio.sleep(0.05)  # the model's pace
        stream.put(word + " ")  # to every reader; never waits on a slow one
        words.append(word)
    return " ".join(words)  # the response the journal records


async def answer(tc: TaskContext) -> None:
    j = await tc.journal()
    text = await j.streamed_model(generate)  # recorded as j.model records it
    await tc.complete(text)


# --8<-- [end:handler]


# --8<-- [start:reader]
async def read_tokens(gateway: str, run_id: str, step: str) -> tuple[list[str], Any]:
    """Follow the step's stream: its tokens as they come, until the response
    is stored (``committed``), which is what to trust."""
    tokens: list[str] = []
    url = f"{gateway}/runs/{run_id}/steps/{step}/stream"
    async with httpx.AsyncClient(timeout=60) as http, http.stream("GET", url) as events:
        event = ""
        async for line in events.aiter_lines():
            if line.startswith("event:"):
                event = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data = json.loads(line.removeprefix("data:"))
                if event == "token":
                    tokens.append(data["text"])
                    print(data["text"], end="", flush=True)
                elif event == "committed":
                    print()
                    return tokens, data["response"]
    raise RuntimeError("the stream ended before the response was stored")


# --8<-- [end:reader]


# --8<-- [start:main]
WORKFLOW = {
    "name": "streamer",
    "steps": [{"id": "agent", "type": "agent_loop", "task": "streamer"}],
}


async def main(engine: str = ENGINE, gateway: str = GATEWAY) -> tuple[list[str], Any, Any]:
    async with Client(engine) as client, Worker(engine, handlers={"streamer": answer}):
        await client.register_workflow(WORKFLOW)
        run = await client.start_run("streamer", "How warm is Lisbon?")
        tokens, response = await read_tokens(gateway, run.run_id, "agent")
        done = await client.wait_for_run(run.run_id, timeout=60)
        return tokens, response, json.loads(done.output)


if __name__ == "__main__":
    asyncio.run(main())
# --8<-- [end:main]
