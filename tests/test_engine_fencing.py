"""A holder fenced in the journal cannot settle, extend or release its task
through the engine, whatever it sends: a worker written against the protos
alone (raw gRPC stubs here) gets the same guarantees as the SDK, and the run's
outcome is the journal's last commit."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration

from dagnats.cli.journal import check_lines
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, run_output
from tests.helpers import trailing as helpers_trailing
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, steps_by_id, unique

LEASE = FAST.task_ack_wait


@dataclass
class Stubs:
    engine: pb_grpc.EngineServiceAsyncStub
    journal: jgrpc.JournalServiceAsyncStub


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stubs(engine: EngineServer) -> AsyncIterator[Stubs]:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        yield Stubs(pb_grpc.EngineServiceStub(channel), jgrpc.JournalServiceStub(channel))


async def poll(stubs: Stubs, task_type: str, *, within: float = 20.0) -> pb.LeasedTask:
    wait = Duration()
    wait.FromMilliseconds(500)

    async def one() -> pb.LeasedTask | None:
        got = await stubs.engine.PollTasks(
            pb.PollTasksRequest(task_types=[task_type], max_tasks=1, wait=wait)
        )
        return got.tasks[0] if got.tasks else None

    return await wait_for(one, timeout=within, message=f"a task of {task_type}")


async def claim(stubs: Stubs, leased: pb.LeasedTask) -> jpb.WriterToken:
    task = leased.task
    response = await stubs.journal.Claim(
        jpb.ClaimRequest(
            run_id=task.run_id,
            step_id=task.step_id,
            iteration=task.iteration,
            attempt=task.attempt,
            delivery=leased.delivery,
            worker_id=f"delivery-{leased.delivery}",
        )
    )
    assert response.HasField("claimed"), response
    return response.claimed.token


async def commit(
    stubs: Stubs, token: jpb.WriterToken, leased: pb.LeasedTask, action: int, output: object
) -> jpb.CommitResponse:
    body = jpb.Commit(action=action, output=json.dumps(output).encode())  # type: ignore[arg-type]
    return await stubs.journal.Commit(
        jpb.CommitRequest(token=token, commit=body, lease=leased.lease)
    )


def report(
    leased: pb.LeasedTask, kind: str, output: object, *, journal_seq: int = 0
) -> pb.ReportRequest:
    task = leased.task
    request = pb.ReportRequest(
        lease=leased.lease,
        run_id=task.run_id,
        step_id=task.step_id,
        iteration=task.iteration,
        attempt=task.attempt,
        journal_seq=journal_seq,
    )
    getattr(request, kind).output = json.dumps(output).encode()
    return request


async def refused(call: object) -> str:
    """The dagnats error code a call failed with (it must fail)."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call  # type: ignore[misc]
    trailing = helpers_trailing(failed.value)
    code = str(trailing.get("dagnats-error-code", ""))
    expected = grpc.StatusCode.ABORTED if code == "fenced" else None
    assert failed.value.code() == expected, (failed.value.code(), failed.value.details())
    return code


async def successor_takes_over(
    client: Client, stubs: Stubs
) -> tuple[str, pb.LeasedTask, pb.LeasedTask, jpb.WriterToken]:
    """A run whose first holder claimed and went silent past its lease; the
    task's next delivery claimed after it. Returns the run, the zombie's lease,
    the successor's lease and the successor's writer token."""
    task, name = unique("fence"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, {"ask": "?"})
    zombie = await poll(stubs, task)
    await claim(stubs, zombie)
    successor = await poll(stubs, task, within=5 * LEASE)  # the zombie's lease ran out
    assert successor.delivery == zombie.delivery + 1
    token = await claim(stubs, successor)
    return run.run_id, zombie, successor, token


async def test_a_fenced_holders_complete_is_refused_and_the_run_ends_with_the_last_commit(
    client: Client, stubs: Stubs
) -> None:
    run_id, zombie, successor, token = await successor_takes_over(client, stubs)
    assert await refused(stubs.engine.Report(report(zombie, "complete", "zombie"))) == "fenced"
    for made_up in (999, 2**64 - 1):
        request = report(zombie, "complete", "zombie", journal_seq=made_up)
        assert await refused(stubs.engine.Report(request)) == "fenced", made_up

    done = await commit(stubs, token, successor, jpb.ACTION_COMPLETE, "successor")
    assert done.settled
    run = await client.wait_for_run(run_id, timeout=20)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == "successor"

    # Naming the successor's commit does not let the zombie say something else.
    named = report(zombie, "complete", "zombie", journal_seq=done.commit_seq)
    assert await refused(stubs.engine.Report(named)) == "fenced"
    # Reporting what the commit records repeats the successor's outcome: it is
    # accepted, and the finished step drops it (the answer says so).
    same = report(zombie, "complete", "successor", journal_seq=done.commit_seq)
    assert (await stubs.engine.Report(same)).stale
    check = await stubs.journal.Check(jpb.CheckRequest(run_id=run_id))
    assert list(check.violations) == []
    assert run_output(await client.get_run(run_id)) == "successor"


async def test_a_fenced_holders_continue_neither_advances_the_loop_nor_drops_the_commit(
    client: Client, stubs: Stubs
) -> None:
    run_id, zombie, successor, token = await successor_takes_over(client, stubs)
    assert await refused(stubs.engine.Report(report(zombie, "continue", "zombie"))) == "fenced"
    done = await commit(stubs, token, successor, jpb.ACTION_CONTINUE, "turn 0")

    following = await poll(stubs, successor.task.task_type)
    assert (following.task.iteration, following.task.attempt) == (1, 1)
    step = steps_by_id(await client.get_run(run_id))["agent"]
    assert (step.iterations, step.iteration) == (1, 1)
    assert json.loads(step.output) == "turn 0", "the successor's continue was applied"

    # A commit of another iteration does not settle this one, nor the next.
    late = report(zombie, "continue", "turn 0", journal_seq=done.commit_seq)
    late.iteration = 1
    assert await refused(stubs.engine.Report(late)) == "fenced"
    # The zombie's own dispatch was committed by its successor: a report of it
    # without that commit is stale, and publishes nothing.
    stale = await stubs.engine.Report(report(zombie, "continue", "zombie"))
    assert stale.stale

    token = await claim(stubs, following)
    await commit(stubs, token, following, jpb.ACTION_COMPLETE, "answer")
    run = await client.wait_for_run(run_id, timeout=20)
    assert run_output(run) == "answer"
    step = steps_by_id(run)["agent"]
    assert (step.iterations, step.iteration) == (1, 1)
    check = await stubs.journal.Check(jpb.CheckRequest(run_id=run_id))
    assert list(check.violations) == []


async def test_a_fenced_holders_heartbeat_is_refused_and_keeps_no_lease_alive(
    client: Client, stubs: Stubs
) -> None:
    run_id, zombie, successor, _ = await successor_takes_over(client, stubs)
    beat = pb.HeartbeatRequest(lease=zombie.lease, run_id=run_id)
    assert await refused(stubs.engine.Heartbeat(beat)) == "fenced"
    own = await stubs.engine.Heartbeat(pb.HeartbeatRequest(lease=successor.lease, run_id=run_id))
    assert not own.cancelled, "the holder's own heartbeat is accepted"

    # The successor now dies silently while the zombie keeps beating: the
    # task must come back when the successor's lease runs out.
    answers: list[str] = []

    async def keep_beating() -> None:
        while True:
            try:
                await stubs.engine.Heartbeat(beat)
                answers.append("accepted")
            except grpc.aio.AioRpcError as err:
                answers.append(err.code().name)
            await asyncio.sleep(LEASE / 8)

    beating = asyncio.create_task(keep_beating())
    try:
        again = await poll(stubs, successor.task.task_type, within=5 * LEASE)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
    assert again.delivery == successor.delivery + 1
    assert answers and set(answers) == {"ABORTED"}
    token = await claim(stubs, again)
    await commit(stubs, token, again, jpb.ACTION_COMPLETE, "done")
    assert run_output(await client.wait_for_run(run_id, timeout=20)) == "done"


async def test_a_fenced_holder_cannot_release_its_successors_task(
    client: Client, stubs: Stubs
) -> None:
    run_id, zombie, successor, token = await successor_takes_over(client, stubs)
    release = pb.ReportRequest(
        lease=zombie.lease,
        run_id=run_id,
        step_id="agent",
        iteration=0,
        attempt=1,
        acknowledge=pb.Acknowledge(),
    )
    assert await refused(stubs.engine.Report(release)) == "fenced"
    await commit(stubs, token, successor, jpb.ACTION_COMPLETE, "done")
    assert run_output(await client.wait_for_run(run_id, timeout=20)) == "done"


async def test_journal_check_flags_a_run_whose_outcome_is_not_the_last_commit(
    client: Client, stubs: Stubs, engine: EngineServer
) -> None:
    # The zombie's outcome reaches the run's history without the engine's
    # Report (as an engine without its journal check published it); the
    # engine applies it, and the successor's commit comes too late.
    run_id, _zombie, successor, token = await successor_takes_over(client, stubs)
    event = ipb.HistoryEvent(run_id=run_id, step_id="agent", iteration=0, attempt=1)
    event.complete.output = b'"zombie"'
    await engine.nc.jetstream().publish(
        f"history.{run_id}", event.SerializeToString(), headers={"Nats-Msg-Id": unique("z")}
    )
    run = await client.wait_for_run(run_id, timeout=20)
    assert run_output(run) == "zombie"
    await commit(stubs, token, successor, jpb.ACTION_COMPLETE, "successor")

    check = await stubs.journal.Check(jpb.CheckRequest(run_id=run_id))
    assert [v.rule for v in check.violations] == ["outcome"], check.violations
    (violation,) = check.violations
    assert "'\"zombie\"'" in violation.message and "'\"successor\"'" in violation.message
    assert check_lines(run_id, check)[-1].endswith("1 violation")


async def test_a_commit_of_an_earlier_iteration_does_not_settle_the_current_one(
    client: Client, stubs: Stubs, engine: EngineServer
) -> None:
    # Iteration 0's event arrives again after the dedupe window (a new Msg-Id):
    # it carries a journal commit, but of iteration 0, and the step is at 1.
    run_id, _zombie, successor, token = await successor_takes_over(client, stubs)
    done = await commit(stubs, token, successor, jpb.ACTION_CONTINUE, "turn 0")
    following = await poll(stubs, successor.task.task_type)
    dropped = engine.engine.counters["dropped"]
    event = ipb.HistoryEvent(
        run_id=run_id, step_id="agent", iteration=0, attempt=1, journal_seq=done.commit_seq
    )
    getattr(event, "continue").output = b'"turn 0"'
    await engine.nc.jetstream().publish(
        f"history.{run_id}", event.SerializeToString(), headers={"Nats-Msg-Id": unique("late")}
    )
    await wait_for(lambda: engine.engine.counters["dropped"] > dropped, timeout=10)
    step = steps_by_id(await client.get_run(run_id))["agent"]
    assert (step.iterations, step.iteration) == (1, 1), "the old commit did not advance the loop"
    token = await claim(stubs, following)
    await commit(stubs, token, following, jpb.ACTION_COMPLETE, "answer")
    run = await client.wait_for_run(run_id, timeout=20)
    assert run_output(run) == "answer" and steps_by_id(run)["agent"].iterations == 1
