"""Errors over the wire: the one table of ``dagnats.core.grpcutil`` carries a
domain error's code, field and typed fields to the client, and the client
rebuilds the very error the service raised.

First every error of the table through the trailers of a unary call, through
a ``SessionError`` of the journal's Session stream and through a
``LocalAnswer`` of the local socket, and the local transport's own failures
through the SDK's retry rules, without a server;
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
from dagnats.core.frames import TransportError
from dagnats.core.grpcutil import (
    STATUS_OF,
    WireError,
    error_from_rpc,
    error_from_status,
    trailers,
    wire_status,
)
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal import session
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, Credentials, Fenced
from dagnats.sdk._errors import answered_error
from dagnats.sdk._journal import Journal
from dagnats.sdk._rpc import RetryPolicy, _is_transient
from dagnats.sdk._session import JournalSession
from dagnats.sdk.rpc import EngineRpc
from tests.test_journal_session import claim_of, queued_run


def example(cls: type[WireError]) -> WireError:
    if cls is errors.Fenced:
        return errors.Fenced("run1", "agent", expected=7, actual=9, detail="a successor wrote")
    if cls is errors.RunCancelled:
        return errors.RunCancelled("run1", "run run1 was cancelled: ü", step_id="agent")
    if cls is errors.BudgetExceeded:
        return errors.BudgetExceeded(
            "run1",
            step_id="agent",
            tokens=30,
            cost_micros=4,
            budget_tokens=25,
            budget_cost_micros=9,
            detail="the run spent 30 tokens of a budget of 25: ü",
        )
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


@pytest.mark.parametrize("cls", list(STATUS_OF), ids=lambda c: c.__name__)
def test_every_error_comes_back_from_the_local_socket_as_itself(cls: type[WireError]) -> None:
    raised = example(cls)
    sent = pb.LocalAnswer(id=7, error=session.session_error(raised))  # what the socket answers
    same(answered_error(pb.LocalAnswer.FromString(sent.SerializeToString()).error), raised)


def test_a_local_transport_failure_is_retried_and_refused_as_the_same_grpc_status() -> None:
    """What the retry rules read of a ``TransportError`` is its status, as of
    a gRPC failure: UNAVAILABLE is tried again, DEADLINE_EXCEEDED only for a
    call safe to repeat, a refusal becomes the domain error (saying which
    credential was sent), UNIMPLEMENTED a service that is not there."""
    unavailable = TransportError(grpc.StatusCode.UNAVAILABLE, "the local socket closed")
    late = TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, "PollTasks: no answer")
    assert _is_transient(unavailable, idempotent=False)
    assert _is_transient(late, idempotent=True) and not _is_transient(late, idempotent=False)
    denied = TransportError(grpc.StatusCode.PERMISSION_DENIED, "a client may not poll")
    assert not _is_transient(denied, idempotent=True)
    rpc = EngineRpc("127.0.0.1:1", timeout=1.0, credentials=Credentials())
    refused = rpc._domain_error("PollTasks", denied)
    assert isinstance(refused, errors.PermissionDenied)
    assert refused.message.startswith("a client may not poll (sent no token")
    missing = rpc._domain_error("Commit", TransportError(grpc.StatusCode.UNIMPLEMENTED, ""))
    assert isinstance(missing, errors.Unavailable) and "does not serve Commit" in missing.message


async def test_a_call_whose_local_transport_fails_is_tried_again_until_it_answers() -> None:
    rpc = EngineRpc(
        "127.0.0.1:1",
        timeout=1.0,
        credentials=Credentials(),
        retry=RetryPolicy(budget=5.0, backoff=0.001, max_backoff=0.01),
    )
    tries: list[int] = []

    async def attempt() -> str:
        tries.append(len(tries))
        if len(tries) < 3:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "the local socket closed")
        return "answered"

    assert await rpc.retrying("CheckTail", attempt, idempotent=True) == "answered"
    assert len(tries) == 3

    async def refused() -> str:
        raise TransportError(grpc.StatusCode.UNAUTHENTICATED, "no token")

    with pytest.raises(errors.Unauthenticated):
        await rpc.retrying("CheckTail", refused, idempotent=True)


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
