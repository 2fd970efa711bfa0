"""Errors over the wire: the one table of ``dagnats.core.grpcutil`` carries a
domain error's code, field and typed fields to the client, and the client
rebuilds the very error the service raised.

First every error of the table through the trailers of a unary call and
through a ``SessionError`` of the journal's Session stream, without a server;
then a fenced write against the real journal service, over a unary call, over
the Session stream and through the SDK's journal handle: each time the holder
learns which tail it expected and which one it found.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from dagnats.core import errors
from dagnats.core.grpcutil import (
    STATUS_OF,
    WireError,
    error_from_rpc,
    error_from_status,
    trailers,
    wire_status,
)
from dagnats.engine.server import EngineServer
from dagnats.journal import session
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, Fenced
from dagnats.sdk._journal import Journal
from dagnats.sdk._session import JournalSession
from dagnats.sdk.rpc import EngineRpc
from tests.test_journal_session import claim_of, queued_run


def example(cls: type[WireError]) -> WireError:
    if cls is errors.Fenced:
        return errors.Fenced("run1", "agent", expected=7, actual=9, detail="a successor wrote")
    if cls is errors.RunCancelled:
        return errors.RunCancelled("run1", "run run1 was cancelled: ü", step_id="agent")
    assert issubclass(cls, errors.DagnatsError)
    return cls(f"a {cls.__name__} happened: ü", field="token.writer")


def same(rebuilt: WireError, raised: WireError) -> None:
    assert type(rebuilt) is type(raised)
    assert rebuilt.message == raised.message
    assert rebuilt.field == raised.field
    if isinstance(raised, errors.Fenced):
        assert isinstance(rebuilt, errors.Fenced)
        assert (rebuilt.run_id, rebuilt.step_id) == (raised.run_id, raised.step_id)
        assert (rebuilt.expected, rebuilt.actual) == (raised.expected, raised.actual)
    if isinstance(raised, errors.RunCancelled):
        assert isinstance(rebuilt, errors.RunCancelled)
        assert (rebuilt.run_id, rebuilt.step_id) == (raised.run_id, raised.step_id)


@pytest.mark.parametrize("cls", list(STATUS_OF), ids=lambda c: c.__name__)
def test_every_error_comes_back_from_a_status_as_itself(cls: type[WireError]) -> None:
    raised = example(cls)
    status, message, _ = wire_status(raised)
    failed = grpc.aio.AioRpcError(
        status,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailers(raised)),
        details=message,
        debug_error_string="",
    )
    same(error_from_rpc(failed), raised)


@pytest.mark.parametrize("cls", list(STATUS_OF), ids=lambda c: c.__name__)
def test_every_error_comes_back_from_a_session_error_as_itself(cls: type[WireError]) -> None:
    raised = example(cls)
    status, _, _ = wire_status(raised)
    sent = session.failed(7, raised)  # what the journal's Session stream answers
    error = jpb.SessionResponse.FromString(sent.SerializeToString()).error
    rebuilt = error_from_status(status, error.message, error.code, error.field, error.details)
    same(rebuilt, raised)


@pytest_asyncio.fixture(loop_scope="module")
async def rpc(engine: EngineServer) -> AsyncIterator[EngineRpc]:
    rpc = EngineRpc(engine.target, timeout=10.0)
    yield rpc
    await rpc.close()


async def zombie_and_successor(
    client: Client, rpc: EngineRpc
) -> tuple[jpb.WriterToken, jpb.WriterToken]:
    """Two claims of one dispatch: the first holder's token, now behind, and
    its successor's."""
    run_id = await queued_run(client)
    zombie = (await rpc.claim(claim_of(run_id, "zombie"))).claimed.token
    successor = (await rpc.claim(claim_of(run_id, "successor"))).claimed.token
    assert successor.last_seq > zombie.last_seq
    return zombie, successor


def told(fenced: Fenced, zombie: jpb.WriterToken, successor: jpb.WriterToken) -> None:
    """The fenced holder learns whose step it was and where the tail went."""
    assert (fenced.run_id, fenced.step_id) == (zombie.run_id, zombie.step_id)
    assert fenced.expected == zombie.last_seq
    assert fenced.actual == successor.last_seq
    assert fenced.code == "fenced"


async def test_a_fenced_unary_write_carries_the_expected_and_actual_tail(
    client: Client, rpc: EngineRpc
) -> None:
    zombie, successor = await zombie_and_successor(client, rpc)
    late = jpb.RecordModelRequest(token=zombie, position=0, response=b'"late"')
    with pytest.raises(Fenced) as fenced:
        await rpc.record_model(late)
    told(fenced.value, zombie, successor)


async def test_a_fenced_write_on_the_session_stream_carries_the_expected_and_actual_tail(
    client: Client, rpc: EngineRpc
) -> None:
    zombie, successor = await zombie_and_successor(client, rpc)
    session = JournalSession(rpc)
    late = jpb.RecordModelRequest(token=zombie, position=0, response=b'"late"')
    with pytest.raises(Fenced) as fenced:
        await session.record_model(late)
    session.close()
    told(fenced.value, zombie, successor)


async def test_a_handle_fenced_by_its_successor_tells_the_handler_both_tails(
    client: Client, rpc: EngineRpc
) -> None:
    zombie, successor = await zombie_and_successor(client, rpc)
    journal = Journal(JournalSession(rpc), zombie)

    async def ask() -> str:
        return "an answer nobody records"

    with pytest.raises(Fenced) as fenced:
        await journal.model(ask)
    told(fenced.value, zombie, successor)
    assert journal.fenced
    with pytest.raises(Fenced):  # and it writes nothing more
        await journal.check_tail()
