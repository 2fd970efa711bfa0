"""The crash-point matrix for the seams a service owns: the engine's
``after_dispatch_saved`` (a dispatch saved in the run, its task not yet
published) and ``after_dispatch_published`` (the task published, the outbox
left in the run: the next writer of the run finds it and publishes it again,
which its Msg-Id makes a no-op), and the journal service's ``after_input_claimed`` (an input claimed
in the inputs bucket, its ``input.placed`` record not yet written) and
``after_commit_stored`` (a commit that settles its task stored, its lifecycle
event not yet published nor the task acknowledged), ``after_commit_event_sent`` (a
commit's event sent to the engines over core NATS, nothing of it on the
history, no answer come yet, its task not released) and
``after_kept_decision`` (a continue that keeps its task: its event applied
and the engine's decision known, the worker not yet answered: the kept task).

Two replicas (engine processes: engine, journal and inputs services each)
split the runs' partitions between them (``REPLICAS``: two partitions, a
one-second partition lease), and a worker dials each. Whichever replica
reaches the seam stops there: it is killed (SIGKILL), and the run finishes on
the survivor, which takes the dead replica's partition once its lease lapses;
only then does a fresh process start on the dead one's port, as a supervisor
would restart it. Or it is frozen (SIGSTOP) until the other one has taken over,
then thawed (SIGCONT) so it goes on as a zombie. On iteration 0,
the unsafe iteration and the one after it. Every case must end with the
crash-free answer, a clean journal, the engine's iteration count equal to the
commits, the unsafe tool started at most once, and an input placed exactly
once, into the iteration that claimed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import pytest
import pytest_asyncio

from dagnats.core.errors import Unavailable
from dagnats.core.natsserver import NatsCluster, NatsServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, run_output
from tests.helpers import wait_for
from tests.matrix import (
    CASES,
    EngineProcess,
    lines,
    logs_on_failure,
    reap,
    spawn_worker,
    zombie_turn,
)
from tests.secured import suite_security
from tests.stack import loop_workflow, steps_by_id, unique

SEAMS = (
    "after_dispatch_saved",
    "after_dispatch_published",
    "after_input_claimed",
    "after_commit_stored",
    "after_commit_event_sent",
    "after_kept_decision",
    "after_kept_unwritten",
)
# The iterations a seam is reached on: a kept iteration goes unwritten from the
# second on (the first kept one writes that its message is kept: the deferred write).
ITERATIONS = {"after_kept_unwritten": (2,)}
PLACES = {"one server": 1, "3-node cluster": 3}
# Each replica's settings: the partitions fixed at provisioning (this module's
# own servers, so its first replica records them), a lease short enough that
# the survivor takes a killed replica's partition within a second, and a name.
REPLICAS = {"DAGNATS_PARTITIONS": "2", "DAGNATS_PARTITION_LEASE": "1"}
REQUEST = "steer-1"


@dataclass
class Stack:
    where: str
    engines: tuple[EngineProcess, EngineProcess]
    arm: Path
    hit: Path


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(PLACES))
async def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    where: str = request.param
    replicas = PLACES[where]
    base = tmp_path_factory.mktemp("services")
    nats: NatsServer | NatsCluster
    if replicas == 1:
        nats = await NatsServer.start(base / "nats", security=suite_security())
    else:
        nats = await NatsCluster.start(base / "nats", security=suite_security())
    arm, hit = base / "arm", base / "hit"
    engines = tuple(
        EngineProcess(
            nats.url,
            base,
            f"engine-{i}",
            stream_replicas=replicas,
            arm=arm,
            hit=hit,
            env={**REPLICAS, "DAGNATS_REPLICA_ID": f"engine-{i}"},
        )
        for i in (1, 2)
    )
    try:
        for engine in engines:
            await engine.start()
        yield Stack(where, (engines[0], engines[1]), arm, hit)
    finally:
        for engine in engines:
            await engine.stop()
        await nats.stop()


async def read_journal(target: str, run_id: str) -> list[jpb.Record]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        request = jpb.ReadRequest(run_id=run_id, step_id="agent")
        return [r.record async for r in stub.Read(request)]


async def journal_check(target: str, run_id: str) -> jpb.CheckResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        return await jgrpc.JournalServiceStub(channel).Check(jpb.CheckRequest(run_id=run_id))


def failover(*engines: EngineProcess) -> str:
    """A gRPC target that dials the first engine and, while it is down, the next."""
    return "ipv4:" + ",".join(e.target for e in engines)


async def answers(client: Client, refusals: list[str]) -> bool:
    try:
        await client.list_workflows()
    except Unavailable as err:
        if not refusals or refusals[-1] != str(err):  # each new refusal, for a failure's report
            refusals.append(str(err))
            print(f"not answering: {err}")
        return False
    return True


def read_pid(path: Path) -> int | None:
    text = path.read_text() if path.exists() else ""
    return int(text.split()[0]) if text.strip() else None


def placed_by_successor(state: Path, holder: int, iteration: int) -> bool:
    for line in lines(state, "placed"):
        pid, at, request_id = line.split()
        if int(pid) != holder and (int(at), request_id) == (iteration, REQUEST):
            return True
    return False


def claimed(state: Path, iteration: int) -> bool:
    return any(int(line.split()[1]) == iteration for line in lines(state, "claims"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "stall"])
@pytest.mark.parametrize(
    ("seam", "iteration"), [(s, i) for s in SEAMS for i in ITERATIONS.get(s, (0, 1, 2))]
)
async def test_service_crash_point(
    stack: Stack, tmp_path: Path, seam: str, mode: str, iteration: int
) -> None:
    with logs_on_failure(*stack.engines):
        await crash_point(stack, tmp_path, seam, mode, iteration)
    CASES[stack.where, f"{seam}/{mode}"] += 1


async def crash_point(stack: Stack, tmp_path: Path, seam: str, mode: str, iteration: int) -> None:
    inputs = seam == "after_input_claimed"
    committing = seam in ("after_commit_stored", "after_commit_event_sent", "after_kept_decision")
    # Where the run waits while the test arms the seam: before the claim of the
    # iteration that places the input or commits, or of the one whose continue
    # the engine applies into the next dispatch. Iteration 0's dispatch is
    # saved by the start itself, so nothing waits.
    gate = iteration if inputs or committing else iteration - 1
    task, name, key = unique("svc"), unique("svcwf"), unique("svckey")
    stack.hit.unlink(missing_ok=True)
    engines = stack.engines
    workers: list[subprocess.Popen[bytes]] = []
    starting: asyncio.Task[pb.Run] | None = None
    clients = [Client(e.target) for e in engines]
    try:
        for client in clients:
            # A channel to a port whose process was just replaced may still be
            # backing off from the refused connects of the last case.
            await wait_for(
                functools.partial(answers, client, []), timeout=30, message="engine answers"
            )
        await clients[1].register_workflow(loop_workflow(name, task))
        for i in range(len(engines)):
            # Each worker prefers its own engine and fails over to the other, as
            # a worker given both services' addresses does.
            target = failover(engines[i], engines[1 - i])
            gated = gate if gate >= 0 else None
            workers.append(
                spawn_worker(target, task, tmp_path, gate=gated, inputs=inputs, name=f"w{i}")
            )
        for i in range(len(engines)):
            ready = tmp_path / f"ready-w{i}"
            await wait_for(ready.exists, timeout=30)
        holder = 0
        if gate < 0:
            stack.arm.write_text(f"{seam} {mode}")
            start = clients[0].start_run(name, {"ask": "weather"}, idempotency_key=key)
            starting = asyncio.create_task(start)
        else:
            run = await clients[0].start_run(name, {"ask": "weather"}, idempotency_key=key)
            holder = await wait_for(lambda: read_pid(tmp_path / "gated"), timeout=30)
            if inputs:
                await clients[0].submit_input(run.run_id, "agent", REQUEST, {"steer": iteration})
            stack.arm.write_text(f"{seam} {mode}")
            os.kill(holder, signal.SIGUSR1)
        stopped = await wait_for(lambda: read_pid(stack.hit), timeout=30, message="seam not hit")
        down = next(i for i, e in enumerate(engines) if e.pid == stopped)
        up = clients[1 - down]
        if starting is not None:
            run = await up.start_run(name, {"ask": "weather"}, idempotency_key=key)
        if mode == "kill":
            # The survivor alone finishes the run; the dead replica comes back after.
            await engines[down].exited()
        else:
            if inputs:
                took_over = lambda: placed_by_successor(tmp_path, holder, iteration)  # noqa: E731
            elif committing:
                # The holder's task comes back to the other worker, whose claim
                # finds the commit (raising Committed, so it logs no claim) and
                # republishes its event: the run goes on to the next iteration.
                took_over = lambda: claimed(tmp_path, iteration + 1)  # noqa: E731
            else:
                took_over = lambda: claimed(tmp_path, iteration)  # noqa: E731
            await wait_for(took_over, timeout=30, message="no successor took over")
            engines[down].thaw()  # the zombie service goes on from the seam
        done = await up.wait_for_run(run.run_id, timeout=60)
        if mode == "kill":
            await engines[down].start()  # a fresh process on the same port
        if starting is not None:
            with contextlib.suppress(Unavailable):
                assert (await starting).run_id == run.run_id
        if mode == "stall" and inputs:
            await wait_for(
                lambda: zombie_turn(tmp_path, holder, iteration),
                timeout=30,
                message="the zombie's holder never finished its turn",
            )
        target = engines[1 - down].target
        records = await read_journal(target, run.run_id)
        check = await journal_check(target, run.run_id)
        got = await up.get_input(run.run_id, "agent", REQUEST) if inputs else None
    finally:
        stack.arm.unlink(missing_ok=True)
        if starting is not None and not starting.done():
            starting.cancel()
        reap(*workers)
        for engine in engines:
            await engine.ensure_serving()
        for client in clients:
            await client.close()
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == "done"
    assert list(check.violations) == [], check.violations
    assert steps_by_id(done)["agent"].iterations == 3
    sends = [line for line in lines(tmp_path, "starts") if line.startswith("send")]
    assert len(sends) <= 1, f"the unsafe tool started {len(sends)} times"
    if inputs:
        placed = [r for r in records if r.HasField("input_placed") and not r.input_placed.carried]
        assert [(p.input_placed.request_id, p.iteration) for p in placed] == [
            (REQUEST, iteration)
        ], "the input must be placed once, into the iteration that claimed it"
        assert got is not None and got.status == ipb.STATUS_DONE
    if mode == "stall" and inputs:
        outcome = zombie_turn(tmp_path, holder, iteration)
        log = (tmp_path / "worker-w0.log").read_text() + (tmp_path / "worker-w1.log").read_text()
        # Fenced by its successor's claim; or, when the successor finished the
        # run first (a kept iteration's decision comes in milliseconds),
        # stopped because its heartbeat found the run no longer active. Either
        # way it wrote nothing: the journal above is clean, the input placed once.
        fenced = outcome == "Fenced" or (
            outcome == "CancelledError"
            and ("a successor holds the step" in log or "was cancelled; cancelling step" in log)
        )
        assert fenced, f"the holder whose service froze must be stopped, got {outcome}"
