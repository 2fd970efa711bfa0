"""One run write per iteration: the engine leaves a published outbox in the
run for its next write to replace, and never publishes a task again once an
outbox is older than JetStream's duplicate window, where a second copy would
be stored and could fence a live holder; the reconciler's stranded-step check
dispatches such a task anew if it was never published. A task is leased on
the run as the engine last wrote it, and settled as stale only on a read; one
whose run is not stored yet (its create publishes it with the run's write)
waits for it."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc.aio
import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from dagnats.core import jetstream as jsx
from dagnats.core import seam
from dagnats.core.ids import new_run_id
from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import (
    HISTORY_SUBJECTS,
    cancel_subject,
    history_consumer,
    partition_filters,
    task_subject,
    timer_subject,
)
from dagnats.engine import convert, definition, rules
from dagnats.engine import model as m
from dagnats.engine.convert import task_msg_id
from dagnats.engine.convert_workflow import stored_workflow
from dagnats.engine.processor import Engine
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import INDEX_THROUGH, EngineStore
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.sdk import Client, TaskContext, Worker
from tests.helpers import wait_for
from tests.secured import suite_security
from tests.stack import FAST, loop_workflow, steps_by_id, unique

ITERATIONS = 8
# The task stream's duplicate window in the outbox tests: short, so that a
# publish after it is stored again without the test waiting two minutes, with
# the engine's clock moved on by the real window to match.
SHORT_WINDOW = 0.5


async def test_an_iteration_writes_its_run_once(nats_server: NatsServer) -> None:
    task, name = unique("writes"), unique("writeswf")
    engine = await start_engine(nats_server.url, config=FAST)
    writes: list[str] = []

    async def written(msg: Msg) -> None:
        writes.append(msg.subject.removeprefix(f"$KV.{jsx.KV_RUNS}."))

    async def loop(tc: TaskContext) -> None:
        if tc.iteration + 1 < ITERATIONS:
            await tc.continue_()
        else:
            await tc.complete(tc.iteration)

    # Every write of a run is a message on its key's subject.
    tap = await engine.nc.subscribe(f"$KV.{jsx.KV_RUNS}.*", cb=written)
    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
            async with Worker(engine.target, handlers={task: loop}, poll_wait=1.0):
                run = await client.start_run(name)
                done = await client.wait_for_run(run.run_id, timeout=30)
    finally:
        await tap.unsubscribe()
        await engine.stop()
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert steps_by_id(done)["agent"].iterations == ITERATIONS - 1
    # The start, one write per continue, the end; the reconciler may clear an
    # outbox that stood a whole grace (a slow machine): one more at most.
    assert writes.count(run.run_id) <= ITERATIONS + 2, writes.count(run.run_id)


@pytest_asyncio.fixture(loop_scope="module")
async def short_window(nats_server: NatsServer) -> AsyncIterator[EngineStore]:
    """An engine's store, and the task stream with a ``SHORT_WINDOW`` duplicate
    window for one test. No engine runs: none publishes or clears an outbox
    while it is young, as a reconciler would."""
    nc = await jsx.connect(nats_server.url, name="test-engine-writes")
    js = nc.jetstream()
    await jsx.provision(js)
    config = (await js.stream_info(jsx.TASKS)).config
    config.duplicate_window = SHORT_WINDOW
    await js.update_stream(config)
    try:
        yield await EngineStore.open(nc)
    finally:
        config.duplicate_window = jsx.DEDUPE_WINDOW
        await js.update_stream(config)
        await nc.close()


def later_clock() -> float:
    return time.time() + jsx.DEDUPE_WINDOW


async def start_bare(run_id: str, task: str, engine: Engine) -> None:
    """A run of a one-step loop created by ``engine`` (no worker polls it)."""
    document = json.dumps(loop_workflow(unique("outboxwf"), task))
    accepted = rules.start_run(
        run_id=run_id,
        workflow=definition.parse_document(document),
        input=b"",
        now=time.time(),
    )
    await engine.create(accepted, {})


async def forget(store: EngineStore, run_id: str, subject: str) -> None:
    await store.purge_subject(jsx.TASKS, subject)
    await store.delete_run(run_id)


async def tasks_of(nc: NATS, subject: str) -> list[str]:
    """The Msg-Ids of the task messages stored on ``subject``, oldest first."""
    js = nc.jetstream()
    ids: list[str] = []
    seq = 1
    while True:
        try:
            msg = await jsx.get_msg(js, jsx.TASKS, seq=seq, subject=subject, next=True)
        except Exception:
            return ids
        ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))
        seq = int(msg.seq or 0) + 1


async def window_passed(nc: NATS, probe: str) -> bool:
    ack = await nc.jetstream().publish(
        f"tasks.probe.{probe}.x", b"", headers={"Nats-Msg-Id": probe}
    )
    return not ack.duplicate


# The wait below may last the default window: past the suite's 120 s.
@pytest.mark.timeout(jsx.DEDUPE_WINDOW + 60)
async def test_a_task_of_an_outbox_past_the_duplicate_window_is_not_published_again(
    short_window: EngineStore,
) -> None:
    store, task, run_id = short_window, unique("oldbox"), new_run_id()
    nc = store.nc
    await start_bare(run_id, task, Engine(store, FAST))  # published, left in the run
    subject = task_subject(task, run_id, "agent")
    assert await tasks_of(nc, subject) == [task_msg_id(run_id, "agent", 0, 1)]
    probe = unique("probe")  # published after the task: once it counts again, so would the task
    assert await window_passed(nc, probe)
    # nats-server forgets a Msg-Id when a timer of its own fires. The timer
    # runs on the window it was set with: one an earlier test's publish set
    # under the default window (120 s) fires up to that long after the window
    # was shortened (twice in CI: past 20 s, then past the 120 s test
    # timeout). Waited for up to the default window, which no timer outlasts.
    await wait_for(
        lambda: window_passed(nc, probe),
        timeout=jsx.DEDUPE_WINDOW + 10,
        interval=0.2,
        message="window not over",
    )
    # Another engine, two minutes on, applies an input to the run: it reads
    # the run and finds the outbox, whose task is current and may be held.
    later = Engine(store, FAST, clock=later_clock)
    await later.apply(run_id, m.InputArrived(step_id="agent"))
    assert await tasks_of(nc, subject) == [task_msg_id(run_id, "agent", 0, 1)]
    await forget(store, run_id, subject)


async def test_a_task_never_published_from_an_old_outbox_is_dispatched_anew(
    short_window: EngineStore,
) -> None:
    store, task, run_id = short_window, unique("lostbox"), new_run_id()
    nc = store.nc

    async def crash(point: str) -> None:
        if point == "before_first_tasks":
            raise RuntimeError("the engine died storing the run, its task not published")

    seam.install(crash)
    try:
        with pytest.raises(RuntimeError):
            await start_bare(run_id, task, Engine(store, FAST))
    finally:
        seam.install(None)
    subject = task_subject(task, run_id, "agent")
    assert await tasks_of(nc, subject) == []
    later = Engine(store, FAST, clock=later_clock)
    await later.start()  # its reconciler finds the outbox, two minutes old
    try:

        async def dispatched() -> bool:
            return bool(await tasks_of(nc, subject))

        await wait_for(dispatched, timeout=30, message="the step was not dispatched again")
    finally:
        await later.stop()
    first = task_msg_id(run_id, "agent", 0, 1)
    assert await tasks_of(nc, subject) == [f"{first}.r1"]  # a new dispatch, not the old one
    assert later.counters["old_task_left"] >= 1
    assert later.counters["redispatched"] == 1
    await forget(store, run_id, subject)


async def test_a_task_dispatched_by_another_engine_is_leased_though_this_one_guessed_older(
    nats_server: NatsServer,
) -> None:
    # The engine that started the run keeps it as it wrote it, and checks a
    # task it leases against that first: a dispatch made since by another
    # engine looks stale there, and only a read may settle a task as stale.
    async with two_engines(nats_server, "guessed") as (engine, other, task, name):
        async with Client(engine.target) as client:
            run = await client.start_run(name)  # no worker: its task waits
        report = m.StepReport(
            step_id="agent", identity=m.Identity(iteration=0, attempt=1), outcome=m.Continued()
        )
        await other.apply(run.run_id, report)  # iteration 1, dispatched by the other
        async with grpc.aio.insecure_channel(engine.target) as channel:
            request = pb.PollTasksRequest(task_types=[task], max_tasks=2)
            request.wait.FromSeconds(5)
            polled = await pb_grpc.EngineServiceStub(channel).PollTasks(request)
    assert 1 in [t.task.iteration for t in polled.tasks], "the current task was settled as stale"


async def left_unpublished(
    store: EngineStore, task: str, run_id: str, outcome: m.StepOutcome
) -> Engine:
    """Two engines, no reconciler: one starts the run and keeps it as it
    wrote it; the other applies the step's ``outcome`` to iteration 0, writes
    the run with its outbox and dies before publishing it. Returns the first."""
    first = Engine(store, FAST)
    await start_bare(run_id, task, first)
    other = Engine(await EngineStore.open(store.nc), FAST)

    async def die(point: str) -> None:
        if point == "after_dispatch_saved":
            raise RuntimeError("the engine died with its write's outbox unpublished")

    report = m.StepReport(
        step_id="agent", identity=m.Identity(iteration=0, attempt=1), outcome=outcome
    )
    seam.install(die)
    try:
        with pytest.raises(RuntimeError):
            await other.apply(run_id, report)
    finally:
        seam.install(None)
    return first


async def test_an_outbox_another_engine_left_is_published_by_the_engine_whose_guess_missed(
    bare: EngineStore,
) -> None:
    # The other engine's write holds the next iteration's task. The first
    # engine's next change misses its guess and reads the run: the task it
    # finds in the outbox is published then, not left for the reconciler.
    task, run_id = unique("missed"), new_run_id()
    first = await left_unpublished(bare, task, run_id, m.Continued())
    subject = task_subject(task, run_id, "agent")
    assert await tasks_of(bare.nc, subject) == [task_msg_id(run_id, "agent", 0, 1)]
    await first.apply(run_id, m.InputArrived(step_id="agent"))
    assert await tasks_of(bare.nc, subject) == [
        task_msg_id(run_id, "agent", 0, 1),
        task_msg_id(run_id, "agent", 1, 1),
    ], "the other engine's task waits for the reconciler"
    await forget(bare, run_id, subject)


async def test_a_wake_another_engine_left_in_its_outbox_is_set_by_the_engine_that_reads_it(
    bare: EngineStore,
) -> None:
    # The other engine's write pauses the step: its outbox holds the step's
    # wake timer. No reconciler pass would find it (the step waits, it has no
    # task to miss): set by the next engine that reads the run, or the step
    # waits for good.
    task, run_id = unique("missedwake"), new_run_id()
    first = await left_unpublished(bare, task, run_id, m.Paused(duration=3600.0))
    js = bare.nc.jetstream()
    subject = timer_subject(run_id, "agent")
    with pytest.raises(nats.js.errors.NotFoundError):
        await jsx.get_msg(js, jsx.TIMERS, subject=subject)
    await first.apply(run_id, m.InputArrived(step_id="agent"))
    wake = ipb.Timer.FromString((await jsx.get_msg(js, jsx.TIMERS, subject=subject)).data or b"")
    assert (wake.iteration, wake.attempt) == (0, 2), "the step's wake was lost"
    await bare.purge_subject(jsx.TIMERS, subject)
    await forget(bare, run_id, task_subject(task, run_id, "agent"))


@contextlib.asynccontextmanager
async def two_engines(
    nats_server: NatsServer, prefix: str
) -> AsyncIterator[tuple[EngineServer, Engine, str, str]]:
    """An engine server with a loop workflow of task type ``prefix``
    registered, and another engine without a server: (server, other engine,
    task type, workflow)."""
    engine = await start_engine(nats_server.url, config=FAST)
    task, name = unique(prefix), unique(prefix + "wf")
    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
        yield engine, Engine(await EngineStore.open(engine.nc), FAST), task, name
    finally:
        await engine.stop()


async def test_a_task_that_comes_before_its_run_is_stored_waits_for_it(
    nats_server: NatsServer,
) -> None:
    # A run's create publishes its first task while it writes the run (ADR 41),
    # here by another engine whose write has not landed when this one's poll
    # gets the task: the task is given back, not settled, and leased once the
    # run is stored.
    async with two_engines(nats_server, "early") as (engine, other, task, name):
        workflow = stored_workflow(await engine.engine.store.get_workflow(name))
        accepted = rules.start_run(
            run_id=new_run_id(), workflow=workflow, input=b"", now=time.time()
        )
        run_id = accepted.run.run_id
        (first,) = [
            convert.outbox_entry(e, {}, time.time())
            for e in accepted.effects
            if isinstance(e, m.DispatchTask)
        ]
        await engine.engine.store.publish(first)  # the other's task, its run not stored yet
        subject = task_subject(task, run_id, "agent")
        async with grpc.aio.insecure_channel(engine.target) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            request = pb.PollTasksRequest(task_types=[task])
            request.wait.FromSeconds(2)
            early = await stub.PollTasks(request)
            assert list(early.tasks) == [], "a task was leased for a run that is not stored"
            assert await tasks_of(engine.nc, subject) == [first.msg_id], "the task was settled"
            await other.create(accepted, {})  # its run lands; the task is not stored again
            leased: list[pb.LeasedTask] = []

            async def leased_once() -> bool:
                leased.extend((await stub.PollTasks(request)).tasks)
                return bool(leased)

            await wait_for(leased_once, timeout=20, message="the task was not leased")
        (got,) = leased
        assert (got.task.run_id, got.task.iteration, got.task.attempt) == (run_id, 0, 1)
        assert got.delivery >= 2  # given back once at least
        assert await tasks_of(engine.nc, subject) == [first.msg_id]  # stored once


@pytest_asyncio.fixture(loop_scope="module")
async def bare(nats_server: NatsServer) -> AsyncIterator[EngineStore]:
    """An engine's store on the module's server with no engine running: no
    reconciler pass but the test's own."""
    nc = await jsx.connect(nats_server.url, name="test-engine-index")
    await jsx.provision(nc.jetstream())
    try:
        store = await EngineStore.open(nc)
        # The index listed exactly. The store lists it with a KV watcher,
        # whose "no more keys" marker can overtake the keys (nats-py puts it
        # when the consumer's info, answered first, shows nothing pending and
        # nothing received yet): about one listing in 300 leaves a run out,
        # which the reconciler allows (the run waits one more pass) but which
        # makes a pass enter it again. These tests check what a pass does
        # with the index as it is.
        store.active_runs = functools.partial(exact_index, store)  # type: ignore[method-assign]
        yield store
    finally:
        await nc.close()


async def exact_index(store: EngineStore) -> dict[str, int]:
    """The active-run index's entries with their revisions, read message by
    message: no entry is left out."""
    marks = (INDEX_THROUGH, "index-complete")
    return {
        key: revision
        async for key, _, revision in jsx.walk_kv(store.js, jsx.KV_ACTIVE_RUNS)
        if key not in marks
    }


async def test_a_run_is_stored_without_an_index_entry_and_the_next_pass_enters_it_once(
    bare: EngineStore,
) -> None:
    store, task, run_id = bare, unique("indexed"), new_run_id()
    await start_bare(run_id, task, Engine(store, FAST))
    assert run_id not in await store.active_run_ids()
    assert run_id in await store.indexed_runs()
    assert run_id in await store.active_run_ids()
    # The pass moved the index's mark past the run's write: a later pass
    # that finds it out of the index (a park's purge) does not enter it again.
    await store.leave_active(run_id)
    assert run_id not in await store.indexed_runs()
    await forget(store, run_id, task_subject(task, run_id, "agent"))


def rewritten(record: ipb.RunRecord, *, unindexed: bool, parked_entry: int) -> ipb.RunRecord:
    copy = ipb.RunRecord()
    copy.CopyFrom(record)
    copy.unindexed, copy.parked_entry = unindexed, parked_entry
    return copy


async def test_a_write_after_a_park_is_entered_again_beside_the_entry_the_park_purges(
    bare: EngineStore,
) -> None:
    # A park writes the run flagged, then purges the index entry it read. A
    # wake written in between clears the flag; a pass that reads the wake and
    # that entry before the purge must enter the run again, or the late purge
    # leaves a running run that no pass reads.
    store, task, run_id = bare, unique("woken"), new_run_id()
    await start_bare(run_id, task, Engine(store, FAST))
    entry = await store.enter_active(run_id)
    stored = await store.require_run(run_id)
    flagged = rewritten(stored.record, unindexed=True, parked_entry=entry)
    revision = await store.update_run(flagged, stored.revision)
    assert (await store.indexed_runs())[run_id] == entry  # a flagged write: nothing entered
    woken = rewritten(flagged, unindexed=False, parked_entry=entry)
    await store.update_run(woken, revision)
    assert (await store.indexed_runs())[run_id] > entry
    await store.leave_active(run_id, through=entry)  # the park's purge, late
    newer = (await store.active_runs()).get(run_id)
    assert newer is not None, "the woken run was left out of the index"
    # A write beside an entry newer than its park's is left to that entry.
    stored = await store.require_run(run_id)
    await store.update_run(stored.record, stored.revision)
    assert (await store.indexed_runs())[run_id] == newer
    await forget(store, run_id, task_subject(task, run_id, "agent"))


class RunWrites:
    """Every write of one run nats-server takes in, as core subscribers hear
    them: its key in the runs bucket, its key in the active-run index, a
    purge of that key, and its cancel's announcement."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.heard: list[str] = []
        self.announced = 0
        self._subs: list[object] = []

    async def listen(self, nc: NATS) -> None:
        async def write(msg: Msg) -> None:
            self.heard.append(msg.subject)

        async def purge(msg: Msg) -> None:
            if self.run_id in msg.data.decode(errors="replace"):
                self.heard.append(msg.subject)

        async def announce(msg: Msg) -> None:
            self.announced += 1

        self._subs = [
            await nc.subscribe(f"$KV.{jsx.KV_RUNS}.{self.run_id}", cb=write),
            await nc.subscribe(f"$KV.{jsx.KV_ACTIVE_RUNS}.{self.run_id}", cb=write),
            await nc.subscribe(f"$JS.API.STREAM.PURGE.KV_{jsx.KV_ACTIVE_RUNS}", cb=purge),
            await nc.subscribe(cancel_subject(self.run_id), cb=announce),
        ]
        await nc.flush()


async def test_the_write_that_ends_a_run_leaves_the_reconciler_nothing_to_write(
    tmp_path: Path,
) -> None:
    """A run ends with an outbox (its purge timer, its steps' inputs closed),
    which its engine publishes. The reconciler's passes after it, the first
    of which reads that write, write nothing of the run: no index entry, no
    clear of the outbox, no purge of an entry (three writes before). A
    nats-server of its own, so that no other test's run is in the bucket."""
    task, name = unique("ends"), unique("endswf")
    config = replace(FAST, reconcile_interval=600.0, outbox_grace=0.0)  # passes by hand
    nats_server = await NatsServer.start(tmp_path, security=suite_security())
    engine = await start_engine(nats_server.url, config=config)
    store = engine.engine.store

    async def done(tc: TaskContext) -> None:
        await tc.complete("done")

    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
            async with Worker(engine.target, handlers={task: done}, poll_wait=1.0):
                run = await client.start_run(name)
                ended = await client.wait_for_run(run.run_id, timeout=30)
        assert ended.status == pb.RUN_STATUS_COMPLETED
        stored = await store.load_run(run.run_id)
        assert stored is not None and stored.record.outbox, "it ends with an outbox"
        writes = RunWrites(run.run_id)
        await writes.listen(store.nc)
        runs_last = (await store._runs_info()).state.last_seq
        for _ in range(3):
            await engine.engine.reconcile()
        await store.nc.flush()
        assert await store.index_mark() >= stored.revision, "a pass read the run's end"
        assert writes.heard == []
        assert (await store._runs_info()).state.last_seq == runs_last
        assert run.run_id not in await store.active_runs()
    finally:
        await engine.stop()
        await nats_server.stop()


async def test_an_end_whose_outbox_was_not_published_is_published_by_the_pass_that_reads_it(
    short_window: EngineStore,
) -> None:
    """The engine that cancels a run stops after the write that ends it,
    before publishing its outbox. The next reconciler pass, of an engine that
    knows nothing of it, reads the write and publishes the outbox (the
    cancel is announced), and writes nothing of the run."""
    store, task, run_id = short_window, unique("unpublished"), new_run_id()
    config = replace(FAST, outbox_grace=0.0)
    # The consumer a pass reads the history's floor from, as a started engine makes it.
    await store.ensure_consumer(
        jsx.HISTORY,
        history_consumer(0),
        config.history_ack_wait,
        partition_filters(HISTORY_SUBJECTS, 0, 1),
    )
    await start_bare(run_id, task, Engine(store, config))

    async def crash(point: str) -> None:
        if point == "after_dispatch_saved":
            raise RuntimeError("the engine died after the run's last write")

    seam.install(crash)
    try:
        with pytest.raises(RuntimeError):
            await Engine(store, config).apply(run_id, m.CancelRequested(reason="stop"))
    finally:
        seam.install(None)
    stored = await store.load_run(run_id)
    assert stored is not None and stored.record.run.status == pb.RUN_STATUS_CANCELLED
    writes = RunWrites(run_id)
    await writes.listen(store.nc)
    later = Engine(store, config)
    await later.reconcile()
    await store.nc.flush()
    assert writes.announced == 1, "the pass published the outbox the cancel left"
    assert later.counters["end_outbox_published"] == 1
    assert writes.heard == []
    await later.reconcile()
    await store.nc.flush()
    assert writes.announced == 1 and writes.heard == []
    await forget(store, run_id, task_subject(task, run_id, "agent"))
