"""The journal's Session stream: one dispatch's calls over one gRPC stream.

Raw stream tests drive ``JournalService.Session`` through the generated stub,
as a worker in another language would; the SDK tests drive ``JournalSession``,
which the Python worker uses for every journaled dispatch.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from dagnats.core.errors import Fenced, InvalidArgument
from dagnats.engine.server import EngineServer
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client
from dagnats.sdk._rpc import EngineRpc
from dagnats.sdk._session import JournalSession
from tests.stack import loop_workflow, unique
from tests.test_journal import journal_check, read_journal

Stream = grpc.aio.StreamStreamCall[jpb.SessionRequest, jpb.SessionResponse]


@pytest_asyncio.fixture(loop_scope="module")
async def journal(engine: EngineServer) -> AsyncIterator[jgrpc.JournalServiceAsyncStub]:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        yield jgrpc.JournalServiceStub(channel)


@pytest_asyncio.fixture(loop_scope="module")
async def rpc(engine: EngineServer) -> AsyncIterator[EngineRpc]:
    rpc = EngineRpc(engine.target, timeout=10.0)
    yield rpc
    await rpc.close()


async def queued_run(client: Client) -> str:
    """A run whose first task waits for a worker; the test acts as the worker."""
    task, name = unique("session"), unique("sessionwf")
    await client.register_workflow(loop_workflow(name, task))
    return (await client.start_run(name, "go")).run_id


def claim_of(run_id: str, worker: str = "w1") -> jpb.ClaimRequest:
    return jpb.ClaimRequest(
        run_id=run_id, step_id="agent", iteration=0, attempt=1, worker_id=worker
    )


async def ask(stream: Stream, request_id: int, **call: object) -> jpb.SessionResponse:
    await stream.write(jpb.SessionRequest(id=request_id, **call))  # type: ignore[arg-type]
    answer = await asyncio.wait_for(stream.read(), 10)
    assert isinstance(answer, jpb.SessionResponse)
    assert answer.id == request_id
    return answer


async def test_a_whole_dispatch_over_one_stream(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    run_id = await queued_run(client)
    stream = journal.Session(None)
    claimed = await ask(stream, 1, claim=claim_of(run_id))
    token = claimed.claim.claimed.token
    begin = await ask(stream, 2, begin_model=jpb.BeginModelRequest(token=token, position=0))
    assert begin.begin_model.recorded is False
    response = json.dumps({"tool": "send"}).encode()
    model = jpb.RecordModelRequest(token=token, position=0, response=response)
    token = (await ask(stream, 3, record_model=model)).record_model.token
    intent = jpb.BeginToolRequest(
        token=token, position=1, name="send", input=b'{"to":"ops"}', replay=jpb.REPLAY_UNSAFE
    )
    tool = (await ask(stream, 4, begin_tool=intent)).begin_tool
    assert tool.run is True
    finish = jpb.FinishToolRequest(token=tool.token, intent_seq=tool.intent_seq, output=b'"sent"')
    token = (await ask(stream, 5, finish_tool=finish)).finish_tool.token
    commit = jpb.CommitRequest(token=token, commit=jpb.Commit(action=jpb.ACTION_CONTINUE))
    committed = (await ask(stream, 6, commit=commit)).commit
    await stream.done_writing()
    assert await stream.read() is grpc.aio.EOF  # type: ignore[attr-defined]

    records = await read_journal(engine, run_id)
    kinds = [r.WhichOneof("kind") for r in records]
    assert kinds == ["claim", "model", "tool_intent", "tool_result", "commit"]
    assert records[1].model.response == response
    assert records[3].tool_result.output == b'"sent"'
    assert committed.commit_seq == records[-1].seq
    assert not (await journal_check(engine, run_id)).violations


async def test_an_error_answers_its_request_and_the_stream_goes_on(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    run_id = await queued_run(client)
    stream = journal.Session(None)
    token = (await ask(stream, 1, claim=claim_of(run_id))).claim.claimed.token

    bad = jpb.BeginToolRequest(token=token, position=0, name="send", input=b"{not json")
    refused = await ask(stream, 2, begin_tool=bad)
    assert refused.WhichOneof("result") == "error"
    assert refused.error.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (refused.error.code, refused.error.field) == ("invalid_argument", "input")

    nothing = await ask(stream, 3)  # a request that names no call
    assert (nothing.error.code, nothing.error.field) == ("invalid_argument", "call")

    good = jpb.BeginToolRequest(token=token, position=0, name="send", input=b"{}")
    assert (await ask(stream, 4, begin_tool=good)).begin_tool.run is True
    stream.cancel()
    kinds = [r.WhichOneof("kind") for r in await read_journal(engine, run_id)]
    assert kinds == ["claim", "tool_intent"]  # nothing written by the refused calls


async def test_a_fenced_writer_is_told_so_on_its_stream_and_writes_nothing(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    run_id = await queued_run(client)
    zombie, successor = journal.Session(None), journal.Session(None)
    stale = (await ask(zombie, 1, claim=claim_of(run_id, "zombie"))).claim.claimed.token
    await ask(successor, 1, claim=claim_of(run_id, "successor"))

    late = jpb.RecordModelRequest(token=stale, position=0, response=b'"late"')
    fenced = await ask(zombie, 2, record_model=late)
    assert fenced.error.status == grpc.StatusCode.ABORTED.value[0]
    assert fenced.error.code == "fenced"
    zombie.cancel()
    successor.cancel()
    records = await read_journal(engine, run_id)
    assert [r.claim.worker_id for r in records] == ["zombie", "successor"]


async def test_the_sdk_session_maps_answers_to_domain_errors(
    client: Client, engine: EngineServer, rpc: EngineRpc
) -> None:
    run_id = await queued_run(client)
    zombie, successor = JournalSession(rpc), JournalSession(rpc)
    stale = (await zombie.claim(claim_of(run_id, "zombie"))).claimed.token
    with pytest.raises(InvalidArgument) as invalid:
        await zombie.begin_tool(jpb.BeginToolRequest(token=stale, position=0, name=""))
    assert invalid.value.field == "name"
    await successor.claim(claim_of(run_id, "successor"))
    with pytest.raises(Fenced):
        await zombie.check_tail(jpb.CheckTailRequest(token=stale))
    zombie.close()
    successor.close()


async def test_a_call_that_lost_its_answer_goes_on_a_new_stream(
    client: Client, engine: EngineServer, rpc: EngineRpc
) -> None:
    run_id = await queued_run(client)
    session = JournalSession(rpc)
    token = (await session.claim(claim_of(run_id))).claimed.token

    # Cancelled while its answer is on the way: that answer must not be taken
    # for the next call's, so the stream is dropped.
    call = asyncio.ensure_future(session.check_tail(jpb.CheckTailRequest(token=token)))
    await asyncio.sleep(0)  # let the call write its request
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    model = jpb.RecordModelRequest(token=token, position=0, response=b'"answer"')
    token = (await session.record_model(model)).token

    # The stream breaks between calls (a proxy cut it, the server restarted):
    # the next call is tried again on a new one.
    broken = session._session
    assert broken is not None
    broken.cancel()
    await session.check_tail(jpb.CheckTailRequest(token=token))
    assert session._session is not broken
    session.close()
    kinds = [r.WhichOneof("kind") for r in await read_journal(engine, run_id)]
    assert kinds == ["claim", "model"]


async def test_a_stream_is_kept_for_the_next_dispatch(client: Client, rpc: EngineRpc) -> None:
    first, second = await queued_run(client), await queued_run(client)
    session = JournalSession(rpc)
    await session.claim(claim_of(first))
    used = session._session
    session.close()
    again = JournalSession(rpc)
    await again.claim(claim_of(second))
    assert again._session is used
    again.close()
