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
import nats.js.errors
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration

from dagnats.cli.journal import check_lines
from dagnats.core import jetstream as jsx
from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import history_subject, task_subject
from dagnats.engine.server import EngineServer, start_engine
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


async def keep(stubs: Stubs, token: jpb.WriterToken, leased: pb.LeasedTask) -> jpb.NextDispatch:
    """Commit a continue that keeps the task message for the next iteration;
    the dispatch handed over with the answer."""
    body = jpb.Commit(action=jpb.ACTION_CONTINUE, output=b'"turn"')
    request = jpb.CommitRequest(token=token, commit=body, lease=leased.lease, keep_task=True)
    answer = await stubs.journal.Commit(request)
    assert answer.HasField("next"), "the task was not kept"
    return answer.next


async def kept_once(
    client: Client, stubs: Stubs, prefix: str
) -> tuple[str, pb.LeasedTask, jpb.NextDispatch]:
    """A run whose first holder claimed iteration 0 and kept its task across
    the commit: the run, the holder's lease and iteration 1 handed over."""
    task, name = unique(prefix), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, {"ask": "?"})
    first = await poll(stubs, task)
    handed = await keep(stubs, await claim(stubs, first), first)
    assert handed.iteration == 1
    return run.run_id, first, handed


async def test_a_holder_of_a_kept_task_fenced_at_a_later_iteration_keeps_no_lease_alive(
    client: Client, stubs: Stubs
) -> None:
    # The holder keeps its task across iteration 0's commit, is handed
    # iteration 1 and goes silent past its lease. The kept message's next
    # delivery claims iteration 1, keeps the message across its own commit
    # and writes in iteration 2, handed over to it. The first holder, woken,
    # is fenced: the records of iteration 2 name the delivery that holds it.
    run_id, zombie, _ = await kept_once(client, stubs, "keptfence")
    successor = await poll(
        stubs, zombie.task.task_type, within=5 * LEASE
    )  # the zombie's lease ran out
    assert (successor.delivery, successor.task.iteration) == (zombie.delivery + 1, 1)
    handed = await keep(stubs, await claim(stubs, successor), successor)
    assert handed.iteration == 2
    model = jpb.RecordModelRequest(token=handed.token, position=0, response=b"{}")
    token = (await stubs.journal.RecordModel(model)).token
    beat = pb.HeartbeatRequest(lease=zombie.lease, run_id=run_id)
    assert await refused(stubs.engine.Heartbeat(beat)) == "fenced"
    own = pb.HeartbeatRequest(lease=successor.lease, run_id=run_id)
    assert not (await stubs.engine.Heartbeat(own)).cancelled
    await commit(stubs, token, successor, jpb.ACTION_COMPLETE, "answer")
    done = await client.wait_for_run(run_id, timeout=20)
    assert run_output(done) == "answer"
    check = await stubs.journal.Check(jpb.CheckRequest(run_id=run_id))
    assert list(check.violations) == []


async def kept_beside(
    nats_server: NatsServer, first: pb.LeasedTask, handed: jpb.NextDispatch | None
) -> None:
    """Keep ``first``'s task through another engine's journal until
    iteration 3, and write in iteration 3: from ``handed`` on, or from the
    claim of iteration 0 when None."""
    other = await start_engine(nats_server.url, config=FAST)
    try:
        async with grpc.aio.insecure_channel(other.target) as channel:
            beside = Stubs(pb_grpc.EngineServiceStub(channel), jgrpc.JournalServiceStub(channel))
            if handed is None:
                handed = await keep(beside, await claim(beside, first), first)
            while handed.iteration < 3:
                handed = await keep(beside, handed.token, first)
            model = jpb.RecordModelRequest(token=handed.token, position=0, response=b"{}")
            await beside.journal.RecordModel(model)
    finally:
        await other.stop()


async def leased_again_at_iteration_3(client: Client, stubs: Stubs, first: pb.LeasedTask) -> None:
    """The kept message, delivered again once its holder went silent, is
    leased for iteration 3 and completes the run."""
    again = await poll(stubs, first.task.task_type, within=5 * LEASE)  # the lease ran out
    assert (again.delivery, again.task.iteration) == (first.delivery + 1, 3)
    token = await claim(stubs, again)
    await commit(stubs, token, again, jpb.ACTION_COMPLETE, "answer")
    done = await client.wait_for_run(first.task.run_id, timeout=20)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert steps_by_id(done)["agent"].iterations == 3


async def test_a_kept_task_delivered_again_is_leased_for_the_iteration_its_journal_reached(
    client: Client, stubs: Stubs, nats_server: NatsServer
) -> None:
    # This engine starts the run and decides iteration 1, whose write says
    # the holder kept its task: its last write of the run. The holder's next
    # commits go through another engine's journal, which decides iterations
    # 2 and 3. The holder writes in iteration 3 and goes silent. The kept
    # message, delivered again by this engine, is leased for iteration 3,
    # read caught up with the journal; leased on this engine's last write,
    # its holder would claim iteration 1, committed long ago.
    _, first, handed = await kept_once(client, stubs, "keptguess")
    await kept_beside(nats_server, first, handed)
    await leased_again_at_iteration_3(client, stubs, first)


async def test_a_task_delivered_again_is_leased_on_a_read_by_the_engine_that_only_started_it(
    client: Client, stubs: Stubs, nats_server: NatsServer
) -> None:
    # This engine starts the run and leases its first task; every decision
    # after is another engine's. This engine's last write says the task is
    # iteration 0's and not kept. Delivered again, the kept message is leased
    # for iteration 3, read caught up: leased on that write, its holder's
    # claim would find iteration 0 past and acknowledge the message the loop
    # runs on, and the step would wait for a reconciler pass.
    task, name = unique("keptstart"), unique("wf")
    await client.register_workflow(loop_workflow(name, task))
    await client.start_run(name, {"ask": "?"})
    first = await poll(stubs, task)
    await kept_beside(nats_server, first, None)
    await leased_again_at_iteration_3(client, stubs, first)


async def test_a_copy_of_a_kept_tasks_first_dispatch_is_settled_not_leased(
    client: Client, stubs: Stubs, engine: EngineServer
) -> None:
    # The holder keeps its task across iteration 0's commit and runs
    # iteration 1 on it. A copy of the task message of iteration 0 (another
    # message, published for the same dispatch) is delivered meanwhile: it is
    # settled as stale, not leased for iteration 1 beside the kept message.
    run_id, first, handed = await kept_once(client, stubs, "keptcopy")
    task = first.task.task_type
    js = engine.nc.jetstream()
    subject = task_subject(task, run_id, "agent")
    kept = await jsx.get_msg(js, jsx.TASKS, subject=subject)
    copy = await js.publish(subject, kept.data or b"", headers={"Nats-Msg-Id": unique("copy")})
    wait = Duration()
    wait.FromSeconds(2)
    polled = await stubs.engine.PollTasks(pb.PollTasksRequest(task_types=[task], wait=wait))
    assert list(polled.tasks) == [], "a copy was leased beside the kept task"

    async def settled() -> bool:
        try:
            await jsx.get_msg(js, jsx.TASKS, seq=copy.seq)
        except nats.js.errors.NotFoundError:
            return True
        return False

    await wait_for(settled, timeout=20, message="the copy was not settled")
    await commit(stubs, handed.token, first, jpb.ACTION_COMPLETE, "answer")
    done = await client.wait_for_run(run_id, timeout=20)
    assert run_output(done) == "answer"
    assert steps_by_id(done)["agent"].iterations == 1


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


async def test_a_fenced_holder_cannot_give_back_its_successors_task(
    client: Client, stubs: Stubs
) -> None:
    run_id, zombie, successor, token = await successor_takes_over(client, stubs)
    give_back = pb.ReportRequest(
        lease=zombie.lease, run_id=run_id, step_id="agent", redeliver=pb.Redeliver()
    )
    assert await refused(stubs.engine.Report(give_back)) == "fenced"
    own = await stubs.engine.Heartbeat(pb.HeartbeatRequest(lease=successor.lease, run_id=run_id))
    assert not own.cancelled, "the successor still holds its task"
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
        history_subject(run_id), event.SerializeToString(), headers={"Nats-Msg-Id": unique("z")}
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
        history_subject(run_id), event.SerializeToString(), headers={"Nats-Msg-Id": unique("late")}
    )
    await wait_for(lambda: engine.engine.counters["dropped"] > dropped, timeout=10)
    step = steps_by_id(await client.get_run(run_id))["agent"]
    assert (step.iterations, step.iteration) == (1, 1), "the old commit did not advance the loop"
    token = await claim(stubs, following)
    await commit(stubs, token, following, jpb.ACTION_COMPLETE, "answer")
    run = await client.wait_for_run(run_id, timeout=20)
    assert run_output(run) == "answer" and steps_by_id(run)["agent"].iterations == 1
