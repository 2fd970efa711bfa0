"""A journaled loop keeps its task message across iterations (ADR 31): a
continue without a wait is answered with the next iteration's dispatch, which
the same message and lease carry, so an agent loop publishes one task, not
one an iteration. These check what a user of the task queue would see: how
many tasks a run published, the delivery each iteration ran on, and that a
kept task is heartbeated, reconciled, cancelled and given back like any other.
The commit's event goes to the engine over core NATS (or by a call, to the
engine of the journal service's own process) and is stored on the history
only when no engine answered (ADRs 33 and 36).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest_asyncio
from nats.js import JetStreamContext

from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import COMMIT_EVENTS, DIRECT_QUEUE, history_subject
from dagnats.engine.report import (
    InProcess,
    TaskSettler,
    ToOneEngine,
    commit_event_route,
    outcome_msg_id,
)
from dagnats.engine.server import EngineServer, start_engine, start_services
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.journal import service as journal_service
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, JournalClient, TaskContext, Worker, run_output
from tests.helpers import wait_for
from tests.journal_agent import Crasher
from tests.secured import suite_security
from tests.stack import FAST, loop_workflow, socket_dir, steps_by_id, unique
from tests.test_journal import journal_check

K = 6


@pytest_asyncio.fixture(loop_scope="module")
async def js(nats_server: NatsServer) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_server.url)
    yield nc.jetstream()
    await nc.close()


async def history_events(js: JetStreamContext, run_id: str) -> int:
    """The events stored on a finished run's history, once the last of them
    is: the close of its step's inputs, published after the run's final
    write (which a client may see first)."""
    subject = history_subject(run_id)

    async def closed() -> bool:
        try:
            last = await js.get_last_msg(jsx.HISTORY, subject)
        except nats.js.errors.NotFoundError:
            return False  # nothing stored on it yet
        return ipb.HistoryEvent.FromString(last.data or b"").inputs.close

    await wait_for(closed, message=f"the close of run {run_id}'s inputs on its history")
    info = await js.stream_info(jsx.HISTORY, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def tasks_published(js: JetStreamContext) -> int:
    """Messages ever stored in the task queue (a work queue keeps none it gave out)."""
    info = await js.stream_info(jsx.TASKS)
    return int(info.state.last_seq)


@dataclass
class Loop:
    """A journaled loop of ``k`` iterations, one model call each, recording
    the dispatch and delivery each iteration ran on."""

    k: int = K
    ran: list[tuple[int, int, int]] = field(default_factory=list)  # iteration, attempt, delivery
    signals: list[str] = field(default_factory=list)
    heartbeat: bool = False
    pause_at: int | None = None  # an iteration that waits for ``go`` before it commits
    hold_at: int | None = None  # an iteration that waits for ``go`` before it writes
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, tc: TaskContext) -> None:
        try:
            if tc.iteration == self.hold_at and not self.go.is_set():
                self.reached.set()
                await self.go.wait()
            j = await tc.journal()
            self.ran.append((tc.iteration, tc.attempt, tc.delivery))
            await j.model(lambda: _answer(tc.iteration))
            if self.heartbeat:
                await tc.heartbeat()
            if tc.iteration == self.pause_at:
                self.reached.set()
                await self.go.wait()
            if tc.iteration + 1 >= self.k:
                await tc.complete({"iterations": tc.iteration + 1})
            else:
                await tc.continue_()
        except BaseException as signal:
            self.signals.append(type(signal).__name__)
            raise


async def _answer(iteration: int) -> dict[str, Any]:
    return {"turn": iteration}


async def run_loop(
    client: Client,
    engine: EngineServer,
    loop: Loop,
    *,
    during: Callable[[str], Awaitable[None]] | None = None,
    **worker: Any,
) -> pb.Run:
    task, name = unique("kept"), unique("keptwf")
    await client.register_workflow(loop_workflow(name, task))
    async with Worker(engine.target, handlers={task: loop}, poll_wait=1.0, **worker):
        run = await client.start_run(name)
        if during is not None:
            await during(run.run_id)
        return await client.wait_for_run(run.run_id, timeout=40)


async def completed(engine: EngineServer, run: pb.Run, k: int = K) -> None:
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert steps_by_id(run)["agent"].iterations == k - 1  # continues; the last completes
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


async def test_a_loop_runs_on_the_one_task_its_first_dispatch_published(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    before = await tasks_published(js)
    loop = Loop()
    run = await run_loop(client, engine, loop)
    await completed(engine, run)
    assert await tasks_published(js) - before == 1
    # Every iteration ran on the first delivery of that one message.
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    assert loop.signals == []


async def test_without_kept_iterations_each_iteration_is_a_task_of_its_own(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    before = await tasks_published(js)
    loop = Loop()
    run = await run_loop(client, engine, loop, kept_iterations=0)
    await completed(engine, run)
    assert await tasks_published(js) - before == K
    assert loop.ran == [(i, 1, 1) for i in range(K)]


async def test_a_kept_task_goes_back_to_the_queue_after_kept_iterations(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # Kept twice in a row, then given back: three iterations a task, so that
    # other runs' tasks get a turn between.
    before = await tasks_published(js)
    run = await run_loop(client, engine, Loop(), kept_iterations=2)
    await completed(engine, run)
    assert await tasks_published(js) - before == K // 3


async def test_a_kept_task_is_heartbeated_by_its_holder(
    client: Client, engine: EngineServer
) -> None:
    # The message was published for iteration 0; from iteration 1 on the
    # journal is past that, and only the kept dispatch in the run says the
    # holder's lease is current: a heartbeat must not be refused as fenced.
    loop = Loop(heartbeat=True)
    run = await run_loop(client, engine, loop)
    await completed(engine, run)
    assert loop.signals == []


async def test_the_reconciler_leaves_a_kept_task_in_flight(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    loop = Loop(pause_at=3)
    redispatched = engine.engine.counters["redispatched"]
    before = await tasks_published(js)

    async def reconcile_while_kept(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 3 running")
        # Two passes: a step is redispatched when two in a row find its task gone.
        await engine.engine.reconcile()
        await engine.engine.reconcile()
        loop.go.set()

    run = await run_loop(client, engine, loop, during=reconcile_while_kept)
    await completed(engine, run)
    assert engine.engine.counters["redispatched"] == redispatched
    assert await tasks_published(js) - before == 1


async def test_cancelling_a_run_releases_its_kept_task(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    loop = Loop(pause_at=2)

    async def cancel_while_kept(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 2 running")
        await client.cancel_run(run_id)
        loop.go.set()

    run = await run_loop(client, engine, loop, during=cancel_while_kept)
    assert run.status == pb.RUN_STATUS_CANCELLED
    await released(js)


async def released(js: JetStreamContext) -> None:
    """Wait until the task queue holds no message: the kept task was released."""

    async def queue_empty() -> bool:
        info = await js.stream_info(jsx.TASKS)
        return int(info.state.messages) == 0

    await wait_for(queue_empty, timeout=20, message="the kept task was not released")


async def test_a_kept_task_whose_holder_goes_silent_is_delivered_again_for_its_iteration(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # The holder stops in iteration 2, which its task was kept for, and sends
    # no heartbeat: the message comes back when its lease runs out, leased as
    # iteration 2 (not the iteration 0 it was published for), and the next
    # worker's claim fences the silent one.
    task, name = unique("kept"), unique("keptwf")
    await client.register_workflow(loop_workflow(name, task))
    silent, successor = Loop(pause_at=2), Loop()
    before = await tasks_published(js)
    # One slot: the silent worker polls for nothing while it holds the task.
    async with Worker(
        engine.target,
        handlers={task: silent},
        poll_wait=1.0,
        heartbeat_interval=3600,
        concurrency=1,
    ):
        run = await client.start_run(name)
        await wait_for(silent.reached.is_set, timeout=20, message="iteration 2 running")
        async with Worker(engine.target, handlers={task: successor}, poll_wait=1.0):
            done = await client.wait_for_run(run.run_id, timeout=40)
        silent.go.set()  # the silent holder wakes: fenced, it writes nothing
    await completed(engine, done)
    assert successor.ran[0] == (2, 1, 2)
    assert silent.ran == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    assert await tasks_published(js) - before == 1


async def test_a_stopping_worker_releases_its_kept_task_with_its_next_commit(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # Kept, the task would wait out its lease before the other worker got it;
    # released, the next iteration goes through the queue at once, as a new
    # task delivered for the first time.
    task, name = unique("kept"), unique("keptwf")
    await client.register_workflow(loop_workflow(name, task))
    stopping, successor = Loop(pause_at=2), Loop()
    before = await tasks_published(js)
    first = Worker(engine.target, handlers={task: stopping}, poll_wait=1.0, concurrency=1)
    async with first:
        run = await client.start_run(name)
        await wait_for(stopping.reached.is_set, timeout=20, message="iteration 2 running")
        async with Worker(engine.target, handlers={task: successor}, poll_wait=1.0):
            stop = asyncio.create_task(first.stop())
            await wait_for(lambda: first._stopping.is_set(), timeout=5)
            stopping.go.set()  # iteration 2 commits while its worker stops
            await stop
            done = await client.wait_for_run(run.run_id, timeout=40)
    await completed(engine, done)
    assert stopping.ran == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    assert successor.ran[0] == (3, 1, 1)
    assert await tasks_published(js) - before == 2


async def test_a_stopping_worker_gives_back_the_task_its_commit_kept_before_the_stop(
    tmp_path: Path,
) -> None:
    # Iteration 2's commit asks to keep the task and is stored; the worker
    # stops while its answer, the next dispatch, is on the way. The worker
    # does not begin iteration 3: it hands the message back, and the other
    # worker runs iteration 3 (dispatched anew: the run as stored is behind
    # the kept iterations). The lease is ten minutes long, so the run
    # finishes only if the message came back at once.
    server = await NatsServer.start(tmp_path / "nats", security=suite_security())
    config = dataclasses.replace(FAST, task_ack_wait=600.0)
    with socket_dir() as sockets:
        engine = await start_engine(server.url, config=config, local_socket=sockets / "l.sock")
    try:
        async with Client(engine.target) as client:
            task, name = unique("kept"), unique("keptwf")
            await client.register_workflow(loop_workflow(name, task))
            stopping, successor = Loop(), Loop()
            first = Worker(engine.target, handlers={task: stopping}, poll_wait=1.0, concurrency=1)
            with Crasher("after_kept_decision", skip=2) as held:
                async with first:
                    run = await client.start_run(name)
                    await asyncio.wait_for(held.hit.wait(), timeout=20)
                    async with Worker(engine.target, handlers={task: successor}, poll_wait=1.0):
                        stop = asyncio.create_task(first.stop())
                        await wait_for(lambda: first._stopping.is_set(), timeout=5)
                        held.release.set()  # the answer keeps the task for iteration 3
                        await stop
                        done = await client.wait_for_run(run.run_id, timeout=60)
            await completed(engine, done)
            assert stopping.ran == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
            assert successor.ran[0] == (3, 1, 1)
    finally:
        await engine.stop()
        await server.stop()


# ---- the kept task's commit event goes to the engine directly (ADR 33) ------------------


@contextlib.asynccontextmanager
async def commit_events_off(engine: EngineServer) -> AsyncIterator[None]:
    """Inside, the engine takes no commit's event directly (over NATS or by
    a call): each goes to the history, as with an engine that predates ADR 33."""
    await engine.engine.stop_serving_commit_events()
    try:
        yield
    finally:
        await engine.engine.serve_commit_events()


async def test_a_journal_commit_stores_no_event_on_the_history(
    client: Client, engine: EngineServer, js: JetStreamContext, monkeypatch: Any
) -> None:
    # Against the same loop with no engine taking commits' events directly,
    # every one of them then on the history: one event fewer a commit, the
    # rest the same, whether the loop keeps its task or goes through the queue.
    # An engine that does not answer within a third of the hold's wait sends
    # its event to the history by design (..._leaves_unanswered_is_stored_on_the_history
    # below); a wait long enough that only a broken engine misses it keeps
    # this count exact when a loaded machine's disk stalls a run write.
    monkeypatch.setattr(journal_service, "EVENT_WAIT", 30.0)
    late = engine.engine.counters["local_late"]
    async with commit_events_off(engine):
        durable = await run_loop(client, engine, Loop(), kept_iterations=0)
    through_history = await history_events(js, durable.run_id)
    for kept_iterations in (64, 0):
        loop = Loop()
        run = await run_loop(client, engine, loop, kept_iterations=kept_iterations)
        await completed(engine, run)
        assert run_output(run) == {"iterations": K}
        assert loop.ran == [(i, 1, 1) for i in range(K)]
        stored = await history_events(js, run.run_id)
        assert stored == through_history - K, (kept_iterations, stored, through_history)
    assert engine.engine.counters["local_late"] == late


async def test_a_commit_event_is_handed_over_by_a_call_only_while_its_engine_takes_them(
    engine: EngineServer,
) -> None:
    # The one decision of the route: the engine of the journal service's
    # process while it serves commits' events, else one engine over core NATS
    # (each ending on the history when it does not answer in its share).
    assert commit_event_route(engine.engine, owned=True) == InProcess(engine.engine)
    async with commit_events_off(engine):
        assert commit_event_route(engine.engine, owned=True) == ToOneEngine()
    assert commit_event_route(engine.engine, owned=True) == InProcess(engine.engine)
    assert commit_event_route(None, owned=False) == ToOneEngine(), "a journal service apart"
    # A run of a partition another replica owns: to its engine, on the run's slot.
    assert commit_event_route(engine.engine, owned=False) == ToOneEngine()


async def test_a_commit_event_goes_to_the_engine_of_its_own_process_by_a_call(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # The fixture serves the engine and the journal service in one process:
    # each commit's event is handed to that engine without NATS, by a call.
    counters = engine.engine.counters
    local, direct = counters["local_applied"], counters["direct_applied"]
    loop = Loop()
    run = await run_loop(client, engine, loop)
    await completed(engine, run)
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    assert counters["local_applied"] - local == K
    assert counters["direct_applied"] == direct


async def test_a_commit_event_its_own_engine_leaves_unanswered_is_stored_on_the_history(
    client: Client, engine: EngineServer, js: JetStreamContext, monkeypatch: Any
) -> None:
    # The engine of the process takes the event and answers nothing (it was
    # stopping, or its run write outlasted the wait): the event goes to the
    # history, whose engine applies it and answers.
    async with commit_events_off(engine):
        queued = await run_loop(client, engine, Loop(), kept_iterations=0)
    taken: list[str] = []

    async def unanswered(event: ipb.HistoryEvent, *, wait: float) -> bytes | None:
        taken.append(event.run_id)
        return None

    monkeypatch.setattr(engine.engine, "take_commit_event", unanswered)
    before = await tasks_published(js)
    loop = Loop()
    run = await run_loop(client, engine, loop)
    await completed(engine, run)
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    assert taken == [run.run_id] * K
    assert await tasks_published(js) - before == 1
    assert await history_events(js, run.run_id) == await history_events(js, queued.run_id)


async def test_a_journal_service_apart_sends_its_commits_events_over_nats(
    client: Client, engine: EngineServer, js: JetStreamContext, nats_server: NatsServer
) -> None:
    # A journal service in a process of its own (``dagnats serve journal``)
    # sends each commit's event to the engine over core NATS, and stores
    # none on the history: the same events as the engine's own process does.
    counters = engine.engine.counters
    here = await run_loop(client, engine, Loop())
    journal = await start_services(nats_server.url, services=["journal"])
    try:
        direct = counters["direct_applied"]
        before = await tasks_published(js)
        loop = Loop()
        run = await run_loop(client, engine, loop, journal_target=journal.target)
    finally:
        await journal.stop()
    await completed(engine, run)
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    assert counters["direct_applied"] - direct == K
    assert await tasks_published(js) - before == 1
    assert await history_events(js, run.run_id) == await history_events(js, here.run_id)


async def test_with_no_engine_taking_held_events_they_are_stored_on_the_history(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # As with an engine that takes no direct events: nats-server answers that nobody
    # subscribes, and the journal service publishes the event at once.
    async with commit_events_off(engine):
        queued = await run_loop(client, engine, Loop(), kept_iterations=0)
        before = await tasks_published(js)
        loop = Loop()
        run = await run_loop(client, engine, loop)
    await completed(engine, run)
    assert loop.ran == [(i, 1, 1) for i in range(K)]  # none twice, all on one message
    assert await tasks_published(js) - before == 1
    assert await history_events(js, run.run_id) == await history_events(js, queued.run_id)


async def test_a_held_event_taken_by_an_engine_that_never_answers_is_stored_on_the_history(
    client: Client, engine: EngineServer, js: JetStreamContext, nats_server: NatsServer
) -> None:
    # An engine that takes the event and dies (or is stuck) before it applies
    # it: no decision comes in the first part of the wait, and the event goes
    # to the history, whose engine applies it and answers.
    k = 3
    nc = await nats.connect(nats_server.url)
    swallowed: list[bytes] = []

    async def swallow(msg: Any) -> None:
        swallowed.append(msg.data)

    try:
        async with commit_events_off(engine):
            queued = await run_loop(client, engine, Loop(k=k), kept_iterations=0)
            await nc.subscribe(f"{COMMIT_EVENTS}.*", queue=DIRECT_QUEUE, cb=swallow)
            await nc.flush()
            before = await tasks_published(js)
            loop = Loop(k=k)
            run = await run_loop(client, engine, loop)
    finally:
        await nc.close()
    await completed(engine, run, k)
    assert loop.ran == [(i, 1, 1) for i in range(k)]
    assert len(swallowed) == k, "each commit's event: k - 1 kept their task, the last released it"
    assert await tasks_published(js) - before == 1  # each decision came, none waited a lease
    assert await history_events(js, run.run_id) == await history_events(js, queued.run_id)


async def test_a_held_event_delivered_again_changes_nothing_and_tells_the_same(
    client: Client, engine: EngineServer, js: JetStreamContext
) -> None:
    # While iteration 2 runs on the kept message, iteration 1's commit event
    # comes again: twice to the engine directly, once on the history. The run
    # stays at iteration 2, and each time the holder is told the dispatch the
    # message already carries.
    loop = Loop(pause_at=2)
    store = engine.engine.store
    told: list[ipb.EventDecision] = []
    steps_after: list[tuple[int, int]] = []

    async def again(run_id: str) -> None:
        await wait_for(loop.reached.is_set, timeout=20, message="iteration 2 running")
        kept_seq = (await store.require_run(run_id)).record.step_records["agent"].kept_seq
        assert kept_seq > 0
        commit = await commit_of(engine, run_id, iteration=1)
        settler = TaskSettler(store, engine.engine.clock)
        event = settler._event(commit)
        event.kept_seq = kept_seq
        for direct in (True, True, False):
            event.notify, notice = await store.expect_notice()
            if direct:
                refused = await store.send_commit_event(event)
                refused.cancel()
            else:
                await store.publish_event(event, outcome_msg_id(event))
            try:
                told.append(ipb.EventDecision.FromString(await asyncio.wait_for(notice, 10)))
            finally:
                notice.cancel()
            run = (await store.require_run(run_id)).record.run
            steps_after.extend((s.iteration, s.attempt) for s in run.steps if s.step_id == "agent")
        loop.go.set()

    before = await tasks_published(js)
    run = await run_loop(client, engine, loop, during=again)
    await completed(engine, run)
    assert steps_after == [(2, 1)] * 3
    assert [(d.next.iteration, d.next.attempt, d.done) for d in told] == [(2, 1, False)] * 3
    assert loop.ran == [(i, 1, 1) for i in range(K)]
    assert await tasks_published(js) - before == 1


async def commit_of(engine: EngineServer, run_id: str, *, iteration: int) -> jpb.Record:
    """The stored commit of ``iteration`` of the run's agent step."""
    async with JournalClient(engine.target) as journal:
        records = [r async for r in journal.read(run_id, "agent")]
    [commit] = [r for r in records if r.HasField("commit") and r.iteration == iteration]
    return commit
