"""The split topology: the engine, the journal and
the inputs service each in a process of its own on one nats-server (what
``dagnats serve engine``, ``serve journal`` and ``serve inputs`` start), and
a worker that dials the three over gRPC.

First a journaled agent run across them: a model call, a tool and a commit
per iteration for four iterations, the task kept from one iteration to the
next and handed over with each commit (the journal process hears the
engine's decision over core NATS), and an input submitted to the inputs
process and placed through the journal process. Then the crash points only
this topology takes, each killed (SIGKILL) and its process started again on
its port, as a supervisor would: the journal process after it sent a
commit's event to the engines over core NATS, before any answer
(``after_commit_event_sent``); the journal process after the engine's decision to
keep the task came back, before the worker was answered and handed the next
iteration (``after_kept_decision``); and the engine process as it takes a
commit's event sent to it directly (``before_event_applied``), so the
journal process, told nothing, puts the event on the history, where the
restarted engine applies it. Each must end with the crash-free answer, a
clean journal, the engine's iteration count equal to the commits, the unsafe
tool started once and the input placed once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc.aio
import httpx
import pytest
import pytest_asyncio

from dagnats.core.natsserver import NatsServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, InputMode, Replay, TaskContext, ToolCall, Worker, run_output
from tests.approval_agents import EMAIL
from tests.helpers import wait_for
from tests.journal_agent import SCRIPT, ConversationModel, Tools
from tests.matrix import CASES, EngineProcess, crash_in_group, group_outcome, lines
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_approvals import approved_once, assert_call_outcome, output_of, stopped_at

ANSWER = {"answer": "done", "steers": [{"n": 1}]}


@dataclass
class Split:
    engine: EngineProcess
    journal: EngineProcess
    inputs: EngineProcess
    arm: Path
    hit: Path

    @property
    def processes(self) -> tuple[EngineProcess, ...]:
        return (self.engine, self.journal, self.inputs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Split]:
    base = tmp_path_factory.mktemp("split")
    arm, hit = base / "arm", base / "hit"

    def process(service: str) -> EngineProcess:
        env = {"DAGNATS_TEST_SERVICES": service}
        return EngineProcess(nats_server.url, base, service, arm=arm, hit=hit, env=env)

    stack = Split(process("engine"), process("journal"), process("inputs"), arm, hit)
    try:
        # One after another: each provisions the streams it needs.
        for proc in stack.processes:
            await proc.start()
        yield stack
    finally:
        for proc in stack.processes:
            await proc.stop()


def agent(model: ConversationModel, tools: Tools, arm: Any = None) -> Any:
    """The scripted agent: the step's queued steers placed, the model asked,
    the tool it names run, the outcome kept in the checkpoint, a continue;
    ``arm()`` is called once, as iteration 1 starts."""
    armed = False

    async def turn(tc: TaskContext) -> None:
        nonlocal armed
        if arm is not None and tc.iteration == 1 and not armed:
            armed = True
            arm()
        j = await tc.journal()
        state = await tc.load_checkpoint() or {"history": [tc.input], "steers": []}
        placed = await tc.place_inputs(InputMode.STEER)
        steers = [*state["steers"], *(p.content for p in placed)]
        history = state["history"]
        reply = await j.model(lambda: model(history))
        if "answer" in reply:
            await tc.complete({"answer": reply["answer"], "steers": steers})
            return
        replay = Replay.SAFE if reply["tool"] == "search" else Replay.UNSAFE
        result = await j.tool(ToolCall(name=reply["tool"], input=reply["input"]), replay, tools.run)
        outcome = {"tool": reply["tool"], "output": result.output}
        await tc.checkpoint({"history": [*history, reply, outcome], "steers": steers})
        await tc.continue_()

    return turn


async def read_journal(target: str, run_id: str) -> list[jpb.Record]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        request = jpb.ReadRequest(run_id=run_id, step_id="agent")
        return [r.record async for r in stub.Read(request)]


async def violations(target: str, run_id: str) -> list[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        check = await jgrpc.JournalServiceStub(channel).Check(jpb.CheckRequest(run_id=run_id))
    return [f"{v.rule}: {v.message}" for v in check.violations]


async def run_agent(split: Split, model: ConversationModel, tools: Tools, arm: Any = None) -> str:
    """Run the agent across the three processes, its steer submitted as the
    run starts; returns the run's id once it ended as the crash-free run does."""
    task, name = unique("split"), unique("splitwf")
    async with (
        Client(split.engine.target, inputs_target=split.inputs.target) as client,
        Worker(
            split.engine.target,
            handlers={task: agent(model, tools, arm)},
            poll_wait=1.0,
            journal_target=split.journal.target,
            inputs_target=split.inputs.target,
        ),
    ):
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name, {"ask": "weather"})
        await client.submit_input(run.run_id, "agent", "steer-1", {"n": 1})
        done = await client.wait_for_run(run.run_id, timeout=60)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == ANSWER
    records = await read_journal(split.journal.target, run.run_id)
    commits = [r.iteration for r in records if r.WhichOneof("kind") == "commit"]
    assert commits == [0, 1, 2, 3], "one commit an iteration"
    assert steps_by_id(done)["agent"].iterations == len(SCRIPT) - 1
    assert await violations(split.journal.target, run.run_id) == []
    return run.run_id


async def test_a_journaled_agent_run_across_the_three_service_processes(split: Split) -> None:
    model, tools = ConversationModel(), Tools()
    run_id = await run_agent(split, model, tools)
    assert len(model.requests) == len(SCRIPT), "each model call asked once"
    assert tools.starts == {"search": 2, "send_email": 1}
    records = await read_journal(split.journal.target, run_id)
    placed = [r for r in records if r.WhichOneof("kind") == "input_placed"]
    assert len(placed) == 1
    # No claim of its own: each iteration's claim rides its first record,
    # the first delivery's and each one handed over with a commit.
    assert [r.WhichOneof("kind") for r in records].count("claim") == 0
    assert sum(r.HasField("leading_claim") for r in records) == len(SCRIPT)


CRASHES = {
    "after_commit_event_sent": "journal",
    "after_kept_decision": "journal",
    "before_event_applied": "engine",
}


@pytest.mark.parametrize("seam", list(CRASHES))
async def test_a_service_process_killed_mid_iteration_is_started_again(
    split: Split, seam: str
) -> None:
    model, tools = ConversationModel(), Tools()
    split.hit.unlink(missing_ok=True)
    victim = getattr(split, CRASHES[seam])
    before = victim.starts

    async def restart() -> None:
        await wait_for(split.hit.exists, timeout=30, message=f"{seam} not reached")
        assert split.hit.read_text().split() == [str(victim.pid), seam]
        await victim.exited()
        await victim.start()

    restarting: asyncio.Task[None] | None = None

    def arm() -> None:
        nonlocal restarting
        split.arm.write_text(f"{seam} kill")
        restarting = asyncio.ensure_future(restart())

    await run_agent(split, model, tools, arm)
    assert restarting is not None
    await asyncio.wait_for(restarting, 30)
    assert victim.starts == before + 1, "killed and started again once"
    assert tools.starts["send_email"] == 1, "the unsafe tool started once"


# A few of the crash matrix's parallel-group cases on this topology: the
# worker dials the journal process for its journal calls.
GROUP_CASES = [
    ("after_group_intents", "mixed", "stall"),
    ("after_group_result@1", "mixed", "kill"),
    ("after_group_result@2", "unsafe", "stall"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("seam", "kind", "mode"), GROUP_CASES)
async def test_a_worker_stopped_inside_a_parallel_group(
    split: Split, tmp_path: Path, seam: str, kind: str, mode: str
) -> None:
    async with Client(split.engine.target, inputs_target=split.inputs.target) as client:
        done, crasher = await crash_in_group(
            split.engine.target,
            split.engine.target,
            client,
            tmp_path,
            seam,
            kind,
            mode,
            journal=split.journal.target,
        )
    await group_outcome(split.journal.target, done, crasher, tmp_path, seam, kind, mode)


# Two of the approval crash matrix's cases on this topology, a call alone:
# the holder killed once the approval was placed (through the journal process,
# from the inputs process), the call not yet made; and frozen past its lease
# once the approved tool returned, then thawed.
APPROVAL_CASES = [("after_approval_placed:2", "kill"), ("approved_tool_returned", "stall")]


@pytest.mark.parametrize(("seam", "mode"), APPROVAL_CASES)
async def test_an_approved_call_with_its_holder_stopped_across_the_three_processes(
    split: Split, tmp_path: Path, seam: str, mode: str
) -> None:
    gateway = await start_gateway(
        GatewayConfig(
            engine_target=split.engine.target,
            journal_target=split.journal.target,
            inputs_target=split.inputs.target,
            port=0,
        )
    )
    try:
        async with (
            Client(split.engine.target, inputs_target=split.inputs.target) as client,
            httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http,
        ):
            run_id, run = await stopped_at(
                client,
                http,
                split.engine.target,
                tmp_path,
                seam,
                mode,
                lambda run_id: read_journal(split.journal.target, run_id),
                "--journal",
                split.journal.target,
                "--inputs",
                split.inputs.target,
            )
    finally:
        await gateway.stop()
    CASES["split topology", f"{seam}/approval call/{mode}"] += 1
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    starts = len(lines(tmp_path / "a", "runs") + lines(tmp_path / "b", "runs"))
    expected = {"sent": True, "to": EMAIL["to"]}
    assert_call_outcome(seam, mode, output_of(run)["output"], expected, starts)
    approved_once(await read_journal(split.journal.target, run_id))
    assert await violations(split.journal.target, run_id) == []
