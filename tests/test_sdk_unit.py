"""SDK behaviour that needs no engine: public surface, errors, JSON, transport retries.

The gRPC server here stands in only for the network: it answers with scripted
statuses so that the SDK's retry and error mapping can be checked on a real
channel. Engine behaviour is tested against the real engine elsewhere.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
import nats.errors
import pytest

import dagnats.core.errors as core_errors
import dagnats.sdk
from dagnats.core.grpcutil import domain_errors
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc
from dagnats.sdk import (
    Client,
    DagnatsError,
    DeadlineExceeded,
    InvalidArgument,
    PermanentError,
    RunCancelled,
    TaskAlreadySettled,
    TaskContext,
    Unavailable,
    Worker,
    run_output,
)
from dagnats.sdk._rpc import EngineRpc, Lease, RetryPolicy
from dagnats.sdk.testing import ScriptedModel, ScriptExhausted

FAST_RETRY = RetryPolicy(budget=0.3, backoff=0.001, max_backoff=0.005)


# Public surface.


def test_public_names_are_exactly_the_documented_ones() -> None:
    assert set(dagnats.sdk.__all__) == {
        "ApprovalPending",
        "Budget",
        "BudgetExceeded",
        "Client",
        "Committed",
        "ConcurrentJournalUse",
        "Conflict",
        "Credentials",
        "DagnatsError",
        "DeadlineExceeded",
        "Fenced",
        "Handler",
        "InputMode",
        "InputsQueued",
        "InvalidArgument",
        "Journal",
        "JournalClient",
        "JournalSignal",
        "NotFound",
        "PermanentError",
        "PermissionDenied",
        "PlacedInput",
        "Replay",
        "ReplayMismatch",
        "RestartLimit",
        "RunCancelled",
        "RunFailed",
        "Stale",
        "TaskAlreadySettled",
        "TaskContext",
        "TokenStream",
        "ToolCall",
        "ToolResult",
        "ToolRun",
        "Unauthenticated",
        "Unavailable",
        "Usage",
        "WithUsage",
        "Worker",
        "run_output",
    }
    assert len(dagnats.sdk.__all__) == len(set(dagnats.sdk.__all__))
    for name in dagnats.sdk.__all__:
        assert getattr(dagnats.sdk, name) is not None


def test_testing_module_exports() -> None:
    import dagnats.sdk.testing as testing

    assert set(testing.__all__) == {
        "Deployment",
        "Divergence",
        "LocalStack",
        "ReplayReport",
        "ScriptedModel",
        "ScriptExhausted",
        "replay",
    }


# Errors.


def test_run_cancelled_is_not_an_exception() -> None:
    assert issubclass(RunCancelled, BaseException)
    assert not issubclass(RunCancelled, Exception)
    with pytest.raises(RunCancelled) as caught:
        try:
            raise RunCancelled("ab" * 16)
        except Exception:  # what careless handler code does
            pytest.fail("except Exception swallowed RunCancelled")
    assert caught.value.run_id == "ab" * 16


def test_error_hierarchy() -> None:
    for name in ("InvalidArgument", "NotFound", "Conflict", "Unavailable", "DeadlineExceeded"):
        assert getattr(dagnats.sdk, name) is getattr(core_errors, name)
        assert issubclass(getattr(dagnats.sdk, name), DagnatsError)
    assert DagnatsError is core_errors.DagnatsError
    assert issubclass(TaskAlreadySettled, DagnatsError)
    assert issubclass(PermanentError, Exception)
    assert not issubclass(PermanentError, DagnatsError)

    err = PermanentError("bad input", reason="bad_input")
    assert (err.message, err.reason) == ("bad input", "bad_input")
    settled = TaskAlreadySettled(run_id="r", step_id="s", settled_as="complete")
    assert (settled.run_id, settled.step_id, settled.settled_as) == ("r", "s", "complete")


# ScriptedModel.


async def test_scripted_model_answers_in_order_and_counts_requests() -> None:
    model = ScriptedModel([{"text": "one"}, {"text": "two"}])

    first = await model({"messages": ["hi"]})
    first["text"] = "changed by the caller"
    second = await model({"messages": ["hi", "again"]})

    assert second == {"text": "two"}
    assert model.calls == 2
    assert model.requests == [{"messages": ["hi"]}, {"messages": ["hi", "again"]}]


async def test_scripted_model_copies_responses_and_requests() -> None:
    response = {"text": "one", "tool_calls": []}
    model = ScriptedModel([response])
    request: dict[str, Any] = {"messages": ["hi"]}

    answer = await model(request)
    answer["tool_calls"].append("x")
    request["messages"].append("mutated later")

    assert response == {"text": "one", "tool_calls": []}
    assert model.requests == [{"messages": ["hi"]}]


async def test_scripted_model_raises_when_the_script_runs_out() -> None:
    model = ScriptedModel(["only"])
    await model("first")

    with pytest.raises(ScriptExhausted) as caught:
        await model("second")

    assert isinstance(caught.value, AssertionError)
    assert caught.value.request == "second"
    assert model.calls == 2


async def test_scripted_model_raises_a_scripted_exception() -> None:
    model = ScriptedModel([TimeoutError("model timed out"), "ok"])

    with pytest.raises(TimeoutError):
        await model("first")

    assert await model("second") == "ok"
    assert model.calls == 2


# A server that stands in for the network.


class ScriptedStatuses(engine_pb2_grpc.EngineServiceServicer):
    """Counts calls per method and answers with scripted failures first."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        # method -> statuses answered once each, in order, before answering OK
        self.script: dict[str, list[grpc.StatusCode]] = {}
        # method -> status answered on every call
        self.always: dict[str, grpc.StatusCode] = {}
        # method -> trailing metadata sent with a failure
        self.metadata: dict[str, tuple[tuple[str, str], ...]] = {}
        self.run_status: pb.RunStatus.ValueType = pb.RUN_STATUS_COMPLETED

    async def _answer(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any], response: Any
    ) -> Any:
        self.calls[method] += 1
        script = self.script.get(method)
        code = self.always.get(method) or (script.pop(0) if script else None)
        if code is not None:
            context.set_trailing_metadata(self.metadata.get(method, ()))
            await context.abort(code, f"scripted {code.name}")
        return response

    async def GetRun(self, request: pb.GetRunRequest, context: Any) -> pb.GetRunResponse:
        run = pb.Run(run_id=request.run_id, status=self.run_status, output=b'{"a":1}')
        return await self._answer("GetRun", context, pb.GetRunResponse(run=run))

    async def WatchRun(self, request: pb.WatchRunRequest, context: Any) -> AsyncIterator[Any]:
        run = pb.Run(run_id=request.run_id, status=self.run_status, output=b'{"a":1}')
        yield await self._answer("WatchRun", context, pb.WatchRunResponse(run=run, revision=1))
        await asyncio.Event().wait()  # a run that never changes again

    async def CancelRun(self, request: pb.CancelRunRequest, context: Any) -> pb.CancelRunResponse:
        return await self._answer("CancelRun", context, pb.CancelRunResponse())

    async def StartRun(self, request: pb.StartRunRequest, context: Any) -> pb.StartRunResponse:
        return await self._answer("StartRun", context, pb.StartRunResponse())

    async def PollTasks(self, request: pb.PollTasksRequest, context: Any) -> pb.PollTasksResponse:
        return await self._answer("PollTasks", context, pb.PollTasksResponse())

    async def GetWorkflow(
        self, request: pb.GetWorkflowRequest, context: Any
    ) -> pb.GetWorkflowResponse:
        workflow = pb.Workflow(name=request.name)
        return await self._answer("GetWorkflow", context, pb.GetWorkflowResponse(workflow=workflow))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        return await self._answer("Heartbeat", context, pb.HeartbeatResponse())

    async def Report(self, request: pb.ReportRequest, context: Any) -> pb.ReportResponse:
        return await self._answer("Report", context, pb.ReportResponse())

    async def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: Any
    ) -> pb.SaveCheckpointResponse:
        return await self._answer("SaveCheckpoint", context, pb.SaveCheckpointResponse())


@pytest.fixture
async def server() -> AsyncIterator[tuple[ScriptedStatuses, str]]:
    servicer = ScriptedStatuses()  # type: ignore[abstract]  # the calls the tests make
    srv = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


@pytest.fixture
async def rpc(server: tuple[ScriptedStatuses, str]) -> AsyncIterator[EngineRpc]:
    engine = EngineRpc(server[1], timeout=5.0, retry=FAST_RETRY)
    try:
        yield engine
    finally:
        await engine.close()


# Transport retries and error mapping.


# CANCELLED comes from a server that stopped before it began the call: the
# caller's own cancel raises asyncio.CancelledError, never a status.
@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
async def test_transient_failures_are_retried(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc, status: grpc.StatusCode
) -> None:
    servicer, _ = server
    servicer.script["GetRun"] = [status] * 2

    response = await rpc.get_run(pb.GetRunRequest(run_id="ab" * 16))

    assert response.run.run_id == "ab" * 16
    assert servicer.calls["GetRun"] == 3


async def test_domain_errors_are_mapped_and_never_retried(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc
) -> None:
    servicer, _ = server
    servicer.always["CancelRun"] = grpc.StatusCode.INVALID_ARGUMENT
    servicer.metadata["CancelRun"] = (
        ("dagnats-error-code", "invalid_argument"),
        ("dagnats-error-field", "run_id"),
    )

    with pytest.raises(InvalidArgument) as caught:
        await rpc.cancel_run(pb.CancelRunRequest(run_id="not-a-run"))

    assert caught.value.field == "run_id"
    assert servicer.calls["CancelRun"] == 1
    assert not isinstance(caught.value.__cause__, grpc.RpcError)


async def test_retries_last_the_budget_and_end_in_unavailable(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc
) -> None:
    servicer, _ = server
    servicer.always["Heartbeat"] = grpc.StatusCode.UNAVAILABLE
    loop = asyncio.get_running_loop()
    started = loop.time()

    with pytest.raises(Unavailable):
        await rpc.heartbeat(pb.HeartbeatRequest(lease="l", run_id="ab" * 16))

    assert loop.time() - started >= FAST_RETRY.budget  # by time, not a count of tries
    assert servicer.calls["Heartbeat"] > 1


async def test_a_held_tasks_call_is_retried_for_as_long_as_its_lease_lasts(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc
) -> None:
    servicer, _ = server
    servicer.always["Heartbeat"] = grpc.StatusCode.UNAVAILABLE
    loop = asyncio.get_running_loop()
    lease = Lease(1.0)  # more than the budget

    with pytest.raises(Unavailable) as failed:
        await rpc.heartbeat(pb.HeartbeatRequest(lease="l", run_id="ab" * 16), lease=lease)

    assert loop.time() >= lease.expires
    assert "lease ran out" in failed.value.message


async def test_a_status_with_a_domain_error_code_is_never_retried(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc
) -> None:
    # A record over the size limit is refused with RESOURCE_EXHAUSTED: as large
    # on every try, so it surfaces at once, as does UNAVAILABLE naming a
    # domain error that retrying cannot cure.
    servicer, _ = server
    servicer.always["Report"] = grpc.StatusCode.RESOURCE_EXHAUSTED
    servicer.metadata["Report"] = (("dagnats-error-code", "invalid_argument"),)

    with pytest.raises(InvalidArgument):
        await rpc.report(pb.ReportRequest(lease="l", run_id="ab" * 16), lease=Lease(5.0))

    assert servicer.calls["Report"] == 1


async def test_deadline_exceeded_is_retried_only_when_safe(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc
) -> None:
    servicer, _ = server
    servicer.script["GetWorkflow"] = [grpc.StatusCode.DEADLINE_EXCEEDED]
    servicer.script["PollTasks"] = [grpc.StatusCode.DEADLINE_EXCEEDED]

    workflow = await rpc.get_workflow(pb.GetWorkflowRequest(name="wf"))
    with pytest.raises(DeadlineExceeded):
        await rpc.poll_tasks(pb.PollTasksRequest(task_types=["t"]), deadline=5.0)

    assert workflow.workflow.name == "wf"
    assert servicer.calls["GetWorkflow"] == 2
    assert servicer.calls["PollTasks"] == 1


async def test_start_run_is_retried_on_deadline_only_with_an_idempotency_key(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc
) -> None:
    servicer, _ = server
    servicer.script["StartRun"] = [grpc.StatusCode.DEADLINE_EXCEEDED]
    with pytest.raises(DeadlineExceeded):
        await rpc.start_run(pb.StartRunRequest(workflow="wf"))

    servicer.script["StartRun"] = [grpc.StatusCode.DEADLINE_EXCEEDED]
    await rpc.start_run(pb.StartRunRequest(workflow="wf", idempotency_key="k"))

    assert servicer.calls["StartRun"] == 3


async def _noop(tc: TaskContext) -> None:
    await tc.complete()


# JSON encoding and settling, through the client and a task context.


def _leased(**task: Any) -> pb.LeasedTask:
    return pb.LeasedTask(
        task=pb.Task(run_id="ab" * 16, step_id="s", task_type="t", iteration=2, attempt=1, **task),
        lease="lease-1",
        delivery=1,
    )


@pytest.mark.parametrize(
    "value",
    [object(), {"nan": math.nan}, {1j: "complex key"}, {b"bytes"}],
    # Named without an address, so every process collecting the module names them alike.
    ids=lambda value: "object()" if type(value) is object else repr(value),
)
async def test_outputs_that_are_not_json_are_rejected_before_sending(
    server: tuple[ScriptedStatuses, str], rpc: EngineRpc, value: Any
) -> None:
    servicer, target = server
    tc = TaskContext(_leased(), rpc)

    for settle in (tc.complete, tc.continue_, tc.checkpoint):
        with pytest.raises(InvalidArgument):
            await settle(value)
    async with Client(target) as client:
        with pytest.raises(InvalidArgument) as caught:
            await client.start_run("wf", value)

    assert caught.value.field == "input"
    assert not tc.settled
    assert sum(servicer.calls.values()) == 0


async def test_a_task_is_settled_once(server: tuple[ScriptedStatuses, str], rpc: EngineRpc) -> None:
    servicer, _ = server
    tc = TaskContext(_leased(input=b'{"q": "hi"}'), rpc)

    await tc.complete({"answer": 42})
    second: list[Callable[[], Any]] = [
        lambda: tc.complete(None),
        lambda: tc.continue_(),
        lambda: tc.fail("boom"),
        lambda: tc.fail_permanent(ValueError("x")),
        lambda: tc.pause(1.0),
    ]
    for settle in second:
        with pytest.raises(TaskAlreadySettled) as caught:
            await settle()
        assert caught.value.settled_as == "complete"

    assert tc.input == {"q": "hi"}
    assert servicer.calls["Report"] == 1


async def test_client_decodes_run_output(server: tuple[ScriptedStatuses, str]) -> None:
    _, target = server
    async with Client(target) as client:
        run = await client.wait_for_run("ab" * 16)

    assert run_output(run) == {"a": 1}
    assert run_output(pb.Run()) is None


async def test_waiting_for_a_run_ends_at_its_deadline(server: tuple[ScriptedStatuses, str]) -> None:
    servicer, target = server
    servicer.run_status = pb.RUN_STATUS_RUNNING
    async with Client(target) as client:
        with pytest.raises(DeadlineExceeded):
            await client.wait_for_run("ab" * 16, timeout=0.05)

    assert servicer.calls["WatchRun"] == 1
    assert servicer.calls["GetRun"] == 0


async def test_a_watch_whose_engine_is_unavailable_is_opened_again(
    server: tuple[ScriptedStatuses, str],
) -> None:
    servicer, target = server
    servicer.script["WatchRun"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    async with Client(target) as client:
        run = await client.wait_for_run("ab" * 16, timeout=10)

    assert run.status == pb.RUN_STATUS_COMPLETED
    assert servicer.calls["WatchRun"] == 3


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"handlers": {}}, "handlers"),
        ({"handlers": {"a.b": _noop}}, "handlers"),
        ({"handlers": {"t": _noop}, "concurrency": 0}, "concurrency"),
        ({"handlers": {"t": _noop}, "heartbeat_interval": 0}, "heartbeat_interval"),
        ({"handlers": {"t": _noop}, "worker_id": "w" * 257}, "worker_id"),
    ],
)
def test_worker_rejects_bad_options(options: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Worker("127.0.0.1:1", **options)

    assert caught.value.field == field


class NatsHiccup(engine_pb2_grpc.EngineServiceServicer):
    """A servicer whose first call of each method meets ``fault`` from NATS."""

    def __init__(self, fault: type[Exception]) -> None:
        self.fault = fault
        self.calls: Counter[str] = Counter()

    def _first_fails(self, method: str) -> None:
        self.calls[method] += 1
        if self.calls[method] == 1:
            raise self.fault

    @domain_errors
    async def GetWorkflow(
        self, request: pb.GetWorkflowRequest, context: Any
    ) -> pb.GetWorkflowResponse:
        self._first_fails("GetWorkflow")
        return pb.GetWorkflowResponse(workflow=pb.Workflow(name=request.name))

    @domain_errors
    async def StartRun(self, request: pb.StartRunRequest, context: Any) -> pb.StartRunResponse:
        self._first_fails("StartRun")
        return pb.StartRunResponse()


@pytest.mark.parametrize(
    ("fault", "start_retried"),
    [
        (nats.errors.NoRespondersError, True),  # nobody got it: not applied
        (nats.errors.TimeoutError, False),  # no answer: it may have been applied
    ],
)
async def test_a_nats_request_that_went_unanswered_is_retried_where_that_is_safe(
    fault: type[Exception], start_retried: bool
) -> None:
    servicer = NatsHiccup(fault)  # type: ignore[abstract]  # the calls the tests make
    srv = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    engine = EngineRpc(f"127.0.0.1:{port}", timeout=5.0, retry=FAST_RETRY)
    try:
        answer = await engine.get_workflow(pb.GetWorkflowRequest(name="wf"))
        assert answer.workflow.name == "wf" and servicer.calls["GetWorkflow"] == 2
        if start_retried:
            await engine.start_run(pb.StartRunRequest(workflow="wf"))
        else:
            with pytest.raises(core_errors.DeadlineExceeded):
                await engine.start_run(pb.StartRunRequest(workflow="wf"))
    finally:
        await engine.close()
        await srv.stop(None)
    assert servicer.calls["StartRun"] == (2 if start_retried else 1)
