"""The journal handle's rules for handlers, reading, and purging with the run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc.aio
import pytest
from nats.aio.msg import Msg

from dagnats.core import jetstream as jsx
from dagnats.core.errors import Fenced, NotFound
from dagnats.core.grpcutil import error_from_rpc
from dagnats.core.natsserver import NatsServer
from dagnats.engine.model import TaskVanished
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.store import EngineStore
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.journal.limits import HEADER_ROOM, MAX_RECORD_BYTES
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import (
    Client,
    ConcurrentJournalUse,
    InvalidArgument,
    Replay,
    TaskContext,
    ToolCall,
    ToolRun,
    Worker,
    run_output,
)
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, unique
from tests.test_journal import journal_check, read_journal


async def run_once(engine: EngineServer, handler: Any) -> pb.Run:
    task, name = unique("api"), unique("apiwf")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name)
            return await client.wait_for_run(run.run_id, timeout=30)


@asynccontextmanager
async def as_its_worker(
    engine: EngineServer, prefix: str
) -> AsyncIterator[tuple[pb.Run, jgrpc.JournalServiceAsyncStub]]:
    """A run of a new loop workflow that no worker polls, and a journal stub to
    be its worker with; the run is cancelled afterwards."""
    name, task = unique(prefix), unique(prefix)
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name)
        async with grpc.aio.insecure_channel(engine.target) as channel:
            yield run, jgrpc.JournalServiceStub(channel)
        await client.cancel_run(run.run_id)


async def test_concurrent_use_of_one_handle_raises(engine: EngineServer) -> None:
    caught: list[BaseException] = []

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()

        async def ask() -> Any:
            return await j.model(lambda: asyncio.sleep(0.05, result={"ok": 1}))

        results = await asyncio.gather(ask(), ask(), return_exceptions=True)
        caught.extend(r for r in results if isinstance(r, BaseException))
        await tc.complete("ok")

    run = await run_once(engine, handler)
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert len(caught) == 1 and isinstance(caught[0], ConcurrentJournalUse)


async def test_tool_errors_are_results_and_output_must_be_json(engine: EngineServer) -> None:
    seen: dict[str, Any] = {}

    async def failing(run: ToolRun) -> Any:
        raise RuntimeError("disk full")

    async def not_json(run: ToolRun) -> Any:
        return {1, 2}

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        result = await j.tool(ToolCall(name="write", input={"n": 1}), Replay.UNSAFE, failing)
        seen["error"] = result.error
        try:
            await j.tool(ToolCall(name="odd", input={}), Replay.SAFE, not_json)
        except InvalidArgument as err:
            seen["not_json"] = err.message
        await tc.complete("survived")

    run = await run_once(engine, handler)
    assert run.status == pb.RUN_STATUS_COMPLETED and run_output(run) == "survived"
    assert seen["error"] == "RuntimeError: disk full"
    assert seen["not_json"].startswith("output is not JSON-serialisable")
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == []


async def test_journal_state_travels_in_commits_without_the_checkpoint_cap(
    engine: EngineServer,
) -> None:
    big = "x" * (FAST.loop_state_max_bytes + 1000)

    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        state = await tc.load_checkpoint()
        if tc.iteration == 0:
            assert state is None
            await tc.checkpoint({"blob": big, "turn": 0})
            await tc.continue_()
        else:
            assert state is not None
            await tc.complete({"len": len(state["blob"]), "turn": state["turn"]})

    run = await run_once(engine, handler)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == {"len": len(big), "turn": 0}


async def test_read_pages_and_follows_then_purge_removes_the_journal(engine: EngineServer) -> None:
    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        await j.model(lambda: asyncio.sleep(0, result={"n": tc.iteration}))
        if tc.iteration < 2:
            await tc.continue_()
        else:
            await tc.complete("done")

    run = await run_once(engine, handler)
    records = await read_journal(engine, run.run_id)
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        page = [
            r.record
            async for r in stub.Read(
                jpb.ReadRequest(
                    run_id=run.run_id, step_id="agent", from_seq=records[1].seq, limit=2
                )
            )
        ]
        assert [r.seq for r in page] == [records[1].seq, records[2].seq]
        followed: list[int] = []
        call = stub.Read(jpb.ReadRequest(run_id=run.run_id, step_id="agent", follow=True))
        async for item in call:
            followed.append(item.record.seq)
            if len(followed) == len(records):
                call.cancel()
                break
        assert followed == [r.seq for r in records]
    async with Client(engine.target) as client:
        await client.purge_run(run.run_id)
        with pytest.raises(NotFound):
            await client.get_run(run.run_id)
    js = engine.nc.jetstream()
    info = await js.stream_info("AGENT_JOURNAL", subjects_filter=f"journal.{run.run_id}.>")
    assert not info.state.subjects, "the journal was purged with the run"


async def test_calls_per_dispatch_are_bounded(engine: EngineServer) -> None:
    from dagnats.core.errors import InvalidArgument as CoreInvalid
    from dagnats.core.grpcutil import error_from_rpc

    seen: list[str] = []

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        async with grpc.aio.insecure_channel(engine.target) as channel:
            stub = jgrpc.JournalServiceStub(channel)
            try:
                await stub.BeginModel(jpb.BeginModelRequest(token=j.token, position=1000))
            except grpc.aio.AioRpcError as err:
                mapped = error_from_rpc(err)
                assert isinstance(mapped, CoreInvalid)
                seen.append(mapped.field or "")
        await tc.complete("ok")

    run = await run_once(engine, handler)
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert seen == ["position"]


async def begin_unsafe_tool(
    stub: jgrpc.JournalServiceAsyncStub, run_id: str
) -> jpb.BeginToolResponse:
    """Claim iteration 0 of ``run_id`` as its worker and begin an unsafe tool."""
    claimed = await stub.Claim(
        jpb.ClaimRequest(run_id=run_id, step_id="agent", iteration=0, attempt=1)
    )
    return await stub.BeginTool(
        jpb.BeginToolRequest(
            token=claimed.claimed.token,
            position=0,
            name="charge",
            input=b"{}",
            replay=jpb.REPLAY_UNSAFE,
        )
    )


async def assert_intent_seq_refused(
    stub: jgrpc.JournalServiceAsyncStub, token: jpb.WriterToken, intent_seq: int
) -> None:
    """Both a tool output and a result for ``intent_seq`` are refused."""
    for call in (
        stub.ToolOutput(jpb.ToolOutputRequest(token=token, intent_seq=intent_seq, chunk="x")),
        stub.FinishTool(jpb.FinishToolRequest(token=token, intent_seq=intent_seq, output=b"1")),
    ):
        assert await refused_field(call) == "intent_seq", f"intent_seq {intent_seq}"


async def test_an_output_or_result_must_answer_a_record_the_writer_has_seen(
    engine: EngineServer,
) -> None:
    name, task = unique("intentseq"), unique("intentseq")
    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name)  # no worker: the step's dispatch stays open
        async with grpc.aio.insecure_channel(engine.target) as channel:
            stub = jgrpc.JournalServiceStub(channel)
            begun = await begin_unsafe_tool(stub, run.run_id)
            token, intent = begun.token, begun.intent_seq
            for bad in (0, intent + 1, intent + 100):
                await assert_intent_seq_refused(stub, token, bad)
            done = await stub.FinishTool(
                jpb.FinishToolRequest(token=token, intent_seq=intent, output=b"1")
            )
            assert done.token.last_seq == intent + 1, "nothing was written by the refused calls"
        await client.cancel_run(run.run_id)


async def test_an_output_or_result_cannot_answer_an_intent_of_an_earlier_iteration(
    engine: EngineServer,
) -> None:
    # Iteration 0 ran an unsafe tool; the holder of iteration 1 sends output
    # and a result for that intent. It is a record the writer's token has
    # seen, but not of its iteration: answering it would put a second result
    # in the journal for a tool that ran once, in an iteration that never
    # called it.
    async with as_its_worker(engine, "intentit") as (run, stub):
        begun = await begin_unsafe_tool(stub, run.run_id)
        finished = await stub.FinishTool(
            jpb.FinishToolRequest(token=begun.token, intent_seq=begun.intent_seq, output=b"1")
        )
        await stub.Commit(
            jpb.CommitRequest(token=finished.token, commit=jpb.Commit(action=jpb.ACTION_CONTINUE))
        )
        next_claim = await stub.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=1, attempt=1)
        )
        token = next_claim.claimed.token
        assert token.base_seq >= begun.intent_seq
        await assert_intent_seq_refused(stub, token, begun.intent_seq)
        records = [
            r.record async for r in stub.Read(jpb.ReadRequest(run_id=run.run_id, step_id="agent"))
        ]
        assert [r.WhichOneof("kind") for r in records if r.iteration == 1] == ["claim"]


async def test_a_claim_after_its_own_commit_reads_no_tail_and_a_wrong_guess_reads_it(
    engine: EngineServer, nats_server: NatsServer
) -> None:
    """A replica claims the next iteration right after the commit it stored,
    without a tail read. If another replica wrote since, the guess is wrong:
    the claim reads the tail, lands after the other claim and fences it."""
    name, task = unique("guess"), unique("guess")
    other = await start_engine(nats_server.url, config=FAST)  # a second journal replica
    nc = await jsx.connect(nats_server.url, name="tail-reads")
    reads: list[str] = []

    async def tap(msg: Msg) -> None:
        reads.append(msg.subject)

    sub = await nc.subscribe(f"$JS.API.STREAM.MSG.GET.{jsx.JOURNAL}", cb=tap)
    try:
        async with (
            Client(engine.target) as client,
            grpc.aio.insecure_channel(engine.target) as a_channel,
            grpc.aio.insecure_channel(other.target) as b_channel,
        ):
            await client.register_workflow(loop_workflow(name, task))
            run = await client.start_run(name)  # no worker: the journal is driven by hand
            a, b = jgrpc.JournalServiceStub(a_channel), jgrpc.JournalServiceStub(b_channel)

            def claim(iteration: int) -> jpb.ClaimRequest:
                return jpb.ClaimRequest(
                    run_id=run.run_id, step_id="agent", iteration=iteration, attempt=1
                )

            first = (await a.Claim(claim(0))).claimed.token
            state = b'{"turn": 0}'
            commit = jpb.Commit(action=jpb.ACTION_CONTINUE, state=state, has_state=True)
            committed = await a.Commit(jpb.CommitRequest(token=first, commit=commit))

            await nc.flush()
            reads.clear()
            mine = (await a.Claim(claim(1))).claimed
            await nc.flush()
            assert reads == [], "the claim after its own commit read the tail"
            assert mine.token.base_seq == committed.commit_seq
            assert mine.token.last_seq == committed.commit_seq + 1
            assert mine.has_state and mine.state == state
            await a.Commit(jpb.CommitRequest(token=mine.token, commit=commit))

            theirs = (await b.Claim(claim(2))).claimed  # B claims iteration 2 first
            again = (await a.Claim(claim(2))).claimed  # a duplicate delivery reaches A
            assert again.token.last_seq > theirs.token.last_seq, "A's claim follows B's"
            assert [r.seq for r in again.records] == [theirs.token.last_seq, again.token.last_seq]
            assert again.has_state and again.state == state
            with pytest.raises(grpc.aio.AioRpcError) as fenced:
                await b.RecordModel(
                    jpb.RecordModelRequest(token=theirs.token, position=0, response=b"{}")
                )
            assert isinstance(error_from_rpc(fenced.value), Fenced)
            await client.cancel_run(run.run_id)
        kinds = [
            (r.iteration, r.WhichOneof("kind")) for r in await read_journal(engine, run.run_id)
        ]
        assert kinds == [
            (0, "claim"),
            (0, "commit"),
            (1, "claim"),
            (1, "commit"),
            (2, "claim"),
            (2, "claim"),
            # The cancel seals the journal, at the engine's iteration of the
            # step: no commit was reported to it.
            (0, "cancel"),
        ]
    finally:
        await sub.unsubscribe()
        await nc.close()
        await other.stop()


# ---- a response or result stored with the next call: leading entries (ADR 24) -------------


async def refused_field(call: Any) -> str:
    """The field an INVALID_ARGUMENT answer names; fails if ``call`` succeeds."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        refused = error_from_rpc(err)
    else:
        raise AssertionError("the call was accepted")
    assert isinstance(refused, InvalidArgument), refused
    return refused.field or ""


async def test_an_entry_that_rides_a_call_is_checked_and_a_refused_call_writes_neither(
    engine: EngineServer,
) -> None:
    async with as_its_worker(engine, "ride") as (run, stub):
        claimed = await stub.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
        )
        token = claimed.claimed.token

        def begin(model: jpb.ModelCall, **fields: Any) -> Any:
            call: dict[str, Any] = {"position": 1, "name": "charge", "input": b"{}"} | fields
            return stub.BeginTool(jpb.BeginToolRequest(token=token, model=model, **call))

        good = jpb.ModelCall(position=0, response=b'{"tool": "charge"}')
        assert await refused_field(begin(jpb.ModelCall(position=1, response=b"{}"))) == (
            "model.position"
        )
        assert await refused_field(begin(jpb.ModelCall(position=0, response=b"no"))) == (
            "model.response"
        )
        assert await refused_field(begin(good, name="")) == "name"
        assert await refused_field(begin(good, input=b"{")) == "input"
        begun = await begin(good, replay=jpb.REPLAY_UNSAFE)
        assert begun.run and begun.token.last_seq == token.last_seq + 1, "one record"
        token = begun.token

        def commit(result: jpb.ToolResult, **fields: Any) -> Any:
            request = jpb.CommitRequest(token=token, tool_result=result)
            request.commit.MergeFrom(jpb.Commit(**fields))
            return stub.Commit(request)

        done = jpb.ToolResult(intent_seq=begun.intent_seq, output=b'"charged"')
        wrong = jpb.ToolResult(intent_seq=begun.intent_seq + 1, output=b"1")
        assert await refused_field(commit(wrong, action=jpb.ACTION_CONTINUE)) == (
            "tool_result.intent_seq"
        )
        not_json = jpb.ToolResult(intent_seq=begun.intent_seq, output=b"{")
        assert await refused_field(commit(not_json, action=jpb.ACTION_CONTINUE)) == (
            "tool_result.output"
        )
        assert await refused_field(commit(done)) == "commit.action"
        stored = await commit(done, action=jpb.ACTION_CONTINUE)
        assert stored.commit_seq == token.last_seq + 1
        records = await read_journal(engine, run.run_id)
        assert [(r.WhichOneof("leading"), r.WhichOneof("kind")) for r in records] == [
            (None, "claim"),
            ("leading_model", "tool_intent"),
            ("leading_tool_result", "commit"),
        ]
        assert records[1].leading_model == good
        assert records[2].leading_tool_result == done
        check = await journal_check(engine, run.run_id)
        assert list(check.violations) == [] and check.records == 3


async def test_a_call_refused_whole_stores_the_response_on_its_own_first(
    engine: EngineServer,
) -> None:
    # A tool name the service refuses, and an intent that fits a record
    # alone but not with the response: the response is stored on its own,
    # as before, and the call goes on alone (raising, or running the tool).
    limit = min(MAX_RECORD_BYTES, engine.nc.max_payload - HEADER_ROOM)
    big = "x" * (limit - 30_000)
    raised: list[BaseException] = []

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        await j.model(lambda: asyncio.sleep(0, result={"tool": "n" * 300}))
        try:
            await j.tool(ToolCall(name="n" * 300), Replay.SAFE, lambda run: asyncio.sleep(0))
        except InvalidArgument as err:
            raised.append(err)
        await j.model(lambda: asyncio.sleep(0, result={"text": "y" * 60_000}))
        result = await j.tool(
            ToolCall(name="echo", input=big), Replay.SAFE, lambda run: asyncio.sleep(0, result=1)
        )
        await tc.complete(result.output)

    run = await run_once(engine, handler)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert len(raised) == 1 and getattr(raised[0], "field", None) == "name"
    records = await read_journal(engine, run.run_id)
    assert [(r.WhichOneof("leading"), r.WhichOneof("kind")) for r in records] == [
        (None, "model"),
        (None, "model"),
        (None, "tool_intent"),
        ("leading_tool_result", "commit"),
    ]
    assert records[0].HasField("leading_claim"), "the claim rides the first record"
    assert [r.model.position for r in records[0:2]] == [0, 2]
    assert records[2].tool_intent.position == 3
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == []


async def test_a_replay_mismatch_with_a_response_writes_nothing(engine: EngineServer) -> None:
    async with as_its_worker(engine, "ridemm") as (run, stub):
        claim = jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
        first = (await stub.Claim(claim)).claimed.token
        await stub.RecordModel(jpb.RecordModelRequest(token=first, position=1, response=b"1"))
        claim.delivery = 2
        token = (await stub.Claim(claim)).claimed.token  # a redelivery
        request = jpb.BeginToolRequest(
            token=token,
            position=1,
            name="charge",
            input=b"{}",
            model=jpb.ModelCall(position=0, response=b"{}"),
        )
        try:
            await stub.BeginTool(request)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        else:
            raise AssertionError("a tool at a model call's position was accepted")
        records = await read_journal(engine, run.run_id)
        assert records[-1].seq == token.last_seq, "nothing was written"


async def test_two_model_calls_in_a_row_keep_both_responses(engine: EngineServer) -> None:
    # The first response cannot ride a model call (BeginModel writes nothing):
    # it is stored on its own before the second request goes out, and the
    # second rides the commit. The models answer without giving the event
    # loop a turn, so only that rule stores the first.
    async def now(response: Any) -> Any:
        return response

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        first = await j.model(lambda: now({"draft": 1}))
        second = await j.model(lambda: now({"final": first["draft"] + 1}))
        await tc.complete(second)

    run = await run_once(engine, handler)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    records = await read_journal(engine, run.run_id)
    assert [(r.WhichOneof("leading"), r.WhichOneof("kind")) for r in records] == [
        (None, "model"),
        ("leading_model", "commit"),
    ]
    assert (records[0].model.position, records[0].model.response) == (0, b'{"draft":1}')
    assert (records[1].leading_model.position, records[1].leading_model.response) == (
        1,
        b'{"final":2}',
    )


# ---- the riding claim: a first claim stored with the first record (ADR 40) ----------------


def first_tool_call(token: jpb.WriterToken) -> jpb.BeginToolRequest:
    """The first journal call of a turn: a model's response and the intent of
    the unsafe tool it asks for."""
    return jpb.BeginToolRequest(
        token=token,
        model=jpb.ModelCall(position=0, response=b'{"tool": "charge"}'),
        position=1,
        name="charge",
        input=b"{}",
        replay=jpb.REPLAY_UNSAFE,
    )


async def test_a_first_claim_that_fences_nothing_is_stored_with_the_first_record(
    engine: EngineServer,
) -> None:
    async with as_its_worker(engine, "ride1") as (run, stub):
        first = jpb.ClaimRequest(
            run_id=run.run_id,
            step_id="agent",
            iteration=0,
            attempt=1,
            delivery=1,
            worker_id="w-first",
            with_first_record=True,
        )
        claimed = (await stub.Claim(first)).claimed
        token = claimed.token
        assert token.HasField("claim") and token.claim.worker_id == "w-first"
        assert not claimed.records and token.last_seq == 0
        assert await read_journal(engine, run.run_id) == [], "nothing stored yet"
        # A second holder of the same first delivery (a duplicate message)
        # claims the same way; whichever writes first holds the step.
        rival = (await stub.Claim(first)).claimed.token
        begun = await stub.BeginTool(first_tool_call(token))
        assert begun.run and not begun.token.HasField("claim"), "stored now"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RecordModel(jpb.RecordModelRequest(token=rival, position=0, response=b"{}"))
        assert isinstance(error_from_rpc(refused.value), Fenced)
        await stub.Commit(
            jpb.CommitRequest(
                token=begun.token,
                tool_result=jpb.ToolResult(intent_seq=begun.intent_seq, output=b'"ok"'),
                commit=jpb.Commit(action=jpb.ACTION_COMPLETE, output=b'"done"'),
            )
        )
        records = await read_journal(engine, run.run_id)
        assert [r.WhichOneof("kind") for r in records] == ["tool_intent", "commit"]
        assert records[0].leading_claim == jpb.Claim(delivery=1, worker_id="w-first")
        assert records[0].writer == token.writer, "nothing of the fenced rival was stored"
        check = await journal_check(engine, run.run_id)
        assert list(check.violations) == [] and check.records == 2


@pytest.mark.parametrize(
    "fields",
    [
        {"delivery": 2},  # a redelivery fences the deliveries before it
        {"attempt": 2},  # a retry fences the attempts before it
        {"delivery": 0},  # a delivery not known
        {"restart_limit": 1},  # the claim alone reaches the limit
        {"with_first_record": False},  # not asked (the bridge, older workers)
    ],
    ids=["redelivery", "retry", "unknown_delivery", "limit_1", "not_asked"],
)
async def test_a_claim_that_may_fence_or_count_is_stored_at_once(
    engine: EngineServer, fields: dict[str, Any]
) -> None:
    async with as_its_worker(engine, "ride2") as (run, stub):
        first: dict[str, Any] = {"attempt": 1, "delivery": 1, "with_first_record": True}
        request = jpb.ClaimRequest(run_id=run.run_id, step_id="agent", **(first | fields))
        answer = await stub.Claim(request)
        records = await read_journal(engine, run.run_id)
        assert records and records[0].WhichOneof("kind") == "claim"
        if fields == {"restart_limit": 1}:
            assert answer.settled.reason == "restart_limit"
        else:
            assert not answer.claimed.token.HasField("claim")
            assert answer.claimed.token.last_seq == records[0].seq


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"iteration": -1}, "iteration"),
        ({"attempt": 0}, "attempt"),
        ({"delivery": -1}, "delivery"),
        ({"restart_limit": 1001}, "restart_limit"),
        ({"step_id": "a.>"}, "step_id"),
        ({"worker_id": "w" * 257}, "worker_id"),
    ],
    ids=["iteration", "attempt", "delivery", "restart_limit", "step_id", "worker_id"],
)
async def test_a_claim_with_a_bad_number_or_id_is_refused_naming_it(
    engine: EngineServer, fields: dict[str, Any], named: str
) -> None:
    async with as_its_worker(engine, "badclaim") as (run, stub):
        first: dict[str, Any] = {"step_id": "agent", "attempt": 1, "delivery": 1}
        request = jpb.ClaimRequest(run_id=run.run_id, with_first_record=True, **(first | fields))
        assert await refused_field(stub.Claim(request)) == named
        assert await read_journal(engine, run.run_id) == [], "a refused claim stores nothing"


async def test_a_first_record_whose_claim_names_a_too_long_worker_is_refused(
    engine: EngineServer,
) -> None:
    # A claim that rides the first record is stored from the token the
    # worker sends back with it, worker id included: checked there too.
    async with as_its_worker(engine, "longworker") as (run, stub):
        claim = jpb.ClaimRequest(
            run_id=run.run_id, step_id="agent", attempt=1, delivery=1, with_first_record=True
        )
        token = (await stub.Claim(claim)).claimed.token
        assert token.HasField("claim")
        token.claim.worker_id = "w" * 257
        assert await refused_field(stub.BeginTool(first_tool_call(token))) == (
            "token.claim.worker_id"
        )
        assert await read_journal(engine, run.run_id) == [], "a refused call stores nothing"


async def task_of(engine: EngineServer, run: pb.Run) -> str:
    """The task type of the one step of ``run``'s workflow."""
    async with Client(engine.target) as client:
        (step,) = (await client.get_workflow(run.workflow)).steps
    return step.task


async def poll_once(engine: EngineServer, task: str, **fields: Any) -> pb.LeasedTask:
    """The task of type ``task`` a poll with ``fields`` leases."""
    async with grpc.aio.insecure_channel(engine.target) as channel:
        request = pb.PollTasksRequest(task_types=[task], **fields)
        request.wait.FromSeconds(10)
        (leased,) = (await pb_grpc.EngineServiceStub(channel).PollTasks(request)).tasks
    return leased


async def test_a_first_delivery_is_leased_with_its_journal_claimed(engine: EngineServer) -> None:
    # The claim with the lease: the engine's process serves the journal, so the poll that asks
    # gets the claim that rides the holder's first record, made at the lease.
    async with as_its_worker(engine, "leaseclaim") as (run, stub):
        task = await task_of(engine, run)
        leased = await poll_once(engine, task, claim_journal=True, worker_id="w-polled")
        assert leased.delivery == 1 and leased.HasField("journal_claim")
        token = leased.journal_claim.token
        assert token.claim == jpb.Claim(delivery=1, worker_id="w-polled")
        assert (token.run_id, token.iteration, token.attempt, token.last_seq) == (
            run.run_id,
            0,
            1,
            0,
        )
        assert await read_journal(engine, run.run_id) == [], "nothing stored by the lease"
        begun = await stub.BeginTool(first_tool_call(token))
        assert begun.run
        (intent,) = await read_journal(engine, run.run_id)
        assert intent.leading_claim == jpb.Claim(delivery=1, worker_id="w-polled")


async def test_a_poll_that_does_not_ask_or_a_redelivery_gets_no_claim(
    engine: EngineServer,
) -> None:
    async with as_its_worker(engine, "noclaim") as (run, _):
        task = await task_of(engine, run)
        unasked = await poll_once(engine, task, worker_id="w-old")
        assert unasked.delivery == 1 and not unasked.HasField("journal_claim")
        # Its lease runs out (FAST: 2 s) and the task comes again: a
        # redelivery's claim fences the deliveries before it, so it is stored
        # by the holder's own Claim, never made with the lease.
        again = await poll_once(engine, task, claim_journal=True, worker_id="w-new")
        assert again.delivery == 2 and not again.HasField("journal_claim")
        assert await read_journal(engine, run.run_id) == []


async def test_a_poll_with_a_bad_restart_limit_or_worker_id_is_refused_naming_it(
    engine: EngineServer,
) -> None:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        for fields, named in (
            ({"restart_limit": -1}, "restart_limit"),
            ({"restart_limit": 1001}, "restart_limit"),
            ({"worker_id": "w" * 257}, "worker_id"),
        ):
            request = pb.PollTasksRequest(task_types=["any"], claim_journal=True, **fields)
            assert await refused_field(stub.PollTasks(request)) == named


async def another_holder_writes(
    stub: jgrpc.JournalServiceAsyncStub, run: pb.Run, *, delivery: int
) -> None:
    """A holder of ``run``'s first dispatch, not the next poll's, claims it
    (stored) and writes its first turn's intent."""
    other = jpb.ClaimRequest(
        run_id=run.run_id, step_id="agent", attempt=1, delivery=delivery, worker_id="w-other"
    )
    token = (await stub.Claim(other)).claimed.token
    await stub.BeginTool(first_tool_call(token))


async def test_a_first_deliverys_claim_reads_nothing_and_a_record_there_fences_its_holder(
    engine: EngineServer,
) -> None:
    # The engine knows the run running and the task the first
    # delivery of its step's first dispatch, so the claim made with the lease
    # reads nothing: no holder came before. Were records there after all
    # (here another holder's claim and intent, written out of band), the
    # holder's first record, fenced on the empty tail, is refused: its unsafe
    # tool is not started, and nothing of it is stored.
    async with as_its_worker(engine, "leasewrites") as (run, stub):
        task = await task_of(engine, run)
        await another_holder_writes(stub, run, delivery=2)
        before = await read_journal(engine, run.run_id)
        leased = await poll_once(engine, task, claim_journal=True, worker_id="w-polled")
        assert leased.delivery == 1 and leased.HasField("journal_claim")
        assert leased.journal_claim.token.last_seq == 0, "the tail was not read"
        assert await read_journal(engine, run.run_id) == before, "the lease wrote to the journal"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.BeginTool(first_tool_call(leased.journal_claim.token))
        assert isinstance(error_from_rpc(refused.value), Fenced)
        assert await read_journal(engine, run.run_id) == before, "a fenced holder stored a record"


async def test_a_lease_on_a_guess_another_engine_wrote_over_claims_on_a_read(
    engine: EngineServer, nats_server: NatsServer
) -> None:
    # The engine leases on its own last write of the run; another engine
    # cancelled the run since, which this one heard (heard writes): the claim does
    # not take the guess for the run as stored, reads it, finds it ended and
    # claims nothing, so no handler starts on a cancelled run's claim.
    async with as_its_worker(engine, "leaseheard") as (run, _):
        task = await task_of(engine, run)
        nc = await jsx.connect(nats_server.url, name="dagnats-test-other-engine")
        try:
            other = await EngineStore.open(nc)
            stored = await other.require_run(run.run_id)
            stored.record.run.status = pb.RUN_STATUS_CANCELLED
            await other.update_run(stored.record, stored.revision)
        finally:
            await nc.close()
        await wait_for(lambda: not engine.engine.quiet(run.run_id), message="the write heard")
        leased = await poll_once(engine, task, claim_journal=True, worker_id="w-polled")
        assert leased.delivery == 1 and not leased.HasField("journal_claim")
        assert await read_journal(engine, run.run_id) == []


async def test_a_lease_of_a_dispatch_sent_again_claims_nothing_over_its_records(
    engine: EngineServer,
) -> None:
    # The reconciler found the task gone and dispatched it again (a new
    # message, delivered once); a holder of the first message may have
    # written: the claim reads, finds its records, and leaves the claim that
    # fences them to the new holder's own Claim.
    async with as_its_worker(engine, "leaseagain") as (run, stub):
        task = await task_of(engine, run)
        await another_holder_writes(stub, run, delivery=1)
        vanished = TaskVanished(step_id="agent", iteration=0, attempt=1)
        assert await engine.engine.apply(run.run_id, vanished) is not None
        before = await read_journal(engine, run.run_id)
        leased = await poll_once(engine, task, claim_journal=True, worker_id="w-polled")
        assert leased.delivery == 1 and not leased.HasField("journal_claim")
        assert await read_journal(engine, run.run_id) == before, "the lease wrote to the journal"
