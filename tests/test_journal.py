"""The per-step journal end to end: crashes in the middle of a turn repeat no
finished model or tool call, and an unsafe tool never starts twice."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import pytest

from dagnats.cli.handlers import in_process_worker
from dagnats.cli.journal import record_line
from dagnats.core import seam
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.journal.writer import JournalWriter
from dagnats.sdk import Client, Worker, run_output
from dagnats.sdk import _journal as sdk_journal
from dagnats.sdk.testing import ScriptedModel
from dagnats.sdk.views import record_dict
from tests.helpers import claimed_after_redelivery, claims, holds, wait_for
from tests.journal_agent import SCRIPT, ConversationModel, Crasher, Seen, Tools, agent
from tests.stack import loop_workflow, steps_by_id, unique

NO_HEARTBEAT = 3600.0  # a crashed holder sends nothing, heartbeats included


async def journal_check(engine: EngineServer, run_id: str) -> jpb.CheckResponse:
    import grpc.aio

    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        return await stub.Check(jpb.CheckRequest(run_id=run_id))


async def read_journal(engine: EngineServer, run_id: str, step: str = "agent") -> list[jpb.Record]:
    import grpc.aio

    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        return [r.record async for r in stub.Read(jpb.ReadRequest(run_id=run_id, step_id=step))]


async def start(client: Client, **step: Any) -> tuple[str, str]:
    task, name = unique("jagent"), unique("jwf")
    await client.register_workflow(loop_workflow(name, task, **step))
    return task, name


async def finish(client: Client, engine: EngineServer, run_id: str) -> pb.Run:
    run = await client.wait_for_run(run_id, timeout=40)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == "done"
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
    assert steps_by_id(run)["agent"].iterations == 3
    return run


def remote(engine: EngineServer, handlers: dict[str, Any], **options: Any) -> Worker:
    """A worker of its own on another host: its journal calls on gRPC."""
    return Worker(engine.target, handlers=handlers, poll_wait=1.0, local_socket="off", **options)


def found(engine: EngineServer, handlers: dict[str, Any], **options: Any) -> Worker:
    """A worker of its own on the services' host, told nothing: its journal
    calls go to the local socket its polls' answers name (ADR 46)."""
    return Worker(engine.target, handlers=handlers, poll_wait=1.0, **options)


def hosted(engine: EngineServer, handlers: dict[str, Any], **options: Any) -> Worker:
    """A worker in the services' process, its journal calls answered there."""
    return in_process_worker(engine, handlers, concurrency=4, poll_wait=1.0, **options)


def socketed(engine: EngineServer, handlers: dict[str, Any], **options: Any) -> Worker:
    """A worker of its own whose journal calls go on the local socket (ADR 45)."""
    assert engine.local_socket is not None, "the engine fixture has a local socket"
    socket = str(engine.local_socket.path)
    return Worker(engine.target, handlers=handlers, poll_wait=1.0, local_socket=socket, **options)


WorkerOf = Callable[..., Worker]  # remote, found, hosted or socketed
WORKERS = pytest.mark.parametrize(
    "worker",
    [remote, found, hosted, socketed],
    ids=[
        "own process on gRPC",
        "own process on the socket found",
        "services' process",
        "local socket given",
    ],
)


async def take_over(
    client: Client,
    engine: EngineServer,
    task: str,
    name: str,
    handler: Any,
    stopped: Callable[[], bool],
    *,
    at_stop: Callable[[], None] = lambda: None,
    worker: WorkerOf = remote,
) -> None:
    """Start a run on a worker that sends no heartbeat; once ``stopped`` says
    its holder stopped (``at_stop`` checks what it left), a successor worker
    takes the task over when the lease runs out and finishes the run."""
    async with worker(engine, {task: handler}, heartbeat_interval=NO_HEARTBEAT) as first:
        run = await client.start_run(name)
        await wait_for(stopped, timeout=20)
        at_stop()
        async with worker(engine, {task: handler}):
            await first.stop(grace=0)
            await finish(client, engine, run.run_id)


async def fenced_after_stall(
    client: Client,
    engine: EngineServer,
    task: str,
    name: str,
    handler: Any,
    seen: Seen,
    stall: Crasher,
    *,
    iteration: int,
    then: Callable[[str], Awaitable[Any]],
) -> str:
    """Start a run on a worker that sends no heartbeat; once ``stall`` holds
    its holder, a successor worker claims ``iteration`` when the lease runs
    out, and the stalled holder is let go and fenced; then ``then(run_id)``
    runs while the successor still serves. Returns the run's id."""
    async with Worker(
        engine.target, handlers={task: handler}, poll_wait=1.0, heartbeat_interval=NO_HEARTBEAT
    ):
        run = await client.start_run(name)
        await wait_for(stall.hit.is_set, timeout=20)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):

            async def successor_claimed() -> bool:
                records = await read_journal(engine, run.run_id)
                return claimed_after_redelivery(records, iteration)

            await wait_for(successor_claimed, timeout=20)
            stall.release.set()  # the stalled holder wakes up and makes its next call
            await wait_for(lambda: "Fenced" in seen.signals, timeout=20)
            await then(run.run_id)
    return run.run_id


async def run_without_a_crash(
    client: Client, engine: EngineServer, worker: WorkerOf = remote
) -> None:
    """The scripted agent, run once by ``worker`` with nothing going wrong:
    every model call and tool starts once, one claim and one commit a
    dispatch."""
    task, name = await start(client)
    model, tools = ScriptedModel(SCRIPT), Tools()
    async with worker(engine, {task: agent(model, tools)}):
        run = await client.start_run(name, {"ask": "weather"})
        await finish(client, engine, run.run_id)
    assert model.calls == 4
    assert tools.starts == {"search": 2, "send_email": 1}
    records = await read_journal(engine, run.run_id)
    assert sum(holds(r, "commit") for r in records) == 4
    assert sum(holds(r, "claim") for r in records) == 4


@WORKERS
async def test_a_crash_free_run(client: Client, engine: EngineServer, worker: WorkerOf) -> None:
    await run_without_a_crash(client, engine, worker)


@WORKERS
async def test_crash_after_unsafe_intent_records_interrupted(
    client: Client, engine: EngineServer, worker: WorkerOf
) -> None:
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    handler = agent(model, tools, seen)
    with Crasher("after_intent", skip=1) as crash:  # iteration 1: the unsafe send_email
        tools.block["send_email"] = crash.release
        # The holder is gone after writing the intent; a successor takes over
        # once the lease runs out.
        await take_over(client, engine, task, name, handler, crash.hit.is_set, worker=worker)
    assert tools.starts["send_email"] == 0, "the unsafe tool never started"
    interrupted = [r for r in seen.results if r["tool"] == "send_email"]
    assert interrupted == [
        {"tool": "send_email", "output": None, "interrupted": True, "partial": ""}
    ]
    assert model.requests[2][-1]["interrupted"] is True, "the model sees the interrupted call"


async def test_crash_inside_unsafe_tool_keeps_partial_output(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    handler = agent(model, tools, seen)
    with Crasher("after_result") as crash:  # used only to release the blocked tool at exit
        import asyncio

        tools.block["send_email"] = asyncio.Event()
        await take_over(
            client, engine, task, name, handler, lambda: tools.starts["send_email"] == 1
        )
        crash.release.set()
    assert tools.starts["send_email"] == 1, "started once, never again"
    (result,) = [r for r in seen.results if r["tool"] == "send_email"]
    assert result["interrupted"] is True and result["partial"] == "started send_email;"


async def test_crash_after_safe_intent_runs_it_again(client: Client, engine: EngineServer) -> None:
    task, name = await start(client)
    model, tools = ScriptedModel(SCRIPT), Tools()
    handler = agent(model, tools)
    with Crasher("after_intent") as crash:  # iteration 0: the safe search
        await take_over(client, engine, task, name, handler, crash.hit.is_set)
    assert tools.starts == {"search": 2, "send_email": 1}, "the safe call ran again (once)"
    assert model.calls == 4, "the model response of the crashed turn was reused"


async def test_a_turn_is_three_records_and_reads_back_whole(
    client: Client, engine: EngineServer
) -> None:
    # The model's response rides the intent of the tool it asks for, the
    # tool's result rides the commit, and the claim rides the first record:
    # the first delivery's claim fences nothing (the riding claim), and from the second
    # iteration on the commit before handed the dispatch over (the hand-over).
    # Intent and commit per tool turn.
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    async with Worker(engine.target, handlers={task: agent(model, tools, seen)}, poll_wait=1.0):
        run = await client.start_run(name, {"ask": "weather"})
        await finish(client, engine, run.run_id)
    records = await read_journal(engine, run.run_id)
    shape = [
        (r.iteration, r.HasField("leading_claim"), r.WhichOneof("leading"), r.WhichOneof("kind"))
        for r in records
    ]
    assert shape == [
        *[
            (i, claimed, kind, body)
            for i in range(3)
            for claimed, kind, body in [
                (True, "leading_model", "tool_intent"),
                (False, None, "tool_output"),  # the tool reports "started <name>;"
                (False, "leading_tool_result", "commit"),
            ]
        ],
        (3, True, "leading_model", "commit"),
    ]
    assert {r.leading_claim.delivery for r in records if r.HasField("leading_claim")} == {1}, (
        "every claim is the first delivery's"
    )
    assert records[0].leading_claim.worker_id, "the claim names its worker"
    intent = records[0]
    assert json.loads(intent.leading_model.response) == SCRIPT[0]
    assert (intent.leading_model.position, intent.tool_intent.position) == (0, 1)
    commit = records[2]
    assert commit.leading_tool_result.intent_seq == intent.seq
    assert json.loads(commit.leading_tool_result.output)["tool"] == "search"
    assert commit.commit.action == jpb.ACTION_CONTINUE
    assert [r["tool"] for r in seen.results] == ["search", "send_email", "search"]
    # Read through the SDK's view (the gateway's journal stream and `--json`).
    view = record_dict(intent)
    assert view["kind"] == "tool_intent" and view["leading"] == "leading_model"
    assert view["leading_model"]["response"] == SCRIPT[0]
    assert view["tool_intent"]["input"] == SCRIPT[0]["input"]
    lines = record_line(commit).splitlines()
    assert [line.split()[2] for line in lines] == ["tool_result", "commit"]
    assert {line.split()[0] for line in lines} == {str(commit.seq)}
    for first in (intent, records[3]):  # the first record of the first and the handed dispatch
        assert [line.split()[2] for line in record_line(first).splitlines()] == [
            "claim",
            "model",
            "tool_intent",
        ]
        assert record_dict(first)["leading_claim"]["delivery"] == 1


async def test_a_handler_that_awaits_between_its_calls_stores_each_on_its_own(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools = ScriptedModel(SCRIPT), Tools()
    async with Worker(
        engine.target, handlers={task: agent(model, tools, apart=True)}, poll_wait=1.0
    ):
        run = await client.start_run(name, {"ask": "weather"})
        await finish(client, engine, run.run_id)
    records = await read_journal(engine, run.run_id)
    assert not [r for r in records if r.WhichOneof("leading")]
    kinds = [r.WhichOneof("kind") for r in records if r.iteration == 0]
    assert kinds == ["model", "tool_intent", "tool_output", "tool_result", "commit"]
    assert records[0].HasField("leading_claim"), "the claim rides the first record"


async def test_crash_while_the_response_is_pending_asks_the_model_again(
    client: Client, engine: EngineServer
) -> None:
    # The window this record merging opens: the model answered, and the
    # holder died before its next journal call stored the answer.
    task, name = await start(client)
    model, tools = ConversationModel(), Tools()
    handler = agent(model, tools)
    with Crasher("model_pending", skip=1) as crash:

        def left() -> None:
            assert model.calls == 2

        await take_over(client, engine, task, name, handler, crash.hit.is_set, at_stop=left)
    assert model.calls == 5, "the unstored response was asked for again, once"
    assert model.requests[1] == model.requests[2], "with the same conversation"
    assert tools.starts == {"search": 2, "send_email": 1}


async def test_crash_while_an_unsafe_result_is_pending_comes_back_interrupted(
    client: Client, engine: EngineServer
) -> None:
    # The other window: the unsafe tool returned, and the holder died before
    # the commit its result rides. Its intent is unanswered: the successor
    # records it interrupted (with what the tool reported) and never starts it.
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    handler = agent(model, tools, seen)
    with Crasher("result_pending", skip=1) as crash:  # iteration 1: send_email

        def left() -> None:
            assert tools.effects["send_email"] == 1

        await take_over(client, engine, task, name, handler, crash.hit.is_set, at_stop=left)
    assert tools.starts["send_email"] == 1, "never started again"
    assert [r for r in seen.results if r["tool"] == "send_email"] == [
        {
            "tool": "send_email",
            "output": None,
            "interrupted": True,
            "partial": "started send_email;",
        }
    ]
    assert model.calls == 4, "the response the intent rode was reused"


async def test_crash_after_model_reuses_the_response(client: Client, engine: EngineServer) -> None:
    task, name = await start(client)
    model, tools = ScriptedModel(SCRIPT), Tools()
    handler = agent(model, tools, apart=True)  # so the response has a record of its own
    with Crasher("after_model", skip=1) as crash:

        def left() -> None:
            assert model.calls == 2

        await take_over(client, engine, task, name, handler, crash.hit.is_set, at_stop=left)
    assert model.calls == 4, "reused, not requested again"
    assert tools.starts == {"search": 2, "send_email": 1}


async def test_crash_after_commit_republishes(client: Client, engine: EngineServer) -> None:
    # The journal service answers iteration 1's commit and stops before it
    # publishes the event and releases the task; its worker is gone too. The
    # task comes back, the next claim finds the commit, republishes its event
    # and raises Committed. (A commit that keeps its task is answered after its
    # event: tests/test_held_dispatch.py.)
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    handler = agent(model, tools, seen)
    with Crasher("after_commit_stored", skip=1) as crash:
        async with Worker(
            engine.target, handlers={task: handler}, poll_wait=1.0, sticky_iterations=0
        ):
            run = await client.start_run(name)
            await wait_for(crash.hit.is_set, timeout=20)
        async with Worker(
            engine.target, handlers={task: handler}, poll_wait=1.0, sticky_iterations=0
        ):
            await finish(client, engine, run.run_id)
        # The stopped service goes on: its event is a duplicate, its ack a no-op.
        crash.release.set()
    assert seen.signals.count("Committed") == 1
    assert model.calls == 4 and tools.starts == {"search": 2, "send_email": 1}


async def test_a_settle_that_fails_after_the_commit_answered_is_redone_by_the_next_claim(
    client: Client, engine: EngineServer
) -> None:
    # The commit answers once stored; its event and the task's release follow.
    # Here publishing the event fails: the task comes back, and its next claim
    # finds the commit, republishes the event, and the run goes on.
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    failed: list[str] = []

    async def fail_once(point: str) -> None:
        if point == "after_commit_stored" and not failed:
            failed.append(point)
            raise nats.errors.TimeoutError

    seam.install(fail_once)
    try:
        async with Worker(engine.target, handlers={task: agent(model, tools, seen)}, poll_wait=1.0):
            run = await client.start_run(name)
            await finish(client, engine, run.run_id)
    finally:
        seam.install(None)
    assert failed and seen.signals.count("Committed") == 1
    assert model.calls == 4 and tools.starts == {"search": 2, "send_email": 1}


async def test_zombie_is_fenced_and_writes_nothing_after_its_successor(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = ConversationModel(), Tools(), Seen()  # asked again: same answer
    handler = agent(model, tools, seen)
    with Crasher("model_pending", skip=1) as stall:
        run_id = await fenced_after_stall(
            client,
            engine,
            task,
            name,
            handler,
            seen,
            stall,
            iteration=1,
            then=lambda run_id: finish(client, engine, run_id),
        )
    records = await read_journal(engine, run_id)
    # The zombie held iteration 1 as handed over and had stored nothing of it
    # (its claim rides its first record): its write after the successor's
    # claim is refused, so every record of the iteration is the successor's.
    (successor_claim,) = claims(records, 1)
    assert successor_claim.HasField("claim") and successor_claim.claim.delivery > 1
    assert {r.writer for r in records if r.iteration == 1} == {successor_claim.writer}
    assert tools.starts["send_email"] == 1


async def test_a_holder_fenced_before_its_model_call_does_not_spend_it(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    handler = agent(model, tools, seen)
    # The first holder stops between its claim of iteration 0 and its model
    # call, for longer than its claim stands for the tail (FRESH_TAIL): its
    # model call reads the tail, finds the successor's claim and asks nothing.
    with Crasher("after_claim") as stall:
        await fenced_after_stall(
            client,
            engine,
            task,
            name,
            handler,
            seen,
            stall,
            iteration=0,
            then=lambda run_id: finish(client, engine, run_id),
        )
    assert model.calls == 4, "the fenced holder asked the model nothing"


async def test_a_model_call_reads_the_tail_unless_the_holders_last_write_is_fresh(
    client: Client, engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[str] = []
    check_tail = JournalWriter.check_tail

    async def counted(writer: JournalWriter, token: jpb.WriterToken) -> None:
        checks.append(token.run_id)
        await check_tail(writer, token)

    monkeypatch.setattr(JournalWriter, "check_tail", counted)

    async def run_once(fresh: float) -> int:
        monkeypatch.setattr(sdk_journal, "FRESH_TAIL", fresh)
        task, name = await start(client)
        model, tools = ScriptedModel(SCRIPT), Tools()
        handler = agent(model, tools)
        async with Worker(
            engine.target, handlers={task: handler}, poll_wait=1.0, heartbeat_interval=NO_HEARTBEAT
        ):
            run = await client.start_run(name, {"ask": "weather"})
            await finish(client, engine, run.run_id)
        assert model.calls == 4
        return checks.count(run.run_id)

    # Each model call follows a write of its holder's: the claim of iteration
    # 0, then the commit that handed the next iteration over. Taken as fresh,
    # that write is the check and no model call reads the tail; taken as
    # stale, every model call does.
    assert await run_once(60.0) == 0
    assert await run_once(0.0) == 4


async def test_restart_limit_fails_the_attempt_and_the_retry_resumes(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(
        client, retry={"max_attempts": 2, "backoff": "fixed", "initial_delay": "100ms"}
    )
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    handler = agent(model, tools, seen)
    # Iteration 1 dies after every claim: first as handed over with iteration
    # 0's commit (nothing stored: its claim rides its first record), then
    # after the claims of deliveries 2, 3 and 4; the fifth delivery's claim
    # is the fifth delivery in a row without progress, and hits the limit.
    with Crasher("after_claim", skip=1, times=5) as crasher:
        async with Worker(
            engine.target,
            handlers={task: handler},
            poll_wait=1.0,
            concurrency=8,
            heartbeat_interval=NO_HEARTBEAT,
        ) as worker:
            run = await client.start_run(name)
            done = await client.wait_for_run(run.run_id, timeout=60)
            await worker.stop(grace=0)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert seen.signals.count("RestartLimit") == 1
    records = await read_journal(engine, run.run_id)
    failure = [r for r in records if r.HasField("commit") and r.commit.reason == "restart_limit"]
    assert len(failure) == 1 and failure[0].iteration == 1 and failure[0].attempt == 1
    assert failure[0].commit.error == "restart limit: 5 deliveries in a row without progress"
    stored = [r for r in claims(records, 1) if r.attempt == 1]
    assert [r.claim.delivery for r in stored] == [2, 3, 4, 5], (
        "the handed holder stored nothing; deliveries 2-4 crashed, the fifth hit the limit"
    )
    # Five holders died (the handed one, three redeliveries of attempt 1 and
    # the retry's first claim, once): the limit let no sixth delivery through.
    assert crasher.hits == 5
    assert steps_by_id(done)["agent"].iterations == 3
    assert model.calls == 4, "the retry resumed from the journal"
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == []


async def test_restart_limit_counts_a_first_deliverys_claim_made_with_its_lease(
    client: Client, engine: EngineServer
) -> None:
    """Iteration 0's first delivery is claimed as the engine leases it, and its
    claim rides the holder's first record. With a limit of 3, the holders of
    deliveries 1 and 2 die after their claims: the third delivery fails the
    step, with the reason in the run's error."""
    task, name = await start(client, retry={"max_attempts": 1})
    model, tools = ScriptedModel(SCRIPT), Tools()
    with Crasher("after_claim", times=3) as crasher:
        async with remote(
            engine, {task: agent(model, tools)}, heartbeat_interval=NO_HEARTBEAT, restart_limit=3
        ) as worker:
            run = await client.start_run(name)
            done = await client.wait_for_run(run.run_id, timeout=60)
            await worker.stop(grace=0)
    assert done.status == pb.RUN_STATUS_FAILED
    assert "restart limit: 3 deliveries in a row without progress" in done.error
    records = await read_journal(engine, run.run_id)
    assert [r.claim.delivery for r in claims(records, 0)] == [2, 3]
    assert crasher.hits == 2, "no fourth delivery was let through"
    assert model.calls == 0


async def test_late_redelivery_of_an_older_iteration_is_stale(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = ScriptedModel(SCRIPT), Tools(), Seen()
    async with Worker(engine.target, handlers={task: agent(model, tools, seen)}, poll_wait=1.0):
        run = await client.start_run(name)
        await finish(client, engine, run.run_id)
    # The task of iteration 1 arrives again, long after.
    import grpc.aio

    before = await read_journal(engine, run.run_id)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = jgrpc.JournalServiceStub(channel)
        late = await stub.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=1, attempt=1)
        )
    assert late.WhichOneof("outcome") == "settled" and late.settled.reason == "stale"
    after = await read_journal(engine, run.run_id)
    assert [r.seq for r in after] == [r.seq for r in before], "the stale claim wrote nothing"
    assert model.calls == 4 and tools.starts == {"search": 2, "send_email": 1}, "nothing ran"
