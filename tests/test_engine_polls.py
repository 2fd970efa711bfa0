"""A poll whose worker left takes no task with it: the replica's open pulls
bring the task to the next poll, or give it back at once when none waits.
A poll answered by one of its task types leaves its pulls of the others open
for the next poll, so a task of a quieter type goes to a live poll on its
first delivery."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc.aio
import nats.js.errors
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration

from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import task_consumer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.sdk import Client, TaskContext, Worker
from dagnats.sdk._local_transport import LocalConnection
from dagnats.sdk._rpc import POLL_METHOD
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, socket_dir, unique

# Far longer than any wait below: a task leased into a poll nobody reads comes
# back only after this, so a test that sees it again sooner saw it given back.
LEASE = 120.0
POLL_WAIT = 30.0  # the departed worker's pull would stay open this long
BUSY_ITERATIONS = 10  # polls answered by the busy type, one an iteration

# A worker process that polls and never finishes a task; the test kills it.
POLLING_WORKER = """
import asyncio, sys
from dagnats.sdk import Worker

async def main(target: str, task: str) -> None:
    async def handler(tc) -> None:
        await asyncio.Event().wait()
    async with Worker(target, handlers={task: handler}, poll_wait=float(sys.argv[3])):
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def long_lease_engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    with socket_dir() as sockets:
        server = await start_engine(
            nats_server.url,
            config=replace(FAST, task_ack_wait=LEASE),
            local_socket=sockets / "local.sock",
        )
        yield server
        await server.stop()


async def waiting_pulls(engine: EngineServer, task: str) -> int:
    """Pull requests the task type's consumer holds open."""
    try:
        info = await engine.nc.jetstream().consumer_info(jsx.TASKS, task_consumer(task))
    except nats.js.errors.NotFoundError:
        return 0  # no poll has created it yet
    return info.num_waiting


async def run_after_a_poll_left(
    engine: EngineServer, leave: Callable[[], Awaitable[None]], task: str
) -> list[int]:
    """With the departing poll first in line and another worker's behind it,
    let the first leave, start a run and return the deliveries its task had."""
    name = unique("pollswf")
    deliveries: list[int] = []

    async def handler(tc: TaskContext) -> None:
        deliveries.append(tc.delivery)
        await tc.complete("done")

    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(engine.target, handlers={task: handler}, poll_wait=POLL_WAIT):
            # Both polls wait on the one open pull of the type's consumer.
            await wait_for(lambda: engine.pulls.polls_waiting >= 2, timeout=20)
            await leave()
            run = await client.start_run(name)
            done = await client.wait_for_run(run.run_id, timeout=20)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    return deliveries


async def _at_least(engine: EngineServer, task: str, pulls: int) -> bool:
    return await waiting_pulls(engine, task) >= pulls


async def test_a_stopped_workers_poll_does_not_take_the_next_task(
    long_lease_engine: EngineServer,
) -> None:
    engine, task = long_lease_engine, unique("polls")
    departing = Worker(engine.target, handlers={task: _never_runs}, poll_wait=POLL_WAIT)
    async with departing:
        await wait_for(lambda: _at_least(engine, task, 1), timeout=20)
        deliveries = await run_after_a_poll_left(engine, departing.stop, task)
    # Delivered once, or once more at once if it reached the departing poll
    # before that poll was stopped; never left to wait out its lease.
    assert len(deliveries) == 1 and deliveries[0] <= 2, deliveries


async def test_a_poll_left_on_the_local_socket_does_not_take_the_next_task(
    long_lease_engine: EngineServer,
) -> None:
    """A worker's poll on the local socket ends with its connection: the
    engine stops the pull as it does a gRPC poll's."""
    engine, task = long_lease_engine, unique("polls")
    sockets = engine.local_socket
    assert sockets is not None
    refusals: list[str] = []
    polls = LocalConnection(
        str(sockets.path), None, instance=sockets.instance, refused=refusals.append
    )
    request = pb.PollTasksRequest(task_types=[task], wait=Duration(seconds=int(POLL_WAIT)))
    poll = asyncio.create_task(polls.call(POLL_METHOD, request, pb.PollTasksResponse, {}))
    await wait_for(lambda: _at_least(engine, task, 1), timeout=20)

    async def leave() -> None:
        poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll

    deliveries = await run_after_a_poll_left(engine, leave, task)
    assert len(deliveries) == 1 and deliveries[0] <= 2, deliveries
    assert refusals == []


async def test_a_killed_workers_poll_does_not_take_the_next_task(
    long_lease_engine: EngineServer,
) -> None:
    engine, task = long_lease_engine, unique("polls")
    args = [sys.executable, "-c", POLLING_WORKER, engine.target, task, str(POLL_WAIT)]
    proc = await asyncio.create_subprocess_exec(*args)
    try:
        await wait_for(lambda: _at_least(engine, task, 1), timeout=30)

        async def kill() -> None:
            proc.kill()  # SIGKILL
            await proc.wait()

        deliveries = await run_after_a_poll_left(engine, kill, task)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert len(deliveries) == 1 and deliveries[0] <= 2, deliveries


async def _never_runs(tc: TaskContext) -> None:
    raise AssertionError("the departing worker ran a task")


@dataclass
class BusyAndQuiet:
    """Two task types on one engine, each a workflow of its own; the quiet
    type's handler records the delivery of each task it runs."""

    busy: str = field(default_factory=lambda: unique("busy"))
    quiet: str = field(default_factory=lambda: unique("quiet"))
    busy_workflow: str = field(default_factory=lambda: unique("busywf"))
    quiet_workflow: str = field(default_factory=lambda: unique("quietwf"))
    deliveries: list[int] = field(default_factory=list)

    async def register(self, client: Client) -> None:
        await client.register_workflow(loop_workflow(self.busy_workflow, self.busy))
        await client.register_workflow(loop_workflow(self.quiet_workflow, self.quiet))

    async def record(self, tc: TaskContext) -> None:
        self.deliveries.append(tc.delivery)
        await tc.complete("done")


async def test_a_task_of_a_quiet_type_is_delivered_once_after_polls_another_type_answered(
    long_lease_engine: EngineServer,
) -> None:
    engine, two = long_lease_engine, BusyAndQuiet()

    async def keep_busy(tc: TaskContext) -> None:
        if tc.iteration < BUSY_ITERATIONS - 1:
            await tc.continue_()
        else:
            await tc.complete("done")

    handlers = {two.busy: keep_busy, two.quiet: two.record}
    async with Client(engine.target) as client:
        await two.register(client)
        # Every poll names both types and waits far longer than the test runs:
        # a pull left behind on the quiet type would still be open at its task.
        async with Worker(engine.target, handlers=handlers, poll_wait=POLL_WAIT):
            run = await client.start_run(two.busy_workflow)
            busy_done = await client.wait_for_run(run.run_id, timeout=30)
            assert busy_done.status == pb.RUN_STATUS_COMPLETED, busy_done.error
            run = await client.start_run(two.quiet_workflow)
            done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert two.deliveries == [1]


async def test_a_task_an_open_pull_brings_when_no_poll_waits_is_given_back(
    long_lease_engine: EngineServer,
) -> None:
    # A poll answered by one task type leaves its pull of the other open for
    # the next poll. A task it brings while no poll waits is given back after
    # HOLD, not kept: the next worker gets it well within its lease.
    engine, two = long_lease_engine, BusyAndQuiet()
    async with Client(engine.target) as client:
        await two.register(client)
        async with grpc.aio.insecure_channel(engine.target) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            request = pb.PollTasksRequest(
                task_types=[two.busy, two.quiet],
                wait=Duration(seconds=int(POLL_WAIT)),
                worker_id="w",
            )
            poll = asyncio.ensure_future(stub.PollTasks(request))
            await wait_for(lambda: engine.pulls.polls_waiting >= 1, timeout=20)
            await client.start_run(two.busy_workflow)
            answered = await poll
        assert [t.task.task_type for t in answered.tasks] == [two.busy]
        assert await waiting_pulls(engine, two.quiet) == 1  # left open, no poll on it
        run = await client.start_run(two.quiet_workflow)
        async with Worker(engine.target, handlers={two.quiet: two.record}, poll_wait=POLL_WAIT):
            done = await client.wait_for_run(run.run_id, timeout=LEASE / 4)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    # Brought to the open pull, given back after HOLD, or taken by the worker's poll.
    assert two.deliveries in ([1], [2]), two.deliveries
