"""Each service runs as a process of its own: ``dagnats serve engine``,
``serve journal`` and ``serve inputs`` against one nats-server.

First each service started alone in the test's process: it is healthy,
serves its own methods and no other's. Then a journaled run across three
processes: the engine, the journal and the inputs service each in its own
``dagnats serve``; the test's worker dials all three, so its task comes from
the engine, its claim, model call, placement and commit go to the journal
process, and the input the client submits goes to the inputs process (whose
event wakes the step waiting in the engine's process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dagnats.core.natsserver import NatsServer
from dagnats.core.settings import SERVICES, host_port
from dagnats.engine.server import EngineServer, start_services
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.inputs.v1 import inputs_pb2_grpc as igrpc
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, InputMode, JournalClient, TaskContext, Worker
from tests.helpers import wait_for
from tests.stack import loop_workflow, unique

NAMES = {
    "engine": "dagnats.engine.v1.EngineService",
    "journal": "dagnats.journal.v1.JournalService",
    "inputs": "dagnats.inputs.v1.InputsService",
}


async def call_each_service(target: str) -> dict[str, grpc.StatusCode]:
    """One harmless call to each service: OK, or the status it failed with
    (NOT_FOUND or INVALID_ARGUMENT for a service that is there and found
    nothing; UNIMPLEMENTED for one that is not served)."""
    calls: dict[str, Callable[[grpc.aio.Channel], object]] = {
        "engine": lambda c: pb_grpc.EngineServiceStub(c).ListWorkflows(
            pb.ListWorkflowsRequest(), timeout=10
        ),
        "journal": lambda c: jgrpc.JournalServiceStub(c).Check(
            jpb.CheckRequest(run_id="0" * 32), timeout=10
        ),
        "inputs": lambda c: igrpc.InputsServiceStub(c).List(
            ipb.ListRequest(run_id="0" * 32, step_id="agent"), timeout=10
        ),
    }
    found = {}
    async with grpc.aio.insecure_channel(target) as channel:
        for name, call in calls.items():
            try:
                await call(channel)  # type: ignore[misc]
                found[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as err:
                found[name] = err.code()
    return found


@pytest.mark.parametrize("service", SERVICES)
async def test_each_service_serves_alone_its_own_methods_only(
    nats_server: NatsServer, service: str
) -> None:
    server = await start_services(nats_server.url, services=[service])
    try:
        assert server.services == (service,)
        assert isinstance(server, EngineServer) == (service == "engine")
        async with grpc.aio.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            own = await health.Check(health_pb2.HealthCheckRequest(service=NAMES[service]))
            assert own.status == health_pb2.HealthCheckResponse.SERVING
            for other in set(SERVICES) - {service}:
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await health.Check(health_pb2.HealthCheckRequest(service=NAMES[other]))
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        answered = await call_each_service(server.target)
        assert answered.pop(service) != grpc.StatusCode.UNIMPLEMENTED
        assert set(answered.values()) == {grpc.StatusCode.UNIMPLEMENTED}
    finally:
        await server.stop()


async def test_an_unknown_service_is_refused(nats_server: NatsServer) -> None:
    from dagnats.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as refused:
        await start_services(nats_server.url, services=["scheduler"])
    assert refused.value.field == "services"


@contextlib.asynccontextmanager
async def serving(service: str, nats_url: str) -> AsyncIterator[str]:
    """``dagnats serve <service>`` in its own process; its address."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dagnats.cli.main",
        "serve",
        service,
        "--nats",
        nats_url,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if "serving on" not in line:
            _, err = await proc.communicate()
            raise AssertionError(f"dagnats serve {service} did not start: {line}{err.decode()}")
        assert line.startswith(f"{service} serving on "), line
        yield line.split()[-1]
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


async def test_a_journaled_run_across_the_three_services_as_separate_processes(
    nats_server: NatsServer,
) -> None:
    async with (
        serving("engine", nats_server.url) as engine,
        serving("journal", nats_server.url) as journal,
        serving("inputs", nats_server.url) as inputs,
    ):
        assert len({engine, journal, inputs}) == 3
        # Each process serves its own service and no other.
        for target, service in ((engine, "engine"), (journal, "journal"), (inputs, "inputs")):
            answered = await call_each_service(target)
            assert answered.pop(service) != grpc.StatusCode.UNIMPLEMENTED
            assert set(answered.values()) == {grpc.StatusCode.UNIMPLEMENTED}

        task, name = unique("split"), unique("splitwf")
        turns: list[int] = []

        async def handler(tc: TaskContext) -> None:
            j = await tc.journal()
            turns.append(tc.iteration)
            if tc.iteration == 0:
                await j.model(lambda: _answer("waiting for the reviewer"))
                await tc.continue_(until_input=True)
                return
            placed = await tc.place_inputs(InputMode.STEER)
            await tc.complete({"reviewed": [p.content for p in placed]})

        async with (
            Client(engine, inputs_target=inputs) as client,
            Worker(
                engine,
                handlers={task: handler},
                journal_target=journal,
                inputs_target=inputs,
                rpc_timeout=10,
            ),
        ):
            await client.register_workflow(loop_workflow(name, task))
            run = await client.start_run(name, "draft")

            async def waiting() -> bool:
                step = (await client.get_run(run.run_id)).steps[0]
                return step.status == pb.STEP_STATUS_WAITING

            await wait_for(waiting, timeout=30, message="the step waits for its input")
            await client.submit_input(run.run_id, "agent", "review-1", {"ok": True})
            done = await client.wait_for_run(run.run_id, timeout=60)
        assert done.status == pb.RUN_STATUS_COMPLETED, done.error
        assert done.steps[0].output == b'{"reviewed":[{"ok":true}]}'
        assert turns == [0, 1]
        async with JournalClient(journal) as reader:
            records = [r async for r in reader.read(run.run_id, "agent")]
            check = await reader.check(run.run_id)
        kinds = [r.WhichOneof("kind") for r in records]
        assert kinds == ["model", "commit", "input_placed", "commit"]
        # Each turn's claim rides its first record: the first delivery of the
        # first attempt fences nothing (the riding claim).
        assert [r.HasField("leading_claim") for r in records] == [True, False, True, False]
        assert list(check.violations) == []


async def _answer(text: str) -> str:
    return text


def test_a_service_on_an_ipv6_address_is_dialled_in_brackets() -> None:
    assert host_port("127.0.0.1", 7233) == "127.0.0.1:7233"
    assert host_port("localhost", 7233) == "localhost:7233"
    assert host_port("::1", 7233) == "[::1]:7233"
    assert host_port("[::1]", 7233) == "[::1]:7233"
