"""The inputs service on a real nats-server, over gRPC and the NATS endpoints:
idempotent submits, withdraw, get with wait, list, finished steps and bad input."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

import grpc.aio
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration
from nats.aio.client import Client as NATS

from dagnats.core import errors
from dagnats.core import jetstream as jsx
from dagnats.core.grpcutil import WireError, error_from_rpc
from dagnats.core.subjects import history_subject
from dagnats.engine.runs import Runs
from dagnats.engine.server import EngineServer
from dagnats.engine.store import EngineStore
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.engine.v1 import internal_pb2 as eipb
from dagnats.inputs import natsapi, rules
from dagnats.inputs.rules import InputState, StepProgress, StepStatus
from dagnats.inputs.store import InputStore, close_step_inputs
from dagnats.inputs.v1 import inputs_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2_grpc as pb_grpc
from dagnats.journal.store import JournalStore
from dagnats.sdk import Client
from tests.helpers import wait_for
from tests.stack import loop_workflow, steps_by_id, unique

STEP = "agent"
UNKNOWN_RUN = "f" * 32


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(engine: EngineServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        yield pb_grpc.InputsServiceStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nc(nats_server: Any) -> AsyncIterator[NATS]:
    conn = await jsx.connect(nats_server.url, name="test-inputs")
    yield conn
    await conn.drain()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(nc: NATS) -> InputStore:
    return await InputStore.open(nc, Runs(await EngineStore.open(nc), JournalStore(nc)))


async def running_step(client: Client) -> str:
    """A run whose agent step is RUNNING at iteration 0: no worker takes its task."""
    task, name = unique("itask"), unique("iwf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, {"ask": "x"})

    async def step_running() -> bool:
        step = steps_by_id(await client.get_run(run.run_id))[STEP]
        return bool(step.status == epb.STEP_STATUS_RUNNING)

    await wait_for(step_running, message="agent step running")
    return run.run_id


def submit_request(
    run_id: str,
    request_id: str = "msg-1",
    content: Any = None,
    *,
    mode: pb.Mode.ValueType = pb.MODE_STEER,
    step_id: str = STEP,
    raw: bytes | None = None,
) -> pb.SubmitRequest:
    body = raw if raw is not None else json.dumps(content or {"text": "hi"}).encode()
    return pb.SubmitRequest(
        run_id=run_id, step_id=step_id, request_id=request_id, mode=mode, content=body
    )


async def submit(stub: Any, run_id: str, request_id: str = "msg-1", **kw: Any) -> Any:
    return await stub.Submit(submit_request(run_id, request_id, **kw))


async def get(stub: Any, run_id: str, request_id: str, **kw: Any) -> pb.Input:
    response = await stub.Get(
        pb.GetRequest(run_id=run_id, step_id=STEP, request_id=request_id, **kw)
    )
    return response.input


async def listed(stub: Any, run_id: str, **kw: Any) -> list[pb.Input]:
    response = await stub.List(pb.ListRequest(run_id=run_id, step_id=STEP, **kw))
    return list(response.inputs)


async def refused(call: Any) -> WireError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return error_from_rpc(caught.value)


def seconds(value: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(value * 1e9))
    return d


# ---- idempotency ------------------------------------------------------------------------


async def test_concurrent_repeats_create_exactly_one_input(
    client: Client, stub: Any, nc: NATS
) -> None:
    run_id = await running_step(client)
    responses = await asyncio.gather(*(submit(stub, run_id, "same") for _ in range(20)))
    assert sum(r.created for r in responses) == 1
    first = next(r.input for r in responses if r.created)
    assert all(r.input == first for r in responses)
    assert first.status == pb.STATUS_QUEUED
    assert [i.request_id for i in await listed(stub, run_id)] == ["same"]
    # One wake-up event for the step, however many repeats.
    events = [e for e in await history(nc, run_id) if e.WhichOneof("kind") == "input"]
    assert [(e.step_id, e.input.request_id) for e in events] == [(STEP, "same")]


async def history(nc: NATS, run_id: str) -> list[eipb.HistoryEvent]:
    js = nc.jetstream()
    sub = await js.subscribe(history_subject(run_id), stream=jsx.HISTORY, ordered_consumer=True)
    try:
        last = await js.get_last_msg(jsx.HISTORY, history_subject(run_id))
        events = []
        while True:
            msg = await sub.next_msg(timeout=10)
            events.append(eipb.HistoryEvent.FromString(msg.data))
            if msg.metadata.sequence.stream >= (last.seq or 0):
                return events
    finally:
        await sub.unsubscribe()


async def test_a_repeat_with_other_content_returns_the_original(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    original = await submit(stub, run_id, "msg", content={"text": "first"})
    repeat = await submit(stub, run_id, "msg", content={"text": "second"}, mode=pb.MODE_FOLLOW_UP)
    assert original.created and not repeat.created
    assert repeat.input == original.input
    assert json.loads(repeat.input.content) == {"text": "first"}
    assert repeat.input.mode == pb.MODE_STEER


async def test_a_retried_create_is_recognised_by_its_nonce(
    client: Client, store: InputStore
) -> None:
    # KV create has no Msg-Id: a retry whose first attempt landed fails like a
    # lost race. The nonce in the value tells the two apart.
    run_id = await running_step(client)
    submission = rules.check_submission(run_id, STEP, "nonce", rules.Mode.STEER, b"{}")
    mine = rules.new_input(submission, created_by="a" * 16, now=time.time())
    assert await store.create(mine) == (mine, True)
    assert await store.create(mine) == (mine, True)
    theirs = rules.new_input(submission, created_by="b" * 16, now=time.time())
    assert await store.create(theirs) == (mine, False)


# ---- withdraw -------------------------------------------------------------------------


async def test_withdraw_before_placement(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "w")
    names = {"run_id": run_id, "step_id": STEP, "request_id": "w"}
    first = await stub.Withdraw(pb.WithdrawRequest(**names))
    again = await stub.Withdraw(pb.WithdrawRequest(**names))
    assert first.input.status == again.input.status == pb.STATUS_WITHDRAWN
    assert first.input == again.input
    assert (await get(stub, run_id, "w")).status == pb.STATUS_WITHDRAWN


async def test_a_placed_input_cannot_be_withdrawn(
    client: Client, stub: Any, store: InputStore
) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "p")
    stored = await store.get(run_id, STEP, "p")
    assert stored is not None
    placed = rules.place(stored[0], iteration=0, attempt=1, writer="0" * 16, now=time.time())
    assert isinstance(placed, InputState)
    await store.update(placed, stored[1])
    withdraw = stub.Withdraw(pb.WithdrawRequest(run_id=run_id, step_id=STEP, request_id="p"))
    err = await refused(withdraw)
    assert isinstance(err, errors.Conflict)
    assert err.message == "input was placed into iteration 0; it cannot be withdrawn"
    assert (await get(stub, run_id, "p")).status == pb.STATUS_PLACED


# ---- get with wait ----------------------------------------------------------------------


async def test_get_returns_when_the_status_changes(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "g")
    started = time.monotonic()
    waiting = asyncio.create_task(
        get(stub, run_id, "g", wait=seconds(20), if_status=pb.STATUS_QUEUED)
    )
    await stub.Withdraw(pb.WithdrawRequest(run_id=run_id, step_id=STEP, request_id="g"))
    seen = await waiting
    assert seen.status == pb.STATUS_WITHDRAWN
    assert time.monotonic() - started < 10


async def test_get_without_if_status_waits_for_a_change(
    client: Client, stub: Any, nc: NATS
) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "g0")
    started = time.monotonic()
    waiting = asyncio.create_task(get(stub, run_id, "g0", wait=seconds(20)))
    # Change the input only once the Get watches it (its consumer exists);
    # a change before that would be the status it starts from.
    await wait_for(lambda: watched(nc, rules.key(run_id, STEP, "g0")), message="get watching")
    await stub.Withdraw(pb.WithdrawRequest(run_id=run_id, step_id=STEP, request_id="g0"))
    assert (await waiting).status == pb.STATUS_WITHDRAWN
    assert time.monotonic() - started < 10


async def watched(nc: NATS, key: str) -> bool:
    infos = await nc.jetstream().consumers_info(f"KV_{jsx.KV_INPUTS}")
    return any(i.config.filter_subject == f"$KV.{jsx.KV_INPUTS}.{key}" for i in infos)


async def test_get_returns_at_the_deadline_when_nothing_changes(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "d")
    started = time.monotonic()
    seen = await get(stub, run_id, "d", wait=seconds(0.3))
    assert seen.status == pb.STATUS_QUEUED
    assert time.monotonic() - started >= 0.3
    changed = await get(stub, run_id, "d", wait=seconds(0.3), if_status=pb.STATUS_PLACED)
    assert changed.status == pb.STATUS_QUEUED  # already differs: no wait


async def test_get_errors(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    err = await refused(get(stub, run_id, "nobody"))
    assert isinstance(err, errors.NotFound) and err.field == "request_id"
    err = await refused(get(stub, run_id, "nobody", wait=seconds(0.2)))
    assert isinstance(err, errors.NotFound) and err.field == "request_id"
    err = await refused(get(stub, run_id, "x", wait=seconds(61)))
    assert isinstance(err, errors.InvalidArgument) and err.field == "wait"
    assert "60" in err.message


async def test_store_wait_change_sees_a_stored_change(
    client: Client, stub: Any, store: InputStore
) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "s")
    same = await store.wait_change(run_id, STEP, "s", rules.Status.QUEUED, 0.2)
    assert same is not None and same.status is rules.Status.QUEUED
    waiting = asyncio.create_task(store.wait_change(run_id, STEP, "s", rules.Status.QUEUED, 20))
    await stub.Withdraw(pb.WithdrawRequest(run_id=run_id, step_id=STEP, request_id="s"))
    changed = await waiting
    assert changed is not None and changed.status is rules.Status.WITHDRAWN


# ---- list ---------------------------------------------------------------------------------


async def test_list_filters_by_status_and_mode(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "a")
    await submit(stub, run_id, "b", mode=pb.MODE_FOLLOW_UP)
    await submit(stub, run_id, "c")
    await stub.Withdraw(pb.WithdrawRequest(run_id=run_id, step_id=STEP, request_id="a"))

    def ids(inputs: list[pb.Input]) -> list[str]:
        return [i.request_id for i in inputs]

    assert ids(await listed(stub, run_id)) == ["a", "b", "c"]
    assert ids(await listed(stub, run_id, status=pb.STATUS_WITHDRAWN)) == ["a"]
    assert ids(await listed(stub, run_id, status=pb.STATUS_QUEUED)) == ["b", "c"]
    assert ids(await listed(stub, run_id, mode=pb.MODE_FOLLOW_UP)) == ["b"]
    assert ids(await listed(stub, run_id, mode=pb.MODE_STEER, status=pb.STATUS_QUEUED)) == ["c"]
    assert ids(await listed(stub, run_id, status=pb.STATUS_DONE)) == []


# ---- finished steps -----------------------------------------------------------------------


async def test_a_finished_step_takes_no_inputs(
    client: Client, stub: Any, store: InputStore
) -> None:
    run_id = await running_step(client)
    await submit(stub, run_id, "early")
    await client.cancel_run(run_id)

    async def cancelled() -> bool:
        return bool((await client.get_run(run_id)).status == epb.RUN_STATUS_CANCELLED)

    await wait_for(cancelled, message="run cancelled")
    err = await refused(submit(stub, run_id, "late"))
    assert isinstance(err, errors.Conflict)
    assert err.message == f"step {STEP} of run {run_id} has finished; it takes no more inputs"
    assert [i.request_id for i in await listed(stub, run_id)] == ["early"]

    cancelled_step = StepProgress(status=StepStatus.CANCELLED, committed=0)
    changed = await close_step_inputs(store, run_id, STEP, cancelled_step, time.time())
    assert changed in (0, 1)  # 0 when the engine closed it first
    assert (await get(stub, run_id, "early")).status == pb.STATUS_UNANSWERED
    assert await close_step_inputs(store, run_id, STEP, cancelled_step, time.time()) == 0
    # A retry of the accepted submission still gets the original back.
    repeat = await submit(stub, run_id, "early")
    assert not repeat.created and repeat.input.status == pb.STATUS_UNANSWERED


async def test_a_retry_closes_an_input_its_first_try_left_queued_on_a_finished_step(
    client: Client, stub: Any, store: InputStore
) -> None:
    # The first try created the input after the step finished and stopped
    # before it checked the run again; the engine had closed the step's inputs
    # before the input existed. The client's retry must not leave it queued.
    run_id = await running_step(client)
    await client.cancel_run(run_id)

    async def closed() -> bool:
        return bool((await client.get_run(run_id)).status == epb.RUN_STATUS_CANCELLED)

    await wait_for(closed, message="run cancelled")
    submission = rules.check_submission(run_id, STEP, "orphan", rules.Mode.STEER, b"{}")
    first_try = rules.new_input(submission, created_by="c" * 16, now=time.time())
    assert await store.create(first_try) == (first_try, True)
    repeat = await submit(stub, run_id, "orphan")
    assert not repeat.created and repeat.input.status == pb.STATUS_UNANSWERED
    assert (await get(stub, run_id, "orphan")).status == pb.STATUS_UNANSWERED


async def test_an_input_created_while_its_step_finished_is_closed_and_refused(
    client: Client, stub: Any
) -> None:
    # The submission found the step running; the run was cancelled before the
    # input was created, and the engine's close of the step's inputs ran
    # before the input existed. The check after the create must catch it: a
    # queued input on a finished step would never be placed or closed.
    run_id = await running_step(client)
    created = InputStore.create

    async def cancel_then_create(self: InputStore, state: InputState) -> Any:
        await client.cancel_run(run_id)

        async def cancelled() -> bool:
            run = await self.load_run(run_id)
            return run is not None and run.status == epb.RUN_STATUS_CANCELLED

        await wait_for(cancelled, message="run cancelled")
        return await created(self, state)

    with mock.patch.object(InputStore, "create", cancel_then_create):
        err = await refused(submit(stub, run_id, "late"))
    assert isinstance(err, errors.Conflict)
    assert (await get(stub, run_id, "late")).status == pb.STATUS_UNANSWERED


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "kind", "field"),
    [
        ({"run_id": UNKNOWN_RUN}, errors.NotFound, "run_id"),
        ({"run_id": "not-a-run"}, errors.InvalidArgument, "run_id"),
        ({"step_id": "nostep"}, errors.NotFound, "step_id"),
        ({"step_id": "a.b"}, errors.InvalidArgument, "step_id"),
        ({"mode": pb.MODE_UNSPECIFIED}, errors.InvalidArgument, "mode"),
        ({"mode": 9}, errors.InvalidArgument, "mode"),
        ({"raw": b'"' + b"x" * 69998 + b'"'}, errors.InvalidArgument, "content"),
        ({"raw": b"{not json"}, errors.InvalidArgument, "content"),
        ({"raw": b""}, errors.InvalidArgument, "content"),
        ({"request_id": ""}, errors.InvalidArgument, "request_id"),
        ({"request_id": "r" * 257}, errors.InvalidArgument, "request_id"),
    ],
)
async def test_bad_submissions_name_the_field_and_store_nothing(
    client: Client,
    stub: Any,
    store: InputStore,
    change: dict[str, Any],
    kind: type[errors.DagnatsError],
    field: str,
) -> None:
    run_id = await running_step(client)
    fields: dict[str, Any] = {"run_id": run_id, "request_id": "bad", **change}
    err = await refused(stub.Submit(submit_request(**fields)))
    assert type(err) is kind
    assert err.field == field
    assert await listed(stub, run_id) == []
    if fields["run_id"] == UNKNOWN_RUN:
        assert await store.list(UNKNOWN_RUN, STEP) == []


async def test_listing_the_inputs_of_an_unknown_run_or_step_is_not_found(
    client: Client, stub: Any
) -> None:
    run_id = await running_step(client)
    for run, step, field in ((UNKNOWN_RUN, STEP, "run_id"), (run_id, "nostep", "step_id")):
        err = await refused(stub.List(pb.ListRequest(run_id=run, step_id=step)))
        assert isinstance(err, errors.NotFound) and err.field == field
    assert await listed(stub, run_id) == []


async def test_oversized_content_says_how_big(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    err = await refused(submit(stub, run_id, raw=b'"' + b"x" * 69998 + b'"'))
    assert err.message == "content is 70000 bytes; the limit is 65536"


async def test_any_request_id_round_trips(client: Client, stub: Any) -> None:
    run_id = await running_step(client)
    odd = "a.b.. c * > .>*. ü"
    created = await submit(stub, run_id, odd)
    assert created.created and created.input.request_id == odd
    assert (await get(stub, run_id, odd)).request_id == odd
    assert [i.request_id for i in await listed(stub, run_id)] == [odd]
    # The id never acts as a wildcard: a neighbour with a prefix of it is distinct.
    other = await submit(stub, run_id, "a.b")
    assert other.created
    withdrawn = await stub.Withdraw(pb.WithdrawRequest(run_id=run_id, step_id=STEP, request_id=odd))
    assert withdrawn.input.request_id == odd
    assert (await get(stub, run_id, "a.b")).status == pb.STATUS_QUEUED


# ---- NATS endpoints -------------------------------------------------------------------------


async def nats_call(nc: NATS, subject: str, request: Any) -> Any:
    return await nc.request(subject, request.SerializeToString(), timeout=30)


async def test_nats_endpoints_answer_like_grpc(client: Client, nc: NATS, stub: Any) -> None:
    run_id = await running_step(client)
    msg = await nats_call(nc, natsapi.SUBMIT, submit_request(run_id, "n"))
    assert not (msg.headers or {}).get(natsapi.ERROR_HEADER)
    first = pb.SubmitResponse.FromString(msg.data)
    again = pb.SubmitResponse.FromString(
        (await nats_call(nc, natsapi.SUBMIT, submit_request(run_id, "n", {"other": 1}))).data
    )
    assert first.created and not again.created and again.input == first.input
    assert first.input == (await get(stub, run_id, "n"))

    names: dict[str, Any] = {"run_id": run_id, "step_id": STEP, "request_id": "n"}
    waiting = asyncio.create_task(
        nats_call(
            nc, natsapi.GET, pb.GetRequest(**names, wait=seconds(20), if_status=pb.STATUS_QUEUED)
        )
    )
    withdrawn = pb.WithdrawResponse.FromString(
        (await nats_call(nc, natsapi.WITHDRAW, pb.WithdrawRequest(**names))).data
    )
    assert withdrawn.input.status == pb.STATUS_WITHDRAWN
    seen = pb.GetResponse.FromString((await waiting).data)
    assert seen.input.status == pb.STATUS_WITHDRAWN
    got = pb.GetResponse.FromString((await nats_call(nc, natsapi.GET, pb.GetRequest(**names))).data)
    assert got.input == withdrawn.input


async def test_nats_errors_carry_a_json_body_and_a_header(client: Client, nc: NATS) -> None:
    run_id = await running_step(client)
    msg = await nats_call(nc, natsapi.SUBMIT, submit_request(run_id, "e", step_id="a.b"))
    assert (msg.headers or {})[natsapi.ERROR_HEADER] == "invalid_argument"
    body = json.loads(msg.data)
    assert body["code"] == "invalid_argument" and body["field"] == "step_id"
    assert "step_id" in body["message"]

    names: dict[str, Any] = {"run_id": run_id, "step_id": STEP, "request_id": "missing"}
    msg = await nats_call(nc, natsapi.GET, pb.GetRequest(**names))
    assert msg.headers[natsapi.ERROR_HEADER] == "not_found"
    assert json.loads(msg.data)["field"] == "request_id"

    msg = await nc.request(natsapi.WITHDRAW, b"\xff\xff not protobuf", timeout=10)
    assert (msg.headers or {})[natsapi.ERROR_HEADER] == "invalid_argument"
    assert json.loads(msg.data)["field"] == "request"
