"""Two replicas on one nats-server, four partitions: each consumes only the
partitions it owns (docs/architecture.md, "Partitions and slots").

What a user checks: a run started through either replica finishes; every
task of a run runs on the worker of the replica owning the run's partition
(a worker polls one replica, which pulls only its partitions' consumers);
every write of a run after its creation carries the writer header of that
replica's engine (``Dagnats-Engine``), so its history events, commits'
events and timers were all applied there; a kept loop misses no guess; and
a partition moved to the other replica mid-run carries its run on there, no
iteration run twice, the journal clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
import nats
import nats.js.errors
import pytest_asyncio
from nats.aio.msg import Msg

from dagnats.core.natsserver import NatsServer
from dagnats.core.partitions import SLOTS, partition_of, slot_of
from dagnats.core.subjects import (
    COMMIT_EVENTS,
    commit_event_subject,
    history_subject,
    kv_key,
    lane_prefix,
    partition_filters,
    purge_timer_subject,
    run_tasks,
    run_timers,
    task_consumer,
    task_subject,
    timer_subject,
)
from dagnats.engine.config import ReplicaConfig
from dagnats.engine.heard import WRITER
from dagnats.engine.ownership import OnChange, Ownership
from dagnats.engine.server import EngineServer, start_services
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.sdk import Client, TaskContext, Worker, run_output
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, unique
from tests.test_journal import journal_check

P = 4
K = 5  # iterations of a loop; the second waits on a timer
RUNS_EACH = 2  # runs each replica's partitions get, at least


def test_a_runs_subjects_carry_its_slot_and_one_partitions_filters_select_them() -> None:
    run = "0f" * 16
    slot = slot_of(run)
    assert task_subject("agent", run, "s") == f"tasks.agent.{slot}.{run}.s"
    assert task_subject("agent", run, "s", "B1") == f"tasks.agent@B1.{slot}.{run}.s"
    assert history_subject(run) == f"history.{slot}.{run}"
    assert timer_subject(run, "s") == f"timers.{slot}.{run}.s"
    assert purge_timer_subject(run) == f"timers.{slot}.{run}"
    assert commit_event_subject(run) == f"{COMMIT_EVENTS}.{slot}"
    # A run's own subjects stay exact: no wildcard but the lane or the step.
    assert run_tasks(run) == f"tasks.*.{slot}.{run}.>"
    assert run_timers(run) == f"timers.{slot}.{run}.>"
    # One partition: the one wildcard, as before partitions.
    assert partition_filters(lane_prefix("agent"), 0, 1) == ["tasks.agent.>"]
    assert partition_filters(COMMIT_EVENTS, 0, 1, last=True) == [f"{COMMIT_EVENTS}.*"]
    # Several: each slot in exactly one partition's filters, the run's in its own.
    for partitions in (2, 4, 64):
        filters = [partition_filters("history", k, partitions) for k in range(partitions)]
        assert sorted(f for part in filters for f in part) == sorted(
            f"history.{s}.>" for s in range(SLOTS)
        )
        assert f"history.{slot}.>" in filters[partition_of(run, partitions)]
        events = partition_filters(
            COMMIT_EVENTS, partition_of(run, partitions), partitions, last=True
        )
        assert commit_event_subject(run) in events


class Moving(Ownership):
    """A split of the partitions that the test moves by hand (no leases)."""

    def __init__(self, partitions: int, owned: set[int]) -> None:
        self.partitions = partitions
        self._now = frozenset(owned)
        self._told: list[OnChange] = []

    def owned(self) -> frozenset[int]:
        return self._now

    def owns_run(self, run_id: str) -> bool:
        return partition_of(run_id, self.partitions) in self._now

    def on_change(self, callback: OnChange) -> None:
        self._told.append(callback)

    async def move(self, owned: set[int]) -> None:
        """Own ``owned`` from now on; returns once every callback ran."""
        self._now = frozenset(owned)
        for told in self._told:
            result = told(self._now)
            if inspect.isawaitable(result):
                await result

    async def start(self) -> None:
        pass

    async def release(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@dataclass
class Loop:
    """A journaled loop of ``K`` iterations, one model call each; iteration 1
    waits 0.2 s on a timer. Records, per run, the replica whose worker ran
    each iteration."""

    ran: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))
    pause: str = ""  # a run whose iteration 2 waits for ``go`` before it commits
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)

    def on(self, replica: str) -> Callable[[TaskContext], Any]:
        async def handler(tc: TaskContext) -> None:
            j = await tc.journal()
            self.ran[tc.run_id].append((replica, tc.iteration))
            await j.model(lambda: _answer(tc.iteration))
            if tc.run_id == self.pause and tc.iteration == 2:
                self.reached.set()
                await self.go.wait()
            if tc.iteration + 1 >= K:
                await tc.complete({"iterations": K})
            elif tc.iteration == 1:
                await tc.continue_(delay=0.2)
            else:
                await tc.continue_()

        return handler


async def _answer(iteration: int) -> dict[str, Any]:
    return {"turn": iteration}


@dataclass
class Stack:
    replicas: dict[str, EngineServer]
    owners: dict[str, Moving]
    loop: Loop
    workflow: str
    writers: dict[str, list[str]]  # run -> the engines that wrote it, in order

    def owner(self, run_id: str) -> str:
        return next(r for r, o in self.owners.items() if o.owns_run(run_id))

    def writer(self, replica: str) -> str:
        heard = self.replicas[replica].engine.heard
        assert heard is not None
        return heard.writer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(nats_server: NatsServer) -> AsyncIterator[Stack]:
    owners = {"a": Moving(P, {0, 1}), "b": Moving(P, {2, 3})}
    replicas: dict[str, EngineServer] = {}
    for name, owned in owners.items():
        server = await start_services(
            nats_server.url, config=FAST, ownership=owned, replica=ReplicaConfig(partitions=P)
        )
        assert isinstance(server, EngineServer)
        replicas[name] = server
    writers: dict[str, list[str]] = defaultdict(list)
    prefix = kv_key("RUNS", "")

    async def wrote(msg: Msg) -> None:
        writers[msg.subject[len(prefix) :]].append((msg.headers or {}).get(WRITER, ""))

    nc = await nats.connect(nats_server.url)
    await nc.subscribe(f"{prefix}>", cb=wrote)
    await nc.flush()
    task, name = unique("part"), unique("partwf")
    loop = Loop()
    async with Client(replicas["a"].target) as client:
        await client.register_workflow(loop_workflow(name, task))
    try:
        async with contextlib.AsyncExitStack() as workers:
            for r, server in replicas.items():
                handlers = {task: loop.on(r)}
                await workers.enter_async_context(Worker(server.target, handlers=handlers))
            yield Stack(replicas, owners, loop, name, writers)
    finally:
        await nc.close()
        for replica in replicas.values():
            await replica.stop()


async def test_each_run_is_driven_by_the_replica_owning_its_partition(stack: Stack) -> None:
    missed = {r: s.engine.counters["guess_missed"] for r, s in stack.replicas.items()}
    started: list[tuple[str, str]] = []  # run, the replica it was started through
    clients = {r: Client(s.target) for r, s in stack.replicas.items()}
    try:
        # Runs started through each replica in turn until each replica owns a few.
        while min(sum(stack.owner(run) == r for run, _ in started) for r in clients) < RUNS_EACH:
            through = "ab"[len(started) % 2]
            run = await clients[through].start_run(stack.workflow)
            started.append((run.run_id, through))
        done = [await clients["a"].wait_for_run(run, timeout=60) for run, _ in started]
    finally:
        for client in clients.values():
            await client.close()
    assert {through for _, through in started} == {"a", "b"}
    for (run_id, through), run in zip(started, done, strict=True):
        owner = stack.owner(run_id)
        assert run.status == pb.RUN_STATUS_COMPLETED, run.error
        assert run_output(run) == {"iterations": K}
        # Every iteration once. A task goes to the owner's worker while a
        # poll of it waits, and to the other's in the moment between two of
        # its polls (the next test): the worker may differ, the engine not.
        assert [i for _, i in stack.loop.ran[run_id]] == list(range(K)), (run_id, through)
        # Created by the replica it was started through; every later write,
        # each event, commit's event and timer applied, by the owner's engine.
        first, *later = stack.writers[run_id]
        assert first == stack.writer(through)
        assert later and set(later) == {stack.writer(owner)}, (run_id, owner)
        check = await journal_check(stack.replicas[owner], run_id)
        assert list(check.violations) == [], check.violations
    for replica, server in stack.replicas.items():
        assert server.engine.counters["guess_missed"] == missed[replica], replica


async def test_a_partition_moved_mid_run_carries_its_run_on_on_the_other_replica(
    stack: Stack,
) -> None:
    async with Client(stack.replicas["a"].target) as client:
        run = await client.start_run(stack.workflow)
        run_id = run.run_id
        stack.loop.pause = run_id
        await wait_for(stack.loop.reached.is_set, timeout=30, message="iteration 2 running")
        partition = partition_of(run_id, P)
        old = stack.owner(run_id)
        new = "b" if old == "a" else "a"
        moved = len(stack.writers[run_id])
        await stack.owners[old].move(set(stack.owners[old].owned()) - {partition})
        await stack.owners[new].move(set(stack.owners[new].owned()) | {partition})
        engines = {r: stack.replicas[r].engine for r in (old, new)}
        # Followed by the time the change's callbacks returned.
        assert partition not in engines[old].consuming()
        assert partition in engines[new].consuming()
        stack.loop.go.set()  # iteration 2 commits on the old owner's worker
        done = await client.wait_for_run(run_id, timeout=60)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == {"iterations": K}
    # No iteration ran twice: each once, on the worker that held the kept task
    # or, after the timer, on the new owner's.
    assert [i for _, i in stack.loop.ran[run_id]] == list(range(K))
    # From the move on, the run's writes are the new owner's (the old one
    # writes at most what it had deferred, as it lets the partition go).
    after = stack.writers[run_id][moved:]
    takes_over = after.index(stack.writer(new))
    assert set(after[takes_over:]) == {stack.writer(new)}
    assert set(after[:takes_over]) <= {stack.writer(old)}
    check = await journal_check(stack.replicas[new], run_id)
    assert list(check.violations) == [], check.violations


async def test_a_task_goes_to_its_owners_poll_and_to_another_replica_only_when_none_waits(
    stack: Stack,
) -> None:
    # Every partition on b. While a poll of b waits, a new task goes to b,
    # though a poll of a waited first; with no poll of b waiting, a poll of a
    # takes it: no task waits on an owner that nobody polls.
    await stack.owners["b"].move(set(range(P)))
    await stack.owners["a"].move(set())
    engines = {r: s.engine for r, s in stack.replicas.items()}
    assert not engines["a"].consuming() and engines["b"].consuming() == set(range(P))
    idle, idle_workflow = unique("idle"), unique("idlewf")
    js = engines["a"].store.js

    async def waiting(polls: int) -> bool:
        for k in range(P):
            try:
                info = await js.consumer_info("TASKS", task_consumer(idle, "", k))
            except nats.js.errors.NotFoundError:
                return False  # the poll has not made it yet
            if info.num_waiting < polls:
                return False
        return True

    async with Client(stack.replicas["a"].target) as client:
        await client.register_workflow(loop_workflow(idle_workflow, idle))
        # a's poll waits first: it would get the task were it first in line.
        # (It ends before the task's lease, 2 s, would hand the task on.)
        other = asyncio.create_task(poll(stack.replicas["a"], idle, 1500))
        await wait_for(lambda: waiting(1), timeout=10, message="a's poll never waited")
        owner = asyncio.create_task(poll(stack.replicas["b"], idle, 8000))
        await wait_for(lambda: waiting(2), timeout=10, message="b's poll never waited")
        first = await client.start_run(idle_workflow)
        assert await owner == [first.run_id]
        assert await other == []
        second = await client.start_run(idle_workflow)  # no poll of b waits now
        assert await poll(stack.replicas["a"], idle, 8000) == [second.run_id]
        for run in (first, second):
            await client.cancel_run(run.run_id)


async def poll(replica: EngineServer, task: str, wait_ms: int) -> list[str]:
    """The runs of the tasks one poll of ``replica`` hands out."""
    request = pb.PollTasksRequest(task_types=[task], worker_id="probe")
    request.wait.FromMilliseconds(wait_ms)
    async with grpc.aio.insecure_channel(replica.target) as channel:
        answer = await pb_grpc.EngineServiceStub(channel).PollTasks(request)
    return [leased.task.run_id for leased in answer.tasks]
