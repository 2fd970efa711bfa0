"""What live token streams deliver and cost, through one gateway on loopback.

Run with ``make bench`` (after the journal bench) or ``python -m
bench.bench_stream [--readers N] [--tokens N] [--turns N]``.

Three measurements, in one process and one event loop (nats-server aside):

- fan-out: ``--readers`` SSE readers of one step through one gateway; every
  reader must see every chunk, in order (checked, and reported);
- throughput and latency: one worker streams ``--tokens`` tokens to a few
  readers; tokens per second from the first put to the last token a reader
  got, and token-to-reader latency (each token carries its put time);
- cost per turn: the time of a journaled turn (claim, one model call of 200
  tokens, commit) with the tokens streamed and without;
- a run read: ``GET /runs/{id}`` again and again on one kept-alive
  connection, beside ``GetRun`` over gRPC (a gateway whose socket left Nagle's
  algorithm on answered each request after a connection's first 40 ms late).

Nothing here asserts on time; the numbers go to stdout and into ADR 15.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import start_engine
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.sdk import Client, TaskContext, TokenStream, Worker
from tests.stack import FAST, loop_workflow, unique


async def _reader(
    http: httpx.AsyncClient, run_id: str, subscribed: asyncio.Event | None, got: list[Any]
) -> None:
    path = f"/runs/{run_id}/steps/agent/stream"
    async with http.stream("GET", path, timeout=None) as response:
        lines = response.aiter_lines()
        await anext(lines)
        if subscribed is not None:
            subscribed.set()
        kind = ""
        async for line in lines:
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if kind == "committed":
                    return
                got.append((time.time_ns(), data))


def _handler(
    tokens: int, *, streamed: bool, pace: int, times: list[float], rate: float = 0.0
) -> Any:
    """A handler whose model puts ``tokens``, yielding every ``pace`` tokens;
    with a ``rate`` (tokens/s) each yield waits until its tokens are due, so
    the average holds however coarse the loop's sleeps are."""

    async def handler(tc: TaskContext) -> None:
        began = time.perf_counter()
        j = await tc.journal()

        async def model(stream: TokenStream | None) -> str:
            start = time.perf_counter()
            for i in range(tokens):
                if stream is not None:
                    stream.put(f"{time.time_ns()};")
                if i % pace == pace - 1:
                    due = start + (i + 1) / rate if rate else 0.0
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
            return "x" * tokens

        if streamed:
            await j.streamed_model(model)
        else:
            await j.model(lambda: model(None))
        await tc.complete("done")
        times.append(time.perf_counter() - began)

    return handler


async def _stream_once(
    engine_target: str,
    http: httpx.AsyncClient,
    readers: int,
    tokens: int,
    pace: int,
    rate: float = 0.0,
) -> tuple[float, list[list[Any]]]:
    async with Client(engine_target) as client:
        task, name = unique("bstream"), unique("bstreamwf")
        await client.register_workflow(loop_workflow(name, task))
        gate = asyncio.Event()
        times: list[float] = []
        inner = _handler(tokens, streamed=True, pace=pace, times=times, rate=rate)

        async def gated(tc: TaskContext) -> None:
            await gate.wait()
            await inner(tc)

        async with Worker(engine_target, handlers={task: gated}, poll_wait=1.0):
            run = await client.start_run(name)
            got: list[list[Any]] = [[] for _ in range(readers)]
            ready = [asyncio.Event() for _ in range(readers)]
            tasks = [
                asyncio.create_task(_reader(http, run.run_id, ready[i], got[i]))
                for i in range(readers)
            ]
            await asyncio.gather(*(r.wait() for r in ready))
            started = time.perf_counter()
            gate.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 600)
            elapsed = time.perf_counter() - started
            await client.wait_for_run(run.run_id, timeout=60)
    return elapsed, got


async def _turns(engine_target: str, turns: int, *, streamed: bool) -> list[float]:
    times: list[float] = []
    async with Client(engine_target) as client:
        task, name = unique("bturn"), unique("bturnwf")
        await client.register_workflow(loop_workflow(name, task))
        handler = _handler(200, streamed=streamed, pace=50, times=times)
        async with Worker(engine_target, handlers={task: handler}, poll_wait=1.0):
            for _ in range(turns):
                run = await client.start_run(name)
                await client.wait_for_run(run.run_id, timeout=60)
    return times


async def _reads(engine_target: str, http: httpx.AsyncClient, n: int) -> tuple[float, float]:
    """Median seconds of a run read over HTTP (one kept-alive connection) and over gRPC."""
    async with Client(engine_target) as client:
        name = unique("breadwf")
        await client.register_workflow(loop_workflow(name, unique("bread")))
        run_id = (await client.start_run(name)).run_id
        over_http: list[float] = []
        over_grpc: list[float] = []
        for _ in range(n):
            started = time.perf_counter()
            (await http.get(f"/runs/{run_id}")).raise_for_status()
            over_http.append(time.perf_counter() - started)
            started = time.perf_counter()
            await client.get_run(run_id)
            over_grpc.append(time.perf_counter() - started)
    return statistics.median(over_http), statistics.median(over_grpc)


def _ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.1f} ms"


def _throughput(label: str, tokens: int, elapsed: float, got: list[list[Any]]) -> None:
    seen = got[0]
    # A chunk may hold coalesced tokens: each one's put time is in it.
    lat = [(at - int(put)) / 1e9 for g in got for at, d in g for put in d["text"].split(";")[:-1]]
    count = sum(d["text"].count(";") for _, d in seen)
    dropped = sum(d.get("dropped", 0) for _, d in seen)
    print(f"throughput: {tokens} tokens from one worker to 4 readers, {label}")
    print(f"  {count / elapsed:,.0f} tokens/s delivered ({elapsed:.2f}s)")
    print(f"  tokens {count} in {len(seen)} chunks, dropped {dropped}")
    print(f"  token-to-reader latency p50 {_ms(lat, 0.5)}, p99 {_ms(lat, 0.99)}")


async def bench(readers: int, tokens: int, turns: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dagnats-bench-stream-") as store:
        server = await NatsServer.start(Path(store))
        engine = await start_engine(server.url, config=FAST)
        gateway = await start_gateway(GatewayConfig(engine_target=engine.target, port=0))
        limits = httpx.Limits(max_connections=readers + 10)
        try:
            async with httpx.AsyncClient(base_url=gateway.url, limits=limits) as http:
                fan_tokens = 200
                _, got = await _stream_once(engine.target, http, readers, fan_tokens, 50)
                complete = sum(
                    [d["seq"] for _, d in g] == list(range(1, len(g) + 1))
                    and sum(d["text"].count(";") for _, d in g) == fan_tokens
                    for g in got
                )
                print(f"fan-out: {readers} SSE readers of one step, {fan_tokens} tokens")
                print(f"  readers that saw every token in order: {complete}/{readers}")

                for label, rate in (("as fast as it can", 0.0), ("paced at 10,000/s", 10_000.0)):
                    elapsed, got = await _stream_once(engine.target, http, 4, tokens, 50, rate)
                    _throughput(label, tokens, elapsed, got)

                over_http, over_grpc = await _reads(engine.target, http, 200)
                print("a run read, 200 in a row, median (one kept-alive connection)")
                print(f"  GET /runs/{{id}}: {over_http * 1000:.2f} ms")
                print(f"  GetRun (gRPC):  {over_grpc * 1000:.2f} ms")
                print(f"  HTTP/gRPC:      {over_http / over_grpc:.2f}x")

            plain = await _turns(engine.target, turns, streamed=False)
            streamed = await _turns(engine.target, turns, streamed=True)
            print(f"cost per turn ({turns} turns, one model call of 200 tokens, no reader)")
            print(f"  without streaming: median {statistics.median(plain) * 1000:.1f} ms")
            print(f"  with streaming:    median {statistics.median(streamed) * 1000:.1f} ms")
        finally:
            await gateway.stop()
            await engine.stop()
            await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_stream", description=__doc__)
    parser.add_argument("--readers", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--turns", type=int, default=50)
    args = parser.parse_args(argv)
    asyncio.run(bench(args.readers, args.tokens, args.turns))


if __name__ == "__main__":
    main()
