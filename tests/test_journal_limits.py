"""Big records: a record over the journal's maximum is refused before it is
written, with RESOURCE_EXHAUSTED and the dagnats error trailers, and a step
whose records are near the maximum can still be claimed by a gRPC client with
default options (a 4 MiB receive limit), which then resumes it."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from dagnats.core.errors import RecordTooLarge
from dagnats.core.grpcutil import CODE_KEY, FIELD_KEY, error_from_rpc
from dagnats.engine.server import EngineServer
from dagnats.journal.limits import MAX_RECORD_BYTES
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client
from tests.helpers import trailing
from tests.stack import loop_workflow, unique
from tests.test_journal import read_journal


def _json_of(size: int) -> bytes:
    return b'"' + b"x" * (size - 2) + b'"'


async def _open_step(client: Client) -> str:
    name, task = unique("limits"), unique("limits")
    await client.register_workflow(loop_workflow(name, task))
    return (await client.start_run(name)).run_id  # no worker: the journal is driven by hand


async def test_an_oversized_record_is_refused_before_it_is_written(
    client: Client, engine: EngineServer
) -> None:
    run_id = await _open_step(client)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        claim = jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=0, attempt=1)
        token = (await stub.Claim(claim)).claimed.token
        too_big = _json_of(MAX_RECORD_BYTES + 1)
        try:
            await stub.RecordModel(
                jpb.RecordModelRequest(token=token, position=0, response=too_big)
            )
        except grpc.aio.AioRpcError as err:
            refusal = err
        else:
            raise AssertionError("a record over the maximum was accepted")
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = trailing(refusal)
        assert trailers[CODE_KEY] == "record_too_large"
        assert trailers[FIELD_KEY] == "model"
        assert isinstance(error_from_rpc(refusal), RecordTooLarge)
        # The same writer goes on: nothing was written, so its token is current.
        fits = _json_of(MAX_RECORD_BYTES - 4096)
        stored = await stub.RecordModel(
            jpb.RecordModelRequest(token=token, position=0, response=fits)
        )
        assert stored.token.last_seq == token.last_seq + 1
    kinds = [r.WhichOneof("kind") for r in await read_journal(engine, run_id)]
    assert kinds == ["claim", "model"], "the refused record is not in the journal"
    await client.cancel_run(run_id)


async def test_a_refused_record_names_what_makes_it_too_large(
    client: Client, engine: EngineServer
) -> None:
    """A commit whose state alone is over the maximum names the state; one
    whose state and output each fit but not together names the record and its
    largest part. Both with the sizes, grouped by thousands."""
    run_id = await _open_step(client)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        claim = jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=0, attempt=1)
        token = (await stub.Claim(claim)).claimed.token
        over, part = MAX_RECORD_BYTES + 100, MAX_RECORD_BYTES * 3 // 5
        messages: list[str] = []
        for commit in (
            jpb.Commit(action=jpb.ACTION_CONTINUE, state=_json_of(over), has_state=True),
            jpb.Commit(
                action=jpb.ACTION_CONTINUE,
                state=_json_of(part + 1),
                has_state=True,
                output=_json_of(part),
            ),
        ):
            try:
                await stub.Commit(jpb.CommitRequest(token=token, commit=commit))
            except grpc.aio.AioRpcError as err:
                assert isinstance(error_from_rpc(err), RecordTooLarge)
                messages.append(err.details() or "")
    assert len(messages) == 2, "both commits were refused"
    most = f"a journal record is at most {MAX_RECORD_BYTES:,} bytes"
    assert messages[0] == f"the state is {over:,} bytes; {most}"
    assert messages[1].startswith("the commit record would be ")
    assert messages[1].endswith(f"bytes, the state {part + 1:,} of them; {most}")
    await client.cancel_run(run_id)


async def test_a_step_with_records_near_the_limit_is_claimed_by_a_default_client(
    client: Client, engine: EngineServer
) -> None:
    """Four records and a state of almost the maximum each: more than 4 MiB
    in all. A default client claims the next attempt, gets the records that fit
    and a cursor for the rest, reads the state that follows the answer, and
    resumes: a recorded response is reused."""
    run_id = await _open_step(client)
    near = MAX_RECORD_BYTES - 4096
    async with grpc.aio.insecure_channel(engine.target) as channel:  # default options
        stub = jgrpc.JournalServiceStub(channel)
        first = (
            await stub.Claim(
                jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=0, attempt=1)
            )
        ).claimed.token
        state = _json_of(near)
        commit = jpb.Commit(action=jpb.ACTION_CONTINUE, state=state, has_state=True)
        await stub.Commit(jpb.CommitRequest(token=first, commit=commit))
        claim1 = jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=1, attempt=1)
        token = (await stub.Claim(claim1)).claimed.token
        responses = [_json_of(near - n) for n in range(4)]
        for position, response in enumerate(responses):
            recorded = await stub.RecordModel(
                jpb.RecordModelRequest(token=token, position=position, response=response)
            )
            token = recorded.token
        # The holder dies; the retry of the iteration claims with a default client.
        claim2 = jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=1, attempt=2)
        answer = await stub.Claim(claim2)
        assert answer.ByteSize() < 4 * 1024 * 1024
        claimed = answer.claimed
        # A state this large does not ride the claim's answer: the answer
        # says it follows, and the client reads it in chunks with ReadState.
        assert claimed.has_state and claimed.state_follows and not claimed.state
        read = jpb.ReadStateRequest(run_id=run_id, step_id="agent")
        chunks = [chunk async for chunk in stub.ReadState(read)]
        assert all(c.ByteSize() < 4 * 1024 * 1024 for c in chunks)
        assert b"".join(c.chunk for c in chunks) == state
        assert claimed.more_from_seq, "not every record fitted: the answer names the rest"
        rest = [
            r.record
            async for r in stub.Read(
                jpb.ReadRequest(run_id=run_id, step_id="agent", from_seq=claimed.more_from_seq)
            )
            if r.record.seq <= claimed.token.snapshot_seq
        ]
        models = [r.model.response for r in [*claimed.records, *rest] if r.HasField("model")]
        assert models == responses, "the claim's records and the rest are the iteration's"
        # A new attempt asks its model afresh; the earlier attempt's records
        # stay readable and the attempt commits.
        begin = await stub.BeginModel(jpb.BeginModelRequest(token=claimed.token, position=0))
        assert not begin.recorded
        done = await stub.Commit(
            jpb.CommitRequest(
                token=claimed.token, commit=jpb.Commit(action=jpb.ACTION_COMPLETE, output=b"1")
            )
        )
        assert done.commit_seq > claimed.token.last_seq
    await client.cancel_run(run_id)


async def test_a_tool_result_too_large_to_record_is_the_tools_error(engine: EngineServer) -> None:
    """The tool ran and its output cannot be stored: its intent is answered
    with that error, and the call raises ``RecordTooLarge`` (unhandled, it
    fails the step: ``test_refusals.py``). A handler that catches it goes on."""
    from dagnats.sdk import Replay, TaskContext, ToolCall, ToolRun, run_output
    from tests.test_journal_api import run_once

    seen: dict[str, str] = {}

    async def huge(run: ToolRun) -> str:
        return "y" * (MAX_RECORD_BYTES + 10)

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        try:
            await j.tool(ToolCall(name="dump", input={}), Replay.UNSAFE, huge)
        except RecordTooLarge as err:
            seen["error"] = err.message
        await tc.complete("went on")

    run = await run_once(engine, handler)
    assert run_output(run) == "went on"
    assert seen["error"].startswith(f"the tool's output is {MAX_RECORD_BYTES + 12:,} bytes")
    results = [r for r in await read_journal(engine, run.run_id) if r.HasField("tool_result")]
    assert [r.tool_result.error for r in results] == [f"tool result not recorded: {seen['error']}"]


async def test_a_settled_claim_is_settled_by_the_journal_for_a_plain_grpc_client(
    client: Client, engine: EngineServer
) -> None:
    """A holder committed and died before its event was published. A worker that
    speaks plain gRPC claims the redelivery with its lease and sends no Report:
    the journal service publishes the stored commit's event and releases the task,
    so the run completes with the commit's output."""
    from google.protobuf.duration_pb2 import Duration

    from dagnats.engine.v1 import engine_pb2 as pb
    from dagnats.engine.v1 import engine_pb2_grpc as egrpc
    from dagnats.sdk import run_output

    name, task = unique("settle"), unique("settle")
    await client.register_workflow(loop_workflow(name, task))
    run_id = (await client.start_run(name)).run_id
    async with grpc.aio.insecure_channel(engine.target) as channel:
        engine_stub, stub = egrpc.EngineServiceStub(channel), jgrpc.JournalServiceStub(channel)

        async def lease() -> pb.LeasedTask:
            while True:
                polled = await engine_stub.PollTasks(
                    pb.PollTasksRequest(task_types=[task], max_tasks=1, wait=Duration(seconds=5))
                )
                if polled.tasks:
                    return polled.tasks[0]

        first = await lease()
        claim = jpb.ClaimRequest(
            run_id=run_id, step_id="agent", iteration=0, attempt=first.task.attempt
        )
        token = (await stub.Claim(claim)).claimed.token
        done = jpb.Commit(action=jpb.ACTION_COMPLETE, output=b'"from the commit"')
        await stub.Commit(jpb.CommitRequest(token=token, commit=done))  # no lease: not settled
        again = await lease()  # the lease ran out: the task is delivered again
        claim.delivery, claim.lease = again.delivery, again.lease
        answer = await stub.Claim(claim)
        assert answer.settled.reason == "committed" and answer.settled.task_settled
        run = await client.wait_for_run(run_id, timeout=30)
    assert run_output(run) == "from the commit"


async def test_claims_repeated_for_one_delivery_are_not_restarts(
    client: Client, engine: EngineServer
) -> None:
    """A claim whose answer did not reach its worker is claimed again for the same
    delivery. However often that happens, the step is not driven into its
    restart limit; a new delivery is a restart."""
    run_id = await _open_step(client)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        claim = jpb.ClaimRequest(
            run_id=run_id,
            step_id="agent",
            iteration=0,
            attempt=1,
            delivery=1,
            worker_id="w-1",
            restart_limit=2,
        )
        for _ in range(4):  # each answer "lost": the worker claims again
            assert (await stub.Claim(claim)).HasField("claimed")
        claim.delivery = 2  # the lease ran out and the task came back
        answer = await stub.Claim(claim)
    assert answer.settled.reason == "restart_limit"
    await client.cancel_run(run_id)


@pytest.mark.parametrize("limit", [2, 3])
@pytest.mark.parametrize(
    "rides", [True, False], ids=["first claim rides its first record", "every claim stored"]
)
async def test_the_restart_limit_is_reached_at_the_limits_delivery(
    client: Client, engine: EngineServer, limit: int, rides: bool
) -> None:
    """Each delivery's holder dies after its claim, before its first record.
    Whether the first delivery's claim rode that record (and so was never
    stored) or was stored on its own, the ``limit``-th delivery's claim fails
    the step: ``limit`` deliveries in a row, not one more."""
    run_id = await _open_step(client)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        answers = []
        for delivery in range(1, limit + 1):
            claim = jpb.ClaimRequest(
                run_id=run_id,
                step_id="agent",
                iteration=0,
                attempt=1,
                delivery=delivery,
                worker_id=f"w-{delivery}",
                restart_limit=limit,
                may_ride=rides,
            )
            answers.append(await stub.Claim(claim))
    first, *middle, last = answers
    assert first.claimed.token.HasField("claim") is rides, "the first claim rode or was stored"
    assert all(a.HasField("claimed") for a in middle)
    assert last.settled.reason == "restart_limit"
    assert last.settled.detail == f"restart limit: {limit} deliveries in a row without progress"
    records = await read_journal(engine, run_id)
    stored = [r.claim.delivery for r in records if r.HasField("claim")]
    assert stored == list(range(2 if rides else 1, limit + 1))
    await client.cancel_run(run_id)


async def test_inputs_placed_by_one_call_fit_its_answer_and_the_rest_wait(
    client: Client, engine: EngineServer
) -> None:
    """Seventy queued inputs of 64 KiB each, more than 4 MiB in all: a default
    client's PlaceInputs gets those that fit, the rest stay queued, and the
    next call places them; every input is placed once."""
    from dagnats.inputs.rules import MAX_CONTENT_BYTES
    from dagnats.inputs.v1 import inputs_pb2 as ipb

    run_id = await _open_step(client)
    content = {"text": "z" * (MAX_CONTENT_BYTES - 64)}
    sent = [f"in-{n}" for n in range(70)]
    for request_id in sent:
        await client.submit_input(run_id, "agent", request_id, content)
    async with grpc.aio.insecure_channel(engine.target) as channel:  # default options
        stub = jgrpc.JournalServiceStub(channel)
        claim = jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=0, attempt=1)
        token = (await stub.Claim(claim)).claimed.token
        placed: list[str] = []
        for position in range(2):
            answer = await stub.PlaceInputs(
                jpb.PlaceInputsRequest(token=token, position=position, mode=1)
            )
            assert answer.ByteSize() < 4 * 1024 * 1024
            assert answer.inputs, f"call {position} placed nothing"
            placed += [p.request_id for p in answer.inputs]
            token = answer.token
            if position == 0:
                rest = [r for r in sent if r not in placed]
                assert rest, "the first call cannot have placed all of them"
                left = await client.get_input(run_id, "agent", rest[0])
                assert left.status == ipb.STATUS_QUEUED, "what did not fit stays queued"
    assert sorted(placed) == sorted(sent)
    await client.cancel_run(run_id)
