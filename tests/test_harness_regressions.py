"""Regression tests for bugs the crash-point matrix and the chaos soak found,
each named after the bug. They drive the services directly, so each bug's
exact interleaving is reproduced every time rather than by chance."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any
from unittest import mock

import grpc
import grpc.aio
import nats.errors
import pytest
import pytest_asyncio
from nats.js.kv import KeyValue

from dagnats.core import jetstream as jsx
from dagnats.core import seam
from dagnats.core.errors import Fenced
from dagnats.core.grpcutil import error_from_rpc
from dagnats.engine.server import EngineServer
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client
from tests.helpers import wait_for
from tests.stack import loop_workflow, unique
from tests.test_journal import read_journal

STEER = 1


@pytest_asyncio.fixture(loop_scope="module")
async def journal(engine: EngineServer) -> AsyncIterator[jgrpc.JournalServiceAsyncStub]:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        yield jgrpc.JournalServiceStub(channel)


async def claimed_run(
    client: Client, journal: jgrpc.JournalServiceAsyncStub, *, ride: bool = False
) -> jpb.WriterToken:
    """A run whose iteration 0 is claimed by this test, acting as the worker;
    with ``ride``, by its first delivery, whose claim rides its first record."""
    task, name = unique("regress"), unique("regresswf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, "go")
    claim = await journal.Claim(
        jpb.ClaimRequest(
            run_id=run.run_id,
            step_id="agent",
            iteration=0,
            attempt=1,
            delivery=1 if ride else 0,
            may_ride=ride,
        )
    )
    return claim.claimed.token


async def test_place_inputs_retried_after_the_service_died_between_claim_and_record(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The journal service claims the input in the inputs bucket and dies before
    # it writes input.placed; the SDK retries the call with the same token. The
    # input was claimed by that very writer, and must now be recorded, not
    # skipped as "placed already" (it would read as done, never seen by a turn).
    token = await claimed_run(client, journal)
    await client.submit_input(token.run_id, "agent", "s1", {"steer": 1})

    async def die_once(name: str) -> None:
        if name == "after_input_claimed":
            seam.install(None)
            raise RuntimeError("the journal service died after claiming an input")

    seam.install(die_once)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await journal.PlaceInputs(jpb.PlaceInputsRequest(token=token, position=0, mode=STEER))
    finally:
        seam.install(None)
    retried = await journal.PlaceInputs(jpb.PlaceInputsRequest(token=token, position=0, mode=STEER))
    assert [p.request_id for p in retried.inputs] == ["s1"]
    records = await read_journal(engine, token.run_id)
    placed = [r.input_placed.request_id for r in records if r.HasField("input_placed")]
    assert placed == ["s1"]
    assert retried.token.last_seq == records[-1].seq


async def test_place_inputs_retried_after_a_lost_answer_returns_the_first_answer(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The first try recorded the input but its answer was lost; the retry, with
    # the same token, must answer the same, with a token past that record.
    # Answering "nothing placed" with the old token made the writer's next
    # record reuse the input record's Msg-Id, so that record was acknowledged as
    # written while the journal held the input in its place.
    token = await claimed_run(client, journal)
    await client.submit_input(token.run_id, "agent", "s1", {"steer": 1})
    request = jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
    first = await journal.PlaceInputs(request)
    retried = await journal.PlaceInputs(request)
    assert [p.request_id for p in retried.inputs] == [p.request_id for p in first.inputs]
    assert retried.token == first.token
    model = await journal.RecordModel(
        jpb.RecordModelRequest(token=retried.token, position=1, response=b'{"answer": "ok"}')
    )
    kinds = [r.WhichOneof("kind") for r in await read_journal(engine, token.run_id)]
    assert kinds == ["claim", "input_placed", "model"]
    assert model.token.last_seq > first.token.last_seq


def die_at_claim(number: int) -> seam.Hook:
    """A journal service that dies after claiming its ``number``-th input."""
    seen = [0]

    async def hook(name: str) -> None:
        if name == "after_input_claimed":
            seen[0] += 1
            if seen[0] == number:
                raise RuntimeError("the journal service died after claiming an input")

    return hook


async def test_place_inputs_retried_after_dying_between_two_inputs_places_both(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The first input was claimed and recorded, the second only claimed. The
    # retry answers both, in order, and records only the second.
    token = await claimed_run(client, journal)
    for request_id in ("s1", "s2"):
        await client.submit_input(token.run_id, "agent", request_id, {"steer": request_id})
    request = jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
    seam.install(die_at_claim(2))
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await journal.PlaceInputs(request)
    finally:
        seam.install(None)
    retried = await journal.PlaceInputs(request)
    assert [p.request_id for p in retried.inputs] == ["s1", "s2"]
    records = await read_journal(engine, token.run_id)
    assert [r.input_placed.request_id for r in records if r.HasField("input_placed")] == [
        "s1",
        "s2",
    ]
    assert retried.token.last_seq == records[-1].seq


async def test_a_redelivery_takes_over_an_input_its_predecessor_claimed_but_never_recorded(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The first holder recorded one input and died after claiming the next;
    # the redelivery replays the recorded one and places the other, which no
    # later iteration could take (a claim is reclaimed only in its iteration).
    token = await claimed_run(client, journal)
    for request_id in ("s1", "s2"):
        await client.submit_input(token.run_id, "agent", request_id, {"steer": request_id})
    seam.install(die_at_claim(2))
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await journal.PlaceInputs(jpb.PlaceInputsRequest(token=token, position=0, mode=STEER))
    finally:
        seam.install(None)
    again = await journal.Claim(
        jpb.ClaimRequest(run_id=token.run_id, step_id="agent", iteration=0, attempt=1)
    )
    successor = again.claimed.token
    replayed = await journal.PlaceInputs(
        jpb.PlaceInputsRequest(token=successor, position=0, mode=STEER)
    )
    assert [p.request_id for p in replayed.inputs] == ["s1", "s2"]
    records = await read_journal(engine, token.run_id)
    placed = [(r.input_placed.request_id, r.writer) for r in records if r.HasField("input_placed")]
    assert placed == [("s1", token.writer), ("s2", successor.writer)]


async def test_a_new_attempt_retrying_its_placement_carries_each_earlier_input_once(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # Attempt 2 carries attempt 1's input s1 into its own turn, claims s2 and
    # dies before recording it; its retry (same token) answers the carried
    # copy its first try wrote instead of carrying s1 a second time.
    token = await claimed_run(client, journal)
    await client.submit_input(token.run_id, "agent", "s1", {"steer": 1})
    await journal.PlaceInputs(jpb.PlaceInputsRequest(token=token, position=0, mode=STEER))
    await client.submit_input(token.run_id, "agent", "s2", {"steer": 2})
    retry = await journal.Claim(
        jpb.ClaimRequest(run_id=token.run_id, step_id="agent", iteration=0, attempt=2)
    )
    request = jpb.PlaceInputsRequest(token=retry.claimed.token, position=0, mode=STEER)
    seam.install(die_at_claim(1))
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await journal.PlaceInputs(request)
    finally:
        seam.install(None)
    answer = await journal.PlaceInputs(request)
    assert [(p.request_id, p.carried) for p in answer.inputs] == [("s1", True), ("s2", False)]
    records = await read_journal(engine, token.run_id)
    second = [r.input_placed for r in records if r.attempt == 2 and r.HasField("input_placed")]
    assert [(p.request_id, p.carried) for p in second] == [("s1", True), ("s2", False)]


async def test_place_inputs_by_a_holder_fenced_by_a_redelivery_writes_nothing(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The records after a writer's claim count as an earlier try of its own
    # call only if it wrote them: a stalled holder whose task was redelivered
    # finds its successor's records there, and is fenced, rather than moving
    # its token past them and placing inputs behind its successor.
    token = await claimed_run(client, journal)
    again = await journal.Claim(
        jpb.ClaimRequest(run_id=token.run_id, step_id="agent", iteration=0, attempt=1)
    )
    successor = again.claimed.token
    await journal.RecordModel(
        jpb.RecordModelRequest(token=successor, position=0, response=b'{"text": "hi"}')
    )
    await client.submit_input(token.run_id, "agent", "s1", {"steer": 1})
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await journal.PlaceInputs(jpb.PlaceInputsRequest(token=token, position=0, mode=STEER))
    assert isinstance(error_from_rpc(refused.value), Fenced)
    records = await read_journal(engine, token.run_id)
    assert [(r.writer, r.WhichOneof("kind")) for r in records] == [
        (token.writer, "claim"),
        (successor.writer, "claim"),
        (successor.writer, "model"),
    ]
    got = await client.get_input(token.run_id, "agent", "s1")
    assert got.status == ipb.STATUS_QUEUED


@contextlib.contextmanager
def first_input_update_loses_its_ack() -> Iterator[list[int]]:
    """The next update of the ``INPUTS`` bucket lands and then times out, as
    when the bucket's leader steps down between storing it and answering: the
    store's retry of that very update finds the revision moved on. Yields the
    revisions that landed without an answer."""
    real = KeyValue.update
    landed: list[int] = []

    async def update(self: KeyValue, key: str, value: bytes, last: Any = None, **kw: Any) -> int:
        revision = await real(self, key, value, last, **kw)
        if self._name == jsx.KV_INPUTS and not landed:
            landed.append(revision)
            raise nats.errors.TimeoutError
        return revision

    with mock.patch.object(KeyValue, "update", update):
        yield landed


async def test_place_inputs_whose_claim_landed_without_an_answer_records_the_input(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The claim of an input in the inputs bucket landed but its answer was
    # lost; the retried claim was refused (the revision had moved on) and the
    # input was skipped as "claimed by someone else": it stayed placed with no
    # input.placed record, and read done once its iteration committed (the
    # soak's "reads STATUS_DONE with 0 input.placed record(s)").
    token = await claimed_run(client, journal)
    await client.submit_input(token.run_id, "agent", "s1", {"steer": 1})
    with first_input_update_loses_its_ack() as landed:
        answer = await journal.PlaceInputs(
            jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
        )
    assert landed, "the fault was not injected"
    assert [p.request_id for p in answer.inputs] == ["s1"]
    records = await read_journal(engine, token.run_id)
    assert [r.input_placed.request_id for r in records if r.HasField("input_placed")] == ["s1"]
    assert answer.token.last_seq == records[-1].seq


async def test_a_fenced_writer_gives_back_an_input_it_claimed_but_never_recorded(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The chaos soak on a cluster: a holder's PlaceInputs is checked current,
    # then stalls inside the call (a stream electing its leader); meanwhile
    # its successor claims and places what is queued (nothing yet), and an
    # input arrives. The stalled call claims that input in the bucket and is
    # fenced at its record. Left claimed, the input read as done once the
    # successor's iteration committed, though no turn ever saw it.
    token = await claimed_run(client, journal)
    stalled, resume = asyncio.Event(), asyncio.Event()

    async def stall_once(name: str) -> None:
        if name == "before_inputs_listed":
            seam.install(None)
            stalled.set()
            await resume.wait()

    seam.install(stall_once)
    try:
        request = jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
        zombie = asyncio.ensure_future(journal.PlaceInputs(request))
        await wait_for(stalled.is_set)
        successor = await journal.Claim(
            jpb.ClaimRequest(run_id=token.run_id, step_id="agent", iteration=0, attempt=2)
        )
        mine = jpb.PlaceInputsRequest(token=successor.claimed.token, position=0, mode=STEER)
        assert list((await journal.PlaceInputs(mine)).inputs) == []
        await client.submit_input(token.run_id, "agent", "late", {"steer": 1})
        resume.set()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await zombie
        assert isinstance(error_from_rpc(refused.value), Fenced)
    finally:
        seam.install(None)
    late = await client.get_input(token.run_id, "agent", "late")
    assert late.status == ipb.STATUS_QUEUED, late
    records = await read_journal(engine, token.run_id)
    assert not [r for r in records if r.HasField("input_placed")]


async def test_a_placement_whose_caller_went_away_still_gives_back_its_claim(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # As above, but the stalled holder's caller gives up on the call (its
    # deadline, its lease) right after the input is claimed in the bucket, and
    # the gRPC server cancels the handler. Cancelled there, the placement wrote
    # neither the record nor the give-back.
    token = await claimed_run(client, journal)
    listed, resume_listing = asyncio.Event(), asyncio.Event()
    claimed, resume_claim = asyncio.Event(), asyncio.Event()

    async def stall(name: str) -> None:
        if name == "before_inputs_listed" and not listed.is_set():
            listed.set()
            await resume_listing.wait()
        elif name == "after_input_claimed" and not claimed.is_set():
            claimed.set()
            await resume_claim.wait()

    assert engine.journal is not None and engine.journal._placement is not None
    placement = engine.journal._placement
    seam.install(stall)
    try:
        request = jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
        handler = asyncio.create_task(placement.place(token, request))
        await wait_for(listed.is_set)
        successor = await journal.Claim(
            jpb.ClaimRequest(run_id=token.run_id, step_id="agent", iteration=0, attempt=2)
        )
        mine = jpb.PlaceInputsRequest(token=successor.claimed.token, position=0, mode=STEER)
        await client.submit_input(token.run_id, "agent", "late", {"steer": 1})
        resume_listing.set()
        await wait_for(claimed.is_set)
        handler.cancel()  # what the server does to a call whose caller went away
        with pytest.raises(asyncio.CancelledError):
            await handler
        resume_claim.set()

        async def queued() -> bool:
            late = await client.get_input(token.run_id, "agent", "late")
            return late.status == ipb.STATUS_QUEUED

        await wait_for(queued, message="the claim given back")
    finally:
        seam.install(None)
    placed = await journal.PlaceInputs(mine)
    assert [p.request_id for p in placed.inputs] == ["late"]


async def test_a_late_copy_of_a_placement_after_its_writer_committed_places_nothing(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # A placement answered, and its writer committed; then a late copy of the
    # same call reads the journal, with the token it was sent with: a try whose
    # caller went away (its session broke, its deadline passed) runs to its end
    # on the service, after the retry that answered. The writer's own records
    # after that token are not all an earlier try of this call: its commit
    # ended the iteration. Taken for a retry, the copy moved its token past the
    # commit and placed an input queued since into the ended iteration, where
    # no turn reads it (the chaos soak's lost input), and stored the claim the
    # token still carried after the commit.
    token = await claimed_run(client, journal, ride=True)
    assert token.HasField("claim")  # it rides the first placement
    run_id = token.run_id
    await client.submit_input(run_id, "agent", "s1", {"steer": 1})
    request = jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
    placed = await journal.PlaceInputs(request)
    assert [p.request_id for p in placed.inputs] == ["s1"]
    committed = await journal.Commit(
        jpb.CommitRequest(token=placed.token, commit=jpb.Commit(action=jpb.ACTION_CONTINUE))
    )
    await client.submit_input(run_id, "agent", "s2", {"steer": 2})
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await journal.PlaceInputs(request)
    assert isinstance(error_from_rpc(refused.value), Fenced)
    records = await read_journal(engine, run_id)
    assert [r.seq for r in records if r.seq > committed.commit_seq] == []
    got = await client.get_input(run_id, "agent", "s2")
    assert got.status == ipb.STATUS_QUEUED


async def test_a_placement_retried_after_a_lost_answer_stores_its_riding_claim_once(
    client: Client, engine: EngineServer, journal: jgrpc.JournalServiceAsyncStub
) -> None:
    # The claim rode the first try's input record; the retry's token goes on
    # after that record, so it carries the claim no more: the writer's next
    # record would store it a second time, a claim after the step's progress.
    token = await claimed_run(client, journal, ride=True)
    await client.submit_input(token.run_id, "agent", "s1", {"steer": 1})
    request = jpb.PlaceInputsRequest(token=token, position=0, mode=STEER)
    await journal.PlaceInputs(request)
    retried = await journal.PlaceInputs(request)
    await journal.RecordModel(
        jpb.RecordModelRequest(token=retried.token, position=1, response=b'{"answer": "ok"}')
    )
    records = await read_journal(engine, token.run_id)
    assert [r.HasField("leading_claim") for r in records] == [True, False]
