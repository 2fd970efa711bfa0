"""A kept iteration's run write waits, the deferred write (ADR 37): while a journaled loop carries
on with the task its holder kept, the engine decides each next iteration on
the run as it last wrote it and stores the run later, once for a batch. Its
commits in the journal hold the iterations meanwhile, and whoever reads the
run to decide on it (a cancel, a heartbeat, a lease, ``GetRun``) catches up
from them. These check what a user would see: fewer writes of the run, and
the same run, journal and handler signals as when every iteration was
written.

The module's engine keeps its decisions unwritten for a minute, so the run as
stored stays behind its journal for a whole run and every reader has to
catch up.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import AsyncIterator

import nats
import pytest_asyncio
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.engine import convert
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client
from tests.helpers import wait_for
from tests.stack import FAST, steps_by_id
from tests.test_held_dispatch import Loop, completed, js, released, run_loop
from tests.test_journal import NO_HEARTBEAT, journal_check

LAGGING = dataclasses.replace(FAST, kept_write_batch=1000, kept_write_delay=60.0)
K = 8
__all__ = ["js"]  # the fixture, shared with the kept-task tests


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    server = await start_engine(nats_server.url, config=LAGGING)
    yield server
    await server.stop()


@dataclasses.dataclass
class RunsBucket:
    """The writes and reads of each run's key in the runs bucket, as
    nats-server routes them: publishes to the key, and requests to the
    bucket's message-get API for it."""

    writes: Counter[str] = dataclasses.field(default_factory=Counter)
    reads: Counter[str] = dataclasses.field(default_factory=Counter)


@pytest_asyncio.fixture(loop_scope="module")
async def runs_bucket(nats_server: NatsServer) -> AsyncIterator[RunsBucket]:
    bucket = RunsBucket()
    nc = await nats.connect(nats_server.url)
    prefix = "$KV.RUNS."

    async def wrote(msg: Msg) -> None:
        bucket.writes[msg.subject[len(prefix) :]] += 1

    async def read(msg: Msg) -> None:
        subject = json.loads(msg.data).get("last_by_subj", "")
        if subject.startswith(prefix):
            bucket.reads[subject[len(prefix) :]] += 1

    await nc.subscribe(f"{prefix}>", cb=wrote)
    await nc.subscribe("$JS.API.STREAM.MSG.GET.KV_RUNS", cb=read)
    await nc.flush()
    yield bucket
    await nc.close()


async def test_kept_iterations_are_written_with_the_runs_next_other_change(
    client: Client, engine: EngineServer, runs_bucket: RunsBucket
) -> None:
    loop = Loop(k=K)
    # No automatic heartbeat: on a loaded machine one fires within the run,
    # and a heartbeat's check of its holder reads the run, which is
    # not what this counts.
    run = await run_loop(client, engine, loop, heartbeat_interval=NO_HEARTBEAT)
    await completed(engine, run, K)
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    # The start, the first kept iteration (it says the message is kept), the
    # end; none of the six iterations kept after the first.
    assert runs_bucket.writes[run.run_id] <= 4, runs_bucket.writes[run.run_id]
    assert engine.engine.counters["kept_unwritten"] >= K - 2
    # Nor are they read: on one server the engine hears every other write of
    # a run (heard writes), so it knows nobody wrote the run since it did. The
    # reads are the first lease's and the client's wait.
    assert runs_bucket.reads[run.run_id] <= 3, runs_bucket.reads[run.run_id]


async def test_a_run_behind_its_journal_is_read_caught_up(
    client: Client, engine: EngineServer
) -> None:
    # Paused in iteration 5 after a heartbeat. The run as stored says
    # iteration 1; the journal has the commits of 0 to 4.
    loop = Loop(k=K, pause_at=5, heartbeat=True)
    seen: list[int] = []
    tails: list[tuple[int, str]] = []

    async def read(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 5 running")
        stored = await engine.engine.store.require_run(run_id)
        seen.append(steps_by_id(stored.record.run)["agent"].iteration)
        got = await client.get_run(run_id)
        seen.append(steps_by_id(got)["agent"].iteration)
        assert engine.engine.journal is not None
        tail = await engine.engine.journal.last_written(run_id, "agent")
        assert tail is not None
        tails.append((tail.record.iteration, tail.record.WhichOneof("kind") or ""))
        loop.go.set()

    run = await run_loop(client, engine, loop, during=read)
    await completed(engine, run, K)
    # The holder's model response is the journal's last record: iteration 4's
    # commit has a record after it, so GetRun gives iteration 5, where the
    # holder is, as the engine decided it.
    assert tails == [(5, "model")]
    assert seen == [1, 5]
    # The holder's heartbeat, checked against the run caught up, kept its
    # lease: every iteration ran on the first delivery, nothing was fenced.
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    assert loop.signals == []


async def test_the_run_kept_with_a_guess_is_the_run_its_record_stores(
    client: Client, engine: EngineServer
) -> None:
    # The engine decides a kept iteration on the run it kept with its last
    # decision, without decoding the record it wrote or keeps unwritten
    # (the guessed run): that run must be the one the record stores, field for field.
    loop = Loop(k=K, pause_at=5)
    guesses: list[StoredRun | None] = []

    async def look(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 5 running")
        guesses.append(engine.engine.last_written(run_id))
        loop.go.set()

    run = await run_loop(client, engine, loop, during=look)
    await completed(engine, run, K)
    (guess,) = guesses
    assert guess is not None and guess.run is not None
    assert steps_by_id(guess.record.run)["agent"].iteration == 5
    assert guess.run.step("agent").iteration == 5
    encoded = convert.record_to_proto(guess.run, [], None, dict(guess.record.trace_context))
    assert encoded == guess.record


async def test_a_cancel_of_a_run_behind_its_journal_stops_its_holder(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    loop = Loop(k=K, pause_at=5)

    async def cancel(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 5 running")
        await client.cancel_run(run_id, reason="enough")
        loop.go.set()

    run = await run_loop(client, engine, loop, during=cancel)
    assert run.status == pb.RUN_STATUS_CANCELLED
    # The cancel was decided on the run caught up with the journal: the five
    # iterations the holder committed before it count, not the one after.
    assert steps_by_id(run)["agent"].iterations == 5
    assert [i for i, _, _ in loop.ran] == list(range(6)), "no iteration after the cancel"
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations
    await released(js)


async def test_a_cancel_by_another_engine_stops_the_holder_of_unwritten_iterations(
    client: Client, engine: EngineServer, nats_server: NatsServer
) -> None:
    # Another engine process cancels the run: it reads the run behind the
    # journal and catches up. The holder's engine decided iterations 2 to 4
    # on its own last write; its next decision finds the run written since
    # (the cancel) and is made on it, so nothing runs after the cancel.
    loop = Loop(k=K, pause_at=5)
    other = await start_engine(nats_server.url, config=LAGGING, with_journal=False)
    try:
        async with Client(other.target) as elsewhere:

            async def cancel(run_id: str) -> None:
                await wait_for(loop.reached.is_set, timeout=20, message="iteration 5 running")
                await elsewhere.cancel_run(run_id, reason="enough")
                loop.go.set()

            run = await run_loop(client, engine, loop, during=cancel)
    finally:
        await other.stop()
    assert run.status == pb.RUN_STATUS_CANCELLED
    assert steps_by_id(run)["agent"].iterations == 5
    assert [i for i, _, _ in loop.ran] == list(range(6)), "no iteration after the cancel"
    # The holder's commit of iteration 5 came after the cancel: the journal,
    # sealed by the cancel, refused it, so no engine had to catch it.
    assert engine.journal is not None
    records = await engine.journal.store.read(run.run_id, "agent", after=0)
    assert records[-1].HasField("cancel"), records[-1]
    assert not [r for r in records if r.HasField("commit") and r.iteration == 5]


async def test_a_kept_task_lost_between_a_commit_and_the_next_record_runs_the_next_iteration(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # The holder committed iteration 1 on its kept message, and the engine
    # decided iteration 2 without writing it: the run as stored says
    # iteration 1, and the journal's last record is iteration 1's commit.
    # The message is then lost (a stale holder's release, an operator's
    # purge) before the holder writes anything of iteration 2. The
    # reconciler must take the commit as decided and dispatch iteration 2
    # again: iteration 1 dispatched again would find the journal past it,
    # once the holder wrote, and be settled as stale, for ever.
    loop = Loop(k=K, hold_at=2)

    async def lose_the_message(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 2 began")
        stored = await engine.engine.store.require_run(run_id)
        assert steps_by_id(stored.record.run)["agent"].iteration == 1
        held = stored.record.step_records["agent"].held_seq
        assert held, "the loop runs on its kept message"
        await js.delete_msg(jsx.TASKS, held)

        async def rewritten() -> bool:
            now = await engine.engine.store.require_run(run_id)
            return now.revision > stored.revision

        await wait_for(rewritten, timeout=20, message="the reconciler wrote the run")
        loop.go.set()  # the holder writes iteration 2's first record

    # One task at a time: the holder writes before a new message is leased.
    run = await run_loop(client, engine, loop, during=lose_the_message, concurrency=1)
    await completed(engine, run, K)
    assert [i for i, _, _ in loop.ran].count(1) == 1, loop.ran
