"""Runs in flight keep their code: worker builds, the pinned and upgrade
policies, a run waiting for its build, and ``run upgrade``.

Two builds of one handler whose call order changed: build A calls the tool
``lookup`` then ``draft`` in each iteration, build B ``draft`` then
``lookup``. An iteration of A cut short and replayed by B would be a
``ReplayMismatch``; pinned, it never reaches B. Build C keeps A's order:
a run upgraded to it replays A's iteration. The workers of every build run
in this process, on the module's engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest

from dagnats.core import seam
from dagnats.core.errors import Conflict, DagnatsError, InvalidArgument, NotFound
from dagnats.core.subjects import task_consumer
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker
from tests.helpers import wait_for
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_cli import adagnats
from tests.test_journal import journal_check

ORDERS = {"A": ("lookup", "draft"), "B": ("draft", "lookup"), "C": ("lookup", "draft")}


class Build:
    """One build of the handler: its call order, and the iterations it ran.
    ``hold``: the iteration at which it stops after its first tool call and
    never commits (its worker is stopped under it). Iteration 0 waits for an
    input, or, ``kept``, goes on at once on its kept task."""

    def __init__(
        self,
        name: str,
        *,
        hold: int | None = None,
        kept: bool = False,
        release: asyncio.Event | None = None,
    ) -> None:
        self.name = name
        self.hold = hold
        self.kept = kept
        self.release = release or asyncio.Event()
        self.ran: list[tuple[str, int]] = []
        self.held = asyncio.Event()
        self.holding: set[str] = set()  # the runs it holds
        self.signals: list[str] = []

    async def handler(self, tc: TaskContext) -> None:
        self.ran.append((tc.run_id, tc.iteration))
        try:
            journal = await tc.journal()
            first, second = ORDERS[self.name]
            await journal.tool(ToolCall(name=first, input={"i": tc.iteration}), Replay.SAFE, _tool)
            if tc.iteration == self.hold:
                self.held.set()
                self.holding.add(tc.run_id)
                await self.release.wait()  # cut short when the worker stops under it
            await journal.tool(ToolCall(name=second, input={"i": tc.iteration}), Replay.SAFE, _tool)
        except BaseException as signal:
            self.signals.append(type(signal).__name__)
            raise
        if tc.iteration == 0:
            await tc.continue_({"build": self.name}, until_input=not self.kept)
        else:
            await tc.complete({"build": self.name})

    def iterations_of(self, run_id: str) -> list[int]:
        return [i for r, i in self.ran if r == run_id]


async def _tool(run: ToolRun) -> Any:
    return {"tool": run.call.name}


@asynccontextmanager
async def worker(engine: EngineServer, task: str, build: Build) -> AsyncIterator[Worker]:
    handlers = {task: build.handler}
    async with Worker(engine.target, handlers=handlers, build_id=build.name, poll_wait=1.0) as w:
        yield w


async def agent(client: Client, run_id: str) -> pb.StepState:
    return steps_by_id(await client.get_run(run_id))["agent"]


async def waiting_for_input(client: Client, run_id: str) -> bool:
    step = await agent(client, run_id)
    return step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input


async def ended(client: Client, run_id: str) -> bool:
    return (await client.get_run(run_id)).status != pb.RUN_STATUS_RUNNING


async def give_input(client: Client, run_id: str) -> None:
    await client.submit_input(run_id, "agent", "go", {"text": "go on"})


async def workflow(client: Client, prefix: str, **fields: Any) -> tuple[str, str]:
    task, name = unique(prefix), unique(prefix + "wf")
    await client.register_workflow({**loop_workflow(name, task), **fields})
    return task, name


def built_by(run: pb.Run) -> str:
    return str(json.loads(run.output)["build"])


async def test_a_rolling_deploy_keeps_runs_in_flight_on_their_build(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "deploy")
    a, b = Build("A"), Build("B")
    async with worker(engine, task, a):
        runs = [(await client.start_run(name, {"n": i})).run_id for i in range(10)]
        for run_id in runs:
            await wait_for(partial(waiting_for_input, client, run_id), timeout=30)
            assert (await agent(client, run_id)).build_id == "A"
        async with worker(engine, task, b):
            await asyncio.gather(*(give_input(client, r) for r in runs))
            newer = [(await client.start_run(name, {"new": i})).run_id for i in range(4)]
            for run_id in newer:
                await wait_for(partial(waiting_for_input, client, run_id), timeout=30)
                await give_input(client, run_id)
            for run_id in runs + newer:
                await wait_for(partial(ended, client, run_id), timeout=30)
        # A stops only now, every run it started having finished.
    for run_id in runs:
        run = await client.get_run(run_id)
        assert run.status == pb.RUN_STATUS_COMPLETED, run.error
        assert built_by(run) == "A" and steps_by_id(run)["agent"].build_id == "A"
        assert a.iterations_of(run_id) == [0, 1] and b.iterations_of(run_id) == []
    for run_id in newer:  # a new run goes to either build, and stays on it
        run = await client.get_run(run_id)
        assert run.status == pb.RUN_STATUS_COMPLETED, run.error
        build = steps_by_id(run)["agent"].build_id
        assert built_by(run) == build
        ran = {"A": a, "B": b}[build]
        assert ran.iterations_of(run_id) == [0, 1]
    assert "ReplayMismatch" not in a.signals + b.signals


async def test_an_iteration_cut_short_waits_for_its_build_and_is_never_replayed_by_another(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "cutshort")
    a, b = Build("A", hold=1, kept=True), Build("B", kept=True)
    async with AsyncExitStack() as stack:
        async with worker(engine, task, a) as stopping:
            run_id = (await client.start_run(name, "hello")).run_id
            await wait_for(a.held.is_set, timeout=30)
            await stack.enter_async_context(worker(engine, task, b))
            dies = DieOnce("after_moved_to_lane")
            seam.install(dies)
            stack.callback(seam.install, None)
            await stopping.stop(grace=0)
        # A's worker stopped under iteration 1 (its first tool stored, no
        # commit), which it ran on the task message it kept from iteration 0,
        # a message of the unpinned lane. When its lease runs out, B's poll
        # gets it, and the engine moves it to build A's lane instead of
        # leasing it: it waits there, visibly, while B polls on. The first
        # move dies between the dispatch on A's lane and the message's
        # acknowledgement: the message comes back, finds the dispatch on the
        # lane, and is only settled. One copy, on A's lane.
        await wait_for(
            lambda: _on_lane(engine, task, "A"), timeout=30, message="moved to build A's lane"
        )
        await wait_for(lambda: _lane_empty(engine, task, ""), timeout=30, message="settled")
        assert dies.hit and await _on_lane(engine, task, "A")
        assert await _waiting_for_build(client, run_id)
        step = await agent(client, run_id)
        assert step.status == pb.STEP_STATUS_RUNNING and step.build_id == "A"
        assert b.iterations_of(run_id) == []
        again = Build("A", kept=True)
        async with worker(engine, task, again):
            await wait_for(lambda: ended(client, run_id), timeout=30)
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert built_by(run) == "A" and again.iterations_of(run_id) == [1]
    assert b.iterations_of(run_id) == [] and not (await agent(client, run_id)).waiting_for_build
    assert list((await journal_check(engine, run_id)).violations) == []


async def test_a_first_iteration_cut_short_belongs_to_the_build_that_claimed_it(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "firstclaim")
    a, b = Build("A", hold=0), Build("B")
    async with AsyncExitStack() as stack:
        async with worker(engine, task, a) as stopping:
            runs = [(await client.start_run(name, str(i))).run_id for i in range(2)]
            await wait_for(lambda: a.holding == set(runs), timeout=30)
            for run_id in runs:  # nothing committed: no build recorded yet
                assert (await agent(client, run_id)).build_id == ""
            await stack.enter_async_context(worker(engine, task, b))
            dies = DieOnce("after_moved_to_lane")
            seam.install(dies)
            stack.callback(seam.install, None)
            await stopping.stop(grace=0)
        # A's worker stopped inside each run's first iteration: its first
        # tool stored, no commit. When the leases run out, B's poll gets
        # both messages, delivered again on the unpinned lane; the tail of
        # each step's journal names A, the build of the claim that began
        # the iteration, and the engine moves the task to A's lane, where
        # the step records A and waits, visibly, while B polls on. The
        # first move dies between recording A with the dispatch on A's lane
        # and the message's acknowledgement: the message comes back, finds
        # its step pinned to A and the dispatch on the lane, and is settled.
        await wait_for(lambda: _lane_empty(engine, task, ""), timeout=30, message="settled")
        assert dies.hit
        for run_id in runs:
            await wait_for(partial(_waiting_for_build, client, run_id), timeout=30)
            step = await agent(client, run_id)
            assert step.status == pb.STEP_STATUS_RUNNING and step.build_id == "A"
        assert b.ran == [] and b.signals == []
        moved = await client.upgrade_run(runs[1], "C")
        assert steps_by_id(moved)["agent"].build_id == "C"
        again, c = Build("A", kept=True), Build("C", kept=True)
        async with worker(engine, task, again), worker(engine, task, c):
            for run_id in runs:
                await wait_for(partial(ended, client, run_id), timeout=30)
    for run_id, build, ran in [(runs[0], "A", again), (runs[1], "C", c)]:
        run = await client.get_run(run_id)
        assert run.status == pb.RUN_STATUS_COMPLETED, run.error
        assert built_by(run) == build and ran.iterations_of(run_id) == [0, 1]
        assert list((await journal_check(engine, run_id)).violations) == []
    assert b.ran == [] and "ReplayMismatch" not in again.signals + c.signals


async def test_a_pinned_steps_kept_loop_keeps_its_message_past_the_reconciler(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "keptpin")
    a = Build("A", hold=1, kept=True)
    async with worker(engine, task, a):
        run_id = (await client.start_run(name, "hello")).run_id
        await wait_for(a.held.is_set, timeout=30)
        # Iteration 1 runs on the message kept from iteration 0, on the
        # unpinned lane, while the step is pinned to A: several reconciler
        # passes find it in flight, and dispatch nothing again.
        counters = engine.engine.counters
        start = counters["reconcile_reads"]
        await wait_for(lambda: counters["reconcile_reads"] >= start + 3, timeout=30)
        a.release.set()
        await wait_for(lambda: ended(client, run_id), timeout=30)
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert a.iterations_of(run_id) == [0, 1]


class DieOnce:
    """A seam hook: the service dies (raises) at ``name``, once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hit = False

    async def __call__(self, at: str) -> None:
        if at == self.name and not self.hit:
            self.hit = True
            raise RuntimeError(f"the engine died at {self.name}")


async def _lane_empty(engine: EngineServer, task: str, build: str) -> bool:
    info = await engine.nc.jetstream().consumer_info("TASKS", task_consumer(task, build))
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_pinned_dispatch_stored_and_never_published_goes_out_on_its_builds_lane(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "outbox")
    a, b = Build("A"), Build("B")
    async with worker(engine, task, a):
        run_id = (await client.start_run(name, "hello")).run_id
        await wait_for(lambda: waiting_for_input(client, run_id), timeout=30)
        async with worker(engine, task, b):
            # The engine dies between the write that records the input's
            # dispatch (in the run's outbox) and its publish: the outbox,
            # published by whoever reads the run next, names A's lane.
            dies = DieOnce("after_dispatch_saved")
            seam.install(dies)
            try:
                await give_input(client, run_id)
                await wait_for(lambda: ended(client, run_id), timeout=30)
            finally:
                seam.install(None)
    run = await client.get_run(run_id)
    assert dies.hit and run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert built_by(run) == "A" and a.iterations_of(run_id) == [0, 1]
    assert b.iterations_of(run_id) == []


async def test_an_upgrade_that_dies_before_its_purge_leaves_one_dispatch_that_counts(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "upgradedies")
    a, b, again = Build("A"), Build("B"), Build("A")
    async with worker(engine, task, a):
        run_id = (await client.start_run(name, "hello")).run_id
        await wait_for(lambda: waiting_for_input(client, run_id), timeout=30)
    await give_input(client, run_id)
    await wait_for(lambda: _on_lane(engine, task, "A"), timeout=30)
    dies = DieOnce("after_upgrade_stored")
    seam.install(dies)
    try:
        with pytest.raises(DagnatsError):
            await client.upgrade_run(run_id, "B")
    finally:
        seam.install(None)
    assert dies.hit
    # Moved, and the old copy left on A's lane: a worker of A that polls
    # finds it off its step's lane, the dispatch on B's, and settles it.
    assert (await agent(client, run_id)).build_id == "B"
    async with worker(engine, task, again):
        await wait_for(lambda: _lane_empty(engine, task, "A"), timeout=30)
    assert again.iterations_of(run_id) == []
    async with worker(engine, task, b):
        await wait_for(lambda: ended(client, run_id), timeout=30)
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED and built_by(run) == "B"
    assert b.iterations_of(run_id) == [1]


async def _on_lane(engine: EngineServer, task: str, build: str) -> bool:
    """Whether a task waits on the lane of ``build``, leased by no one."""
    info = await engine.nc.jetstream().consumer_info("TASKS", task_consumer(task, build))
    return info.num_pending == 1 and info.num_ack_pending == 0


async def _waiting_for_build(client: Client, run_id: str) -> bool:
    return (await agent(client, run_id)).waiting_for_build


async def test_a_run_whose_build_is_gone_waits_until_upgraded(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "upgrade")
    a, b = Build("A"), Build("B")
    async with worker(engine, task, a):
        run_id = (await client.start_run(name, "hello")).run_id
        await wait_for(lambda: waiting_for_input(client, run_id), timeout=30)
    async with worker(engine, task, b):
        await give_input(client, run_id)
        await wait_for(lambda: _waiting_for_build(client, run_id), timeout=30)
        assert b.iterations_of(run_id) == []
        env = {"DAGNATS_ENGINE": engine.target}
        shown = await adagnats("run", "get", run_id, env=env)
        assert "build A  waiting for build A" in shown.stdout, shown.stdout + shown.stderr
        moved = await adagnats("run", "upgrade", run_id, "--build", "B", "--json", env=env)
        assert moved.returncode == 0, moved.stderr
        assert json.loads(moved.stdout)["steps"][0]["build_id"] == "B"
        await wait_for(lambda: ended(client, run_id), timeout=30)
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert built_by(run) == "B" and b.iterations_of(run_id) == [1]
    with pytest.raises(Conflict, match="cannot be upgraded"):
        await client.upgrade_run(run_id, "C")
    with pytest.raises(InvalidArgument, match="build_id"):
        await client.upgrade_run(run_id, "v1.2")
    with pytest.raises(NotFound):
        await client.upgrade_run("0" * 32, "B")


async def test_the_upgrade_policy_lets_the_next_iteration_go_to_a_newer_build(
    client: Client, engine: EngineServer
) -> None:
    task, name = await workflow(client, "policy", build_policy="upgrade")
    a, b = Build("A"), Build("B")
    async with worker(engine, task, a):
        run_id = (await client.start_run(name, "hello")).run_id
        await wait_for(lambda: waiting_for_input(client, run_id), timeout=30)
    async with worker(engine, task, b):
        await give_input(client, run_id)
        await wait_for(lambda: ended(client, run_id), timeout=30)
    run = await client.get_run(run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert built_by(run) == "B" and steps_by_id(run)["agent"].build_id == "B"
    assert a.iterations_of(run_id) == [0] and b.iterations_of(run_id) == [1]


async def test_a_bad_build_id_is_refused_at_every_edge(engine: EngineServer) -> None:
    with pytest.raises(InvalidArgument, match="build_id"):
        Worker(engine.target, handlers={"t": Build("A").handler}, build_id="a.b")
    with pytest.raises(InvalidArgument, match="build_id"):
        Worker(engine.target, handlers={"t": Build("A").handler}, build_id="x" * 65)
    token = jpb.WriterToken(
        run_id="0" * 32, step_id="agent", iteration=0, attempt=1, writer="0" * 16
    )
    commit = jpb.Commit(action=jpb.ACTION_CONTINUE, build_id="tasks.>")
    async with grpc.aio.insecure_channel(engine.target) as channel:
        engine_api, journal_api = (
            pb_grpc.EngineServiceStub(channel),
            jgrpc.JournalServiceStub(channel),
        )
        calls: list[tuple[Any, Any, str]] = [
            (engine_api.PollTasks, pb.PollTasksRequest(task_types=["t"], build_id="*"), "build_id"),
            (engine_api.UpgradeRun, pb.UpgradeRunRequest(run_id="0" * 32), "build_id"),
            (journal_api.Commit, jpb.CommitRequest(token=token, commit=commit), "commit.build_id"),
            (
                journal_api.Claim,
                jpb.ClaimRequest(run_id="0" * 32, step_id="agent", attempt=1, build_id="a.b"),
                "build_id",
            ),
        ]
        for call, request, field in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (refused.value.details() or "")


async def test_a_bridge_worker_declares_its_build_and_takes_its_pinned_tasks(
    client: Client, http: httpx.AsyncClient
) -> None:
    task, name = await workflow(client, "bridge")
    run_id = (await client.start_run(name, "hello")).run_id

    async def poll(build: str, wait: str = "10s") -> list[Any]:
        body = {"task_types": [task], "wait": wait, "worker_id": "w", "build_id": build}
        response = await http.post("/bridge/poll", json=body)
        assert response.status_code == 200, response.text
        return list(response.json()["tasks"])

    [first] = await poll("A")
    read = (await http.post("/bridge/journal/read", json={"token": first["token"]})).json()
    body = {"token": read["token"], "outcome": "continue", "output": {"turn": 0}}
    assert (await http.post("/bridge/resolve", json=body)).status_code == 200

    async def pinned_to_a() -> bool:
        return (await agent(client, run_id)).build_id == "A"

    await wait_for(pinned_to_a, timeout=30)
    assert await poll("", wait="0.3s") == [] and await poll("B", wait="0.3s") == []
    [pinned] = await poll("A")
    assert (pinned["task"]["run_id"], pinned["task"]["iteration"]) == (run_id, 1)
    bad = await http.post("/bridge/poll", json={"task_types": [task], "build_id": "v1.2"})
    assert bad.status_code == 400 and "build_id" in bad.text
    await client.cancel_run(run_id)
