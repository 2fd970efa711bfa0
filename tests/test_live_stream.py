"""A step's live token stream through the gateway: tokens in order, then
``committed`` naming the model record; a crashed or fenced holder's stream
``abandoned`` and its successor's marked as the retry; late and resuming
readers; slow readers and bad input."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
import httpx

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.journal import stream as live
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, TaskContext, TokenStream, Worker
from tests.helpers import body, claims, holds, wait_for
from tests.stack import FAST, loop_workflow, unique
from tests.test_journal import NO_HEARTBEAT, journal_check, read_journal

TOKENS = [f"tok{i} " for i in range(40)]


@dataclass
class Sse:
    id: str
    type: str
    data: dict[str, Any]


@asynccontextmanager
async def sse(
    http: httpx.AsyncClient, run_id: str, *, last_event_id: str | None = None
) -> AsyncIterator[AsyncIterator[Sse]]:
    """The step's live stream, open (subscribed) when this returns."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    path = f"/runs/{run_id}/steps/agent/stream"
    async with http.stream("GET", path, headers=headers, timeout=None) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("retry:")  # the gateway is subscribed

        async def parse() -> AsyncIterator[Sse]:
            fields: dict[str, str] = {}
            async for line in lines:
                if line == "":
                    if "event" in fields:
                        yield Sse(fields["id"], fields["event"], json.loads(fields["data"]))
                    fields = {}
                elif not line.startswith(":"):
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")

        yield parse()


async def until(stream: AsyncIterator[Sse], done: Any) -> list[Sse]:
    got = []
    async for event in stream:
        got.append(event)
        if done(event):
            return got
    raise AssertionError(f"the stream ended after {len(got)} events")


@dataclass
class Streamer:
    """A handler whose model streams ``TOKENS``: each attempt waits for its
    gate before each of its ``hold_at``-th token on (a crash never opens it)."""

    hold_at: dict[int, int] = field(default_factory=dict)  # attempt -> tokens before the hold
    gates: dict[int, asyncio.Event] = field(default_factory=dict)
    held: dict[int, asyncio.Event] = field(default_factory=dict)
    start: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0

    def gate(self, n: int) -> asyncio.Event:
        return self.gates.setdefault(n, asyncio.Event())

    def reached(self, n: int) -> asyncio.Event:
        return self.held.setdefault(n, asyncio.Event())

    async def __call__(self, tc: TaskContext) -> None:
        j = await tc.journal()
        self.calls += 1
        call = self.calls

        async def model(stream: TokenStream) -> str:
            await self.start.wait()
            for i, token in enumerate(TOKENS):
                if i == self.hold_at.get(call):
                    self.reached(call).set()
                    await self.gate(call).wait()
                stream.put(token)
                await asyncio.sleep(0)
            return "".join(TOKENS)

        text = await j.streamed_model(model)
        await tc.complete(text)


async def start_run(client: Client) -> tuple[str, str]:
    task, name = unique("stream"), unique("streamwf")
    await client.register_workflow(loop_workflow(name, task))
    return task, name


async def test_tokens_in_order_then_committed_with_the_record(
    http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    task, name = await start_run(client)
    agent = Streamer()
    async with Worker(engine.target, handlers={task: agent}, poll_wait=1.0):
        run = await client.start_run(name)
        async with sse(http, run.run_id) as stream:
            agent.start.set()
            events = await until(stream, lambda e: e.type != "token")
        done = await client.wait_for_run(run.run_id, timeout=30)
    tokens, end = events[:-1], events[-1]
    # Tokens a slow link held back arrive coalesced: the text is the same.
    assert "".join(e.data["text"] for e in tokens) == "".join(TOKENS)
    assert [e.data["seq"] for e in tokens] == list(range(1, len(tokens) + 1))
    assert end.type == "committed"
    model = [r for r in await read_journal(engine, run.run_id) if holds(r, "model")]
    assert end.data["record_seq"] == model[0].seq
    assert json.loads(body(model[0], "model").response) == "".join(e.data["text"] for e in tokens)
    assert end.data["response"] == "".join(TOKENS)
    first = tokens[0].data
    assert (first["run"], first["step"], first["iteration"], first["attempt"]) == (
        run.run_id,
        "agent",
        0,
        1,
    )
    assert first["position"] == 0 and len(first["writer"]) == 16
    assert done.status == epb.RUN_STATUS_COMPLETED


async def _successor_claimed(engine: EngineServer, run_id: str) -> bool:
    """A redelivery's claim is stored. (The first delivery's claim rides
    its holder's first record: a holder stalled in its first model
    call stored none.)"""
    records = claims(await read_journal(engine, run_id))
    return any(r.claim.delivery > 1 or r.leading_claim.delivery > 1 for r in records)


async def test_a_crashed_holder_is_abandoned_and_its_successor_retries(
    http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    task, name = await start_run(client)
    agent = Streamer(hold_at={1: 5})  # the first holder dies after 5 tokens
    async with Worker(
        engine.target,
        handlers={task: agent},
        poll_wait=1.0,
        heartbeat_interval=NO_HEARTBEAT,
        concurrency=1,
    ) as first:
        run = await client.start_run(name)
        async with sse(http, run.run_id) as stream:
            agent.start.set()
            await asyncio.wait_for(agent.reached(1).wait(), 20)
            async with Worker(engine.target, handlers={task: agent}, poll_wait=1.0):
                await first.stop(grace=0)
                events = await until(stream, lambda e: e.type == "committed")
                done = await client.wait_for_run(run.run_id, timeout=40)
    writers = list(dict.fromkeys(e.data["writer"] for e in events if e.type == "token"))
    assert len(writers) == 2, "one stream per holder"
    crashed = [e for e in events if e.type == "token" and e.data["writer"] == writers[0]]
    assert "".join(e.data["text"] for e in crashed) == "".join(TOKENS[:5])
    abandoned = [e for e in events if e.type == "abandoned"]
    assert len(abandoned) == 1 and abandoned[0].data["stream"] == crashed[0].data["stream"]
    retry = [e for e in events if e.type == "token" and e.data["writer"] == writers[1]]
    assert "".join(e.data["text"] for e in retry) == "".join(TOKENS)
    assert all(e.data["retry_of"] == crashed[0].data["stream"] for e in retry)
    assert events.index(abandoned[0]) < events.index(retry[0])
    assert agent.calls == 2, "the model request was sent again"
    assert done.status == epb.RUN_STATUS_COMPLETED
    assert list((await journal_check(engine, run.run_id)).violations) == []


async def test_a_stalled_holder_streams_nothing_current_after_its_successor_claims(
    http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    task, name = await start_run(client)
    agent = Streamer(hold_at={1: 3, 2: 10})  # the successor waits until the zombie woke
    async with Worker(
        engine.target,
        handlers={task: agent},
        poll_wait=1.0,
        heartbeat_interval=NO_HEARTBEAT,
        concurrency=1,
    ):
        run = await client.start_run(name)
        async with sse(http, run.run_id) as stream:
            agent.start.set()
            await asyncio.wait_for(agent.reached(1).wait(), 20)
            async with Worker(engine.target, handlers={task: agent}, poll_wait=1.0):
                await wait_for(lambda: _successor_claimed(engine, run.run_id), timeout=30)
                await asyncio.wait_for(agent.reached(2).wait(), 20)
                agent.gate(1).set()  # the zombie wakes and streams the rest
                agent.gate(2).set()
                events = await until(stream, lambda e: e.type == "committed")
                await client.wait_for_run(run.run_id, timeout=40)
    zombie = events[0].data["writer"]
    shown = [e.data["text"] for e in events if e.type == "token" and e.data["writer"] == zombie]
    assert "".join(shown) == "".join(TOKENS[:3]), "the zombie's later chunks were shown"
    cut = next(i for i, e in enumerate(events) if e.type == "abandoned")
    assert events[cut].data["writer"] == zombie
    after = events[cut + 1 :]
    assert all(e.data["writer"] != zombie for e in after), "a fenced holder's chunk was shown"
    assert "".join(e.data["text"] for e in after if e.type == "token") == "".join(TOKENS)


async def test_a_late_reader_gets_the_record_and_a_resumed_one_misses_nothing(
    http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    task, name = await start_run(client)
    agent = Streamer(hold_at={1: 20})
    async with Worker(engine.target, handlers={task: agent}, poll_wait=1.0):
        run = await client.start_run(name)
        async with sse(http, run.run_id) as keeper:  # keeps the stream alive
            async with sse(http, run.run_id) as stream:
                agent.start.set()
                seen: list[Sse] = []
                while "".join(e.data["text"] for e in seen) != "".join(TOKENS[:20]):
                    seen.append(await anext(stream))  # up to the hold, mid-stream
                first = seen[:1]  # resume right after the first event
            async with sse(http, run.run_id, last_event_id=first[-1].id) as stream:
                agent.gate(1).set()
                rest = await until(stream, lambda e: e.type == "committed")
            await until(keeper, lambda e: e.type == "committed")
        await client.wait_for_run(run.run_id, timeout=30)
    texts = "".join(e.data["text"] for e in first + rest if e.type == "token")
    assert texts == "".join(TOKENS), "the resumed reader missed or repeated a token"
    # Long after: the hub is gone or committed; the record comes from the journal.
    async with sse(http, run.run_id) as stream:
        late = await anext(stream)
    assert late.type == "committed" and late.data["response"] == "".join(TOKENS)


async def test_a_slow_reader_slows_nobody_and_bad_input_is_a_4xx(
    http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    task, name = await start_run(client)
    agent = Streamer()
    async with Worker(engine.target, handlers={task: agent}, poll_wait=1.0):
        run = await client.start_run(name)
        async with sse(http, run.run_id), sse(http, run.run_id) as fast:
            # The first reader never reads past its headers.
            agent.start.set()
            events = await until(fast, lambda e: e.type == "committed")
            done = await client.wait_for_run(run.run_id, timeout=30)
    assert "".join(e.data["text"] for e in events if e.type == "token") == "".join(TOKENS)
    assert done.status == epb.RUN_STATUS_COMPLETED
    for path, code in [
        ("/runs/bad..id/steps/agent/stream", 400),
        (f"/runs/{run.run_id}/steps/no.such/stream", 400),
        (f"/runs/{run.run_id}/steps/nosuch/stream", 404),
    ]:
        response = await http.get(path)
        assert response.status_code == code, (path, response.text)
        assert response.json()["code"]
    response = await http.get(
        f"/runs/{run.run_id}/steps/agent/stream", headers={"Last-Event-ID": "*.>"}
    )
    assert response.status_code == 400 and "Last-Event-ID" in response.text


async def test_run_watch_stream_prints_the_tokens_live(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start_run(client)
    agent = Streamer()
    async with Worker(engine.target, handlers={task: agent}, poll_wait=1.0):
        run = await client.start_run(name)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dagnats.cli.main",
            "run",
            "watch",
            run.run_id,
            "--stream",
            env={**os.environ, "DAGNATS_ENGINE": engine.target},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert b"watching run" in line, line
        agent.start.set()
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    text = out.decode()
    assert "".join(TOKENS) in text
    assert "committed, record" in text and "completed" in text


async def test_the_stream_needs_the_api_token_like_the_journal(
    client: Client, engine: EngineServer
) -> None:
    _task, name = await start_run(client)
    run = await client.start_run(name)
    config = GatewayConfig(
        engine_target=engine.target, port=0, api_token="api-secret", bridge_token="bridge-secret"
    )
    server = await start_gateway(config)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            for suffix in ("stream", "journal?follow=1"):
                path = f"/runs/{run.run_id}/steps/agent/{suffix}"
                for headers in ({}, {"Authorization": "Bearer bridge-secret"}):
                    response = await http.get(path, headers=headers)
                    assert response.status_code == 401, (path, headers)
                    assert response.json()["code"] == "unauthenticated"
            good = {"Authorization": "Bearer api-secret"}
            async with http.stream(
                "GET", f"/runs/{run.run_id}/steps/agent/stream", headers=good
            ) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
    finally:
        await server.stop()
        await client.cancel_run(run.run_id, "done")


@dataclass
class LoopStreamer:
    """A loop whose model streams ``TOKENS`` each iteration, then continues
    (its task kept, the next dispatch handed over with the commit); the third
    completes. Iteration 1 waits at ``gate`` after ``TOKENS[:20]``."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    reached: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, tc: TaskContext) -> None:
        j = await tc.journal()

        async def model(stream: TokenStream) -> str:
            for i, token in enumerate(TOKENS):
                if tc.iteration == 1 and i == 20:
                    self.reached.set()
                    await self.gate.wait()
                stream.put(token)
                await asyncio.sleep(0)
            return "".join(TOKENS)

        text = await j.streamed_model(model)
        await (tc.complete(text) if tc.iteration == 2 else tc.continue_())


async def test_a_dispatch_handed_over_with_the_commit_streams_to_every_watcher(
    http: httpx.AsyncClient, client: Client, engine: EngineServer
) -> None:
    """The next iteration streams before its first record, which stores its
    claim (the hand-over): a watcher that saw the commit takes the hand-over as the
    claim it is, and one that starts then, with the commit as the journal's
    tail, shows the next dispatch's chunks."""
    task, name = await start_run(client)
    agent = LoopStreamer()
    run = await client.start_run(name)
    async with (
        grpc.aio.insecure_channel(engine.target) as channel,
        sse(http, run.run_id) as stream,  # subscribed before the first chunk
        Worker(engine.target, handlers={task: agent}, poll_wait=1.0),
    ):
        await asyncio.wait_for(agent.reached.wait(), 20)
        tail = (await read_journal(engine, run.run_id))[-1]
        assert tail.HasField("commit") and tail.iteration == 0, "iteration 1 stored nothing yet"
        watcher = jgrpc.JournalServiceStub(channel)
        watch = watcher.WatchStream(jpb.WatchStreamRequest(run_id=run.run_id, step_id="agent"))
        first = await watch.read()  # subscribed, with the commit as the tail
        assert isinstance(first, jpb.WatchStreamResponse) and first.id == ""
        agent.gate.set()
        late = await _watch_until_committed(watch)
        watch.cancel()
        events = await until(stream, lambda e: e.type == "committed" and e.data["iteration"] == 2)
        done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == epb.RUN_STATUS_COMPLETED
    records = await read_journal(engine, run.run_id)
    handed = [r for r in records if r.iteration == 1 and r.HasField("leading_claim")]
    assert len(handed) == 1, "iteration 1 was handed over, its claim in its first record"
    for iteration in range(3):
        tokens = [e for e in events if e.type == "token" and e.data["iteration"] == iteration]
        assert "".join(e.data["text"] for e in tokens) == "".join(TOKENS), iteration
        writers = {r.writer for r in records if r.iteration == iteration}
        assert {e.data["writer"] for e in tokens} == writers, "the holder's own stream"
    assert not [e for e in events if e.type == "abandoned"]
    shown = [d for _, d in late if d["type"] == "token"]
    assert shown and {d["writer"] for d in shown} == {handed[0].writer}
    assert "".join(d["text"] for d in shown) == "".join(TOKENS[20:])
    assert late[-1][1]["record_seq"] == handed[0].seq


def _claim(run_id: str, attempt: int) -> jpb.ClaimRequest:
    return jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=0, attempt=attempt)


def _chunks(token: jpb.WriterToken, texts: list[str]) -> list[jpb.PutStreamRequest]:
    return [
        jpb.PutStreamRequest(token=token, position=0, seq=i, text=text)
        for i, text in enumerate(texts, 1)
    ]


async def _watch_until_committed(call: Any) -> list[tuple[str, dict[str, Any]]]:
    got = []
    while (response := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        got.append((response.id, json.loads(response.data)))
        if got[-1][1]["type"] == "committed":
            return got
    raise AssertionError(f"the watch ended after {len(got)} events")


async def test_a_watcher_started_after_the_claim_never_shows_the_fenced_holder(
    http: httpx.AsyncClient, client: Client, engine: EngineServer, nats_server: NatsServer
) -> None:
    """The zombie streams through the replica that made its claim, not its
    successor's, so nothing refuses its chunks; watchers that start after the
    successor's claim still know the holder, from the journal."""
    _task, name = await start_run(client)
    run = await client.start_run(name)  # no worker: the journal is driven by hand
    other = await start_engine(nats_server.url, config=FAST)  # a second journal replica
    try:
        async with (
            grpc.aio.insecure_channel(engine.target) as one,
            grpc.aio.insecure_channel(other.target) as two,
        ):
            via_one, via_two = jgrpc.JournalServiceStub(one), jgrpc.JournalServiceStub(two)
            zombie = (await via_two.Claim(_claim(run.run_id, 1))).claimed.token
            holder = (await via_one.Claim(_claim(run.run_id, 2))).claimed.token
            # Both watchers start after the successor's claim, one on each replica.
            watch = via_two.WatchStream(jpb.WatchStreamRequest(run_id=run.run_id, step_id="agent"))
            first = await watch.read()  # subscribed
            assert isinstance(first, jpb.WatchStreamResponse) and first.id == ""
            async with sse(http, run.run_id) as stream:
                put = await via_two.PutStream(iter(_chunks(zombie, ["stale ", "answer"])))
                assert (put.published, put.refused) == (2, 0), "the zombie's replica refused"
                await other.nc.flush()  # the zombie's chunks reach the readers first
                texts = ["fresh ", "answer"]
                put = await via_one.PutStream(iter(_chunks(holder, texts)))
                assert (put.published, put.refused) == (2, 0)
                response = json.dumps("".join(texts)).encode()
                await via_one.RecordModel(
                    jpb.RecordModelRequest(token=holder, position=0, response=response)
                )
                events = await until(stream, lambda e: e.type == "committed")
            watched = await _watch_until_committed(watch)
            watch.cancel()
    finally:
        await other.stop()
        await client.cancel_run(run.run_id, "done")
    for seen in ([e.data for e in events], [data for _, data in watched]):
        assert all(d["writer"] != zombie.writer for d in seen), "a fenced holder's chunk shown"
        assert [d["text"] for d in seen if d["type"] == "token"] == texts
        assert seen[-1]["writer"] == holder.writer and seen[-1]["response"] == "".join(texts)


async def test_a_watcher_that_falls_behind_gets_a_gap_and_every_marker(
    client: Client, engine: EngineServer
) -> None:
    _task, name = await start_run(client)
    run = await client.start_run(name)  # no worker: the journal is driven by hand
    count = live.WATCH_BUFFER * 3
    texts = [f"t{i} " for i in range(count)]
    # A small receive window: the watcher's unread events wait in the service.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 * 1024)]
    try:
        async with grpc.aio.insecure_channel(engine.target, options=options) as channel:
            stub = jgrpc.JournalServiceStub(channel)
            token = (await stub.Claim(_claim(run.run_id, 1))).claimed.token
            watch = stub.WatchStream(jpb.WatchStreamRequest(run_id=run.run_id, step_id="agent"))
            first = await watch.read()  # subscribed; from now on it does not read
            assert isinstance(first, jpb.WatchStreamResponse) and first.id == ""
            put = await asyncio.wait_for(stub.PutStream(iter(_chunks(token, texts))), 60)
            record = jpb.RecordModelRequest(
                token=token, position=0, response=json.dumps("".join(texts)).encode()
            )
            recorded = await asyncio.wait_for(stub.RecordModel(record), 30)
            # The writer is done and committed while the watcher has read nothing.
            assert (put.published, put.refused) == (count, 0)
            try:
                read = await asyncio.wait_for(_watch_until_committed(watch), 30)
            except TimeoutError:
                raise AssertionError("the watcher never got the committed marker") from None
            watch.cancel()
    finally:
        await client.cancel_run(run.run_id, "done")
    watched = [data for _, data in read]
    gaps = [d for d in watched if d["type"] == "gap"]
    assert gaps, "the watcher fell behind without a gap marked"
    tokens = [d for d in watched if d["type"] == "token"]
    covered = [d["seq"] for d in tokens]
    for gap in gaps:
        assert gap["dropped"] == gap["last_seq"] - gap["first_seq"] + 1
        covered += range(gap["first_seq"], gap["last_seq"] + 1)
    assert sorted(covered) == list(range(1, count + 1)), "a chunk is neither shown nor in a gap"
    assert [d["text"] for d in tokens] == [texts[d["seq"] - 1] for d in tokens]
    assert watched[-1]["type"] == "committed"
    assert watched[-1]["record_seq"] == recorded.token.last_seq
