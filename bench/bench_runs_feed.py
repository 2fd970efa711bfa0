"""How soon a live list of runs (``WatchRuns``, the console's runs page) has
its first answer with many runs stored, against ``ListRuns`` in the same run,
and how soon a follower sees a new run.

usage: python -m bench.bench_runs_feed   (BENCH_FEED_RUNS: runs stored, 2000)

One process: nats-server, the engine and the client (``LocalStack``). The
runs are of a workflow no worker takes, so they stay running and nothing but
the starts writes. The seed of a live list is one consumer's pass over the
runs bucket; ``ListRuns`` reads back from the bucket's newest writes (ADR
30), here all of it: the runs are started within a few seconds, inside the
allowance for an engine's clock (``DAGNATS_CLOCK_SKEW``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from dagnats.sdk.testing import LocalStack

RUNS = int(os.environ.get("BENCH_FEED_RUNS", "2000"))
ROUNDS = 5
NEW_RUNS = 50
NAME = "feed-bench"
WORKFLOW = {"name": NAME, "steps": [{"id": "a", "type": "task", "task": "nobody"}]}


async def main() -> None:
    async with LocalStack() as stack:
        client = stack.client
        await stack.register(WORKFLOW)
        limit = asyncio.Semaphore(50)

        async def start(n: int) -> None:
            async with limit:
                await client.start_run(NAME, {"n": n})

        await asyncio.gather(*(start(n) for n in range(RUNS)))
        listed, seeded = [], []
        for _ in range(ROUNDS):  # taking turns, so load on the machine hits both
            began = time.perf_counter()
            await client.list_runs(limit=100)
            listed.append(time.perf_counter() - began)
            began = time.perf_counter()
            feed = client.watch_runs(limit=100)
            await anext(feed)
            seeded.append(time.perf_counter() - began)
            await feed.aclose()
        seen = []
        feed = client.watch_runs(limit=100)
        await anext(feed)
        for _ in range(NEW_RUNS):
            began = time.perf_counter()
            run = await client.start_run(NAME)
            while not any(r.run_id == run.run_id for r in (await anext(feed)).runs):
                pass
            seen.append(time.perf_counter() - began)
        await feed.aclose()
    ms = 1000.0
    print(f"{RUNS} runs stored, load average {os.getloadavg()[0]:.1f}")
    print(f"ListRuns(limit=100): median {statistics.median(listed) * ms:.0f} ms")
    print(f"WatchRuns(limit=100) first answer: median {statistics.median(seeded) * ms:.0f} ms")
    print(f"ratio: {statistics.median(listed) / statistics.median(seeded):.1f}x")
    print(
        f"a new run's start to a follower having it: median "
        f"{statistics.median(seen) * ms:.1f} ms, max {max(seen) * ms:.1f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
