"""The Node.js worker (examples/node-worker): a journaled agent loop driven
through the gRPC contracts from another language, against a real nats-server
and engine. It charges a card (an unsafe tool that counts its starts in a file)
and then answers. A crash-free run, a holder killed inside the tool, and a turn
that a Python holder committed but never reported must all end with the same
answer, a clean journal, and the card charged at most once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.limits import MAX_RECORD_BYTES
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, Worker, run_output
from tests.helpers import wait_for
from tests.journal_agent import Crasher
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_journal import journal_check, read_journal
from tests.test_live_stream import sse, until

EXAMPLE = Path(__file__).parent.parent / "examples" / "node-worker"
INPUT = {"order": "A-1001", "amount_cents": 4200}
CHARGE = {"tool": "charge_card", "input": INPUT}  # the scripted model's first reply
ANSWER = "Order A-1001: payment submitted."
PARTIAL = "charging 4200 cents for order A-1001;"  # what the tool reports before it hangs

Processes = list[subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary. A missing Node.js or node_modules fails the tests: they
    are part of the suite, not optional."""
    path = shutil.which("node")
    if path is None:
        pytest.fail("node is not on PATH: the Node.js worker example needs Node.js 20 or later")
    for package in ("@grpc/grpc-js", "@grpc/proto-loader"):
        if not (EXAMPLE / "node_modules" / package).is_dir():
            pytest.fail(
                f"{EXAMPLE / 'node_modules' / package} is missing: run `make setup` "
                "(npm ci --prefix examples/node-worker)"
            )
    return path


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Node workers started by a test; killed at its end, whatever happened."""
    started: Processes = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class NodeWorkers:
    """Starts node workers for one task type; they share the files in ``state``."""

    def __init__(self, node: str, target: str, task: str, state: Path, started: Processes) -> None:
        self.node, self.target, self.task, self.state = node, target, task, state
        self.started = started
        self.starts = state / "starts"
        self.model_calls = state / "model"
        self.hanging = state / "hanging"

    def spawn(
        self,
        name: str,
        *,
        hang: bool = False,
        token_chars: int = 8,
        parallel: bool = False,
        build: str = "",
    ) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "DAGNATS_ENGINE": self.target,
            "TOOL_STARTS_FILE": str(self.starts),
            "MODEL_CALLS_FILE": str(self.model_calls),
            # One task at a time and short polls, as tests/workers/matrix_worker.py:
            # a killed worker leaves no poll behind that would lease the task's
            # redelivery into a response nobody reads.
            "WORKER_CONCURRENCY": "1",
            "WORKER_POLL_WAIT": "0.5",
            "MODEL_TOKEN_CHARS": str(token_chars),
        }
        if hang:
            env["HANG_IN_TOOL_MARKER"] = str(self.hanging)
        if parallel:
            env["MODEL_PARALLEL"] = "1"
        if build:
            env["DAGNATS_BUILD_ID"] = build
        with open(self.state / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                [self.node, str(EXAMPLE / "main.js"), self.task],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.state,
            )
        self.started.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text()}" for log in sorted(self.state.glob("*.log"))
        )

    def alive(self, proc: subprocess.Popen[bytes]) -> None:
        """Fail at once, with the logs, when a worker died on its own."""
        if proc.poll() is not None:
            raise AssertionError(f"a node worker exited with {proc.returncode}\n{self.logs()}")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def start(client: Client) -> tuple[str, str]:
    task, name = unique("node"), unique("nodewf")
    await client.register_workflow(loop_workflow(name, task))
    return task, name


async def finish(
    client: Client,
    engine: EngineServer,
    run_id: str,
    workers: NodeWorkers,
    proc: subprocess.Popen[bytes],
) -> pb.Run:
    """Wait for the run to end; check the answer, the journal and the engine's count."""

    async def ended() -> pb.Run | None:
        workers.alive(proc)
        run = await client.get_run(run_id)
        return None if run.status == pb.RUN_STATUS_RUNNING else run

    run: pb.Run = await wait_for(ended, timeout=30, interval=0.05, message="the run never ended")
    assert run.status == pb.RUN_STATUS_COMPLETED, f"{run.error}\n{workers.logs()}"
    assert run_output(run) == ANSWER
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
    assert steps_by_id(run)["agent"].iterations == 1  # one continue, then the answer
    return run


async def tool_results(engine: EngineServer, run_id: str) -> list[jpb.ToolResult]:
    records = await read_journal(engine, run_id)
    return [r.tool_result for r in records if r.WhichOneof("kind") == "tool_result"]


async def test_node_worker_completes_a_durable_run(
    client: Client, engine: EngineServer, node: str, tmp_path: Path, processes: Processes
) -> None:
    task, name = await start(client)
    workers = NodeWorkers(node, engine.target, task, tmp_path, processes)
    worker = workers.spawn("worker", build="node-1")
    run = await client.start_run(name, INPUT)
    done = await finish(client, engine, run.run_id, workers, worker)
    assert steps_by_id(done)["agent"].build_id == "node-1"  # its polls and commits name it
    records = await read_journal(engine, run.run_id)  # and its claims: each record carries it
    assert {r.build_id for r in records if r.WhichOneof("kind") != "commit"} == {"node-1"}
    assert lines(workers.starts) == [f"charge_card {run.run_id}.agent.0.1"]
    assert lines(workers.model_calls) == ["turn 0", "turn 1"]
    (result,) = await tool_results(engine, run.run_id)
    assert not result.interrupted and b'"charged":true' in result.output


async def test_node_worker_killed_inside_the_unsafe_tool(
    client: Client, engine: EngineServer, node: str, tmp_path: Path, processes: Processes
) -> None:
    task, name = await start(client)
    workers = NodeWorkers(node, engine.target, task, tmp_path, processes)
    first = workers.spawn("first", hang=True)
    run = await client.start_run(name, INPUT)

    def hanging() -> bool:
        workers.alive(first)
        return workers.hanging.exists()

    await wait_for(hanging, timeout=30, message="the tool never started")
    first.kill()  # SIGKILL, inside the tool: its lease runs out, a successor takes over
    first.wait()
    second = workers.spawn("second")
    await finish(client, engine, run.run_id, workers, second)
    assert len(lines(workers.starts)) == 1, "the unsafe tool started again"
    assert lines(workers.model_calls) == ["turn 0", "turn 1"], "the recorded reply was reused"
    (result,) = await tool_results(engine, run.run_id)
    assert result.interrupted and result.partial == PARTIAL


async def test_node_worker_killed_inside_a_parallel_group(
    client: Client, engine: EngineServer, node: str, tmp_path: Path, processes: Processes
) -> None:
    # One response asks for the safe lookup and the unsafe charge at once; the
    # worker is killed inside the charge, after the lookup's result is stored.
    task, name = await start(client)
    workers = NodeWorkers(node, engine.target, task, tmp_path, processes)
    first = workers.spawn("first", hang=True, parallel=True)
    run = await client.start_run(name, INPUT)

    async def hanging_after_the_lookup() -> bool:
        workers.alive(first)
        return workers.hanging.exists() and len(await tool_results(engine, run.run_id)) == 1

    await wait_for(hanging_after_the_lookup, timeout=30, message="the group never started")
    first.kill()
    first.wait()
    second = workers.spawn("second", parallel=True)
    await finish(client, engine, run.run_id, workers, second)
    keys = [f"{run.run_id}.agent.0.1", f"{run.run_id}.agent.0.2"]
    assert sorted(lines(workers.starts)) == sorted(
        [f"lookup_order {keys[0]}", f"charge_card {keys[1]}"]
    ), "each call started once: the lookup's result reused, the charge not run again"
    records = await read_journal(engine, run.run_id)
    (group,) = [r for r in records if r.WhichOneof("kind") == "tool_intents"]
    assert [i.name for i in group.tool_intents.intents] == ["lookup_order", "charge_card"]
    lookup, charge = sorted(await tool_results(engine, run.run_id), key=lambda r: r.intent_index)
    assert not lookup.interrupted and charge.interrupted and charge.partial == PARTIAL


async def test_node_worker_reports_a_turn_committed_by_a_crashed_holder(
    client: Client, engine: EngineServer, node: str, tmp_path: Path, processes: Processes
) -> None:
    """A Python holder commits iteration 0, and the journal service stops before
    it publishes the event; the node worker's claim finds the commit and
    reports it, running nothing."""
    task, name = await start(client)
    workers = NodeWorkers(node, engine.target, task, tmp_path, processes)

    async def charge(run: ToolRun) -> Any:
        with open(workers.starts, "a") as f:
            f.write(f"{run.call.name} {run.call.key}\n")
        return {"charged": True, "order": "A-1001", "amount_cents": 4200}

    async def python_turn(tc: TaskContext) -> None:  # iteration 0 of the node agent
        j = await tc.journal()
        history = await tc.load_checkpoint() or [tc.input]

        async def model() -> Any:
            return CHARGE

        reply = await j.model(model)
        result = await j.tool(ToolCall(name="charge_card", input=INPUT), Replay.UNSAFE, charge)
        await tc.checkpoint([*history, {"reply": reply, "output": result.output}])
        await tc.continue_()

    # The journal service answers the Python holder's commit and stops before
    # it publishes the event; the holder is gone then, as if both had died.
    # (The holder releases its task: a kept one is answered after its event.)
    with Crasher("after_commit_stored") as crash:
        async with Worker(
            engine.target,
            handlers={task: python_turn},
            poll_wait=0.5,
            concurrency=1,
            kept_iterations=0,
        ):
            run = await client.start_run(name, INPUT)
            await wait_for(
                crash.hit.is_set, timeout=30, message="the Python holder never committed"
            )
        worker = workers.spawn("worker")
        await finish(client, engine, run.run_id, workers, worker)
        crash.release.set()  # the stopped service goes on: a duplicate event
    assert lines(workers.starts) == [f"charge_card {run.run_id}.agent.0.1"]
    assert lines(workers.model_calls) == ["turn 1"], "the node worker ran iteration 1 only"
    assert "settled by the journal (committed" in workers.logs()


async def test_the_node_worker_streams_its_model_tokens(
    node: str,
    client: Client,
    engine: EngineServer,
    http: httpx.AsyncClient,
    tmp_path: Path,
    processes: Processes,
) -> None:
    """The model puts its reply a character a token, all at once: most wait
    while grpc-js drains its write buffer, and grow the waiting chunk."""
    task, name = await start(client)
    workers = NodeWorkers(node, engine.target, task, tmp_path, processes)
    run = await client.start_run(name, INPUT)
    async with sse(http, run.run_id) as stream:
        proc = workers.spawn("streamer", token_chars=1)
        events = await until(stream, lambda e: e.type == "committed")
        await finish(client, engine, run.run_id, workers, proc)
    tokens = [e for e in events if e.type == "token"]
    text = "".join(e.data["text"] for e in tokens)
    assert json.loads(text) == CHARGE == events[-1].data["response"]
    model = next(r for r in await read_journal(engine, run.run_id) if r.HasField("model"))
    assert events[-1].data["record_seq"] == model.seq
    assert text == model.model.response.decode(), "the reader missed text"
    assert [e.data.get("dropped", 0) for e in tokens] == [0] * len(tokens)
    assert [e.data["seq"] for e in tokens] == list(range(1, len(tokens) + 1))
    assert len(tokens) < len(text), "no token waited for the link"


async def test_the_node_worker_fails_a_step_at_once_when_a_record_is_too_large(
    client: Client, engine: EngineServer, node: str, tmp_path: Path, processes: Processes
) -> None:
    """An order of 2.1 MB makes the model's reply (it asks to charge that
    order) larger than a journal record: every delivery would be refused the
    same way, so the step fails for good at once, saying what is too large."""
    task, name = unique("node"), unique("nodewf")
    retry = {"max_attempts": 3, "backoff": "fixed", "initial_delay": "100ms"}
    await client.register_workflow(loop_workflow(name, task, retry=retry))
    workers = NodeWorkers(node, engine.target, task, tmp_path, processes)
    worker = workers.spawn("worker", token_chars=60_000)
    order = "A-" + "1" * (MAX_RECORD_BYTES + 4096)
    run = await client.start_run(name, {**INPUT, "order": order})

    async def ended() -> pb.Run | None:
        workers.alive(worker)
        got = await client.get_run(run.run_id)
        return None if got.status == pb.RUN_STATUS_RUNNING else got

    # Far below a lease's expiry and the restart limit's five deliveries.
    done: pb.Run = await wait_for(ended, timeout=15, interval=0.05, message="the step went on")
    assert done.status == pb.RUN_STATUS_FAILED, workers.logs()
    assert "the model's response is" in done.error, done.error
    assert f"a journal record is at most {MAX_RECORD_BYTES:,} bytes" in done.error
    assert steps_by_id(done)["agent"].attempt == 1, "no retry: it cannot help"
    assert lines(workers.starts) == [], "the tool never started"
