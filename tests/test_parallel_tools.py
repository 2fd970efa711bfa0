"""Parallel tool calls end to end: a model response asking for several tools
runs them at once through ``j.tools``; every intent is stored before any call
starts, the results come back in the response's order, and a crash, a zombie
or a cancel inside the group repeats no finished call and starts no unsafe
call twice."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc.aio

from dagnats.cli.journal import record_line
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, Replay, TaskContext, ToolCall, ToolRun, run_output
from dagnats.sdk.testing import ScriptedModel
from tests.helpers import holds, wait_for
from tests.journal_agent import Crasher, Seen
from tests.stack import loop_workflow, unique
from tests.test_journal import (
    NO_HEARTBEAT,
    fenced_after_stall,
    journal_check,
    read_journal,
    remote,
    start,
)

# One response asks for three calls: two safe searches around an unsafe send.
GROUP = [
    {"tool": "search", "input": {"q": "weather"}},
    {"tool": "send_email", "input": {"to": "ops"}},
    {"tool": "search", "input": {"q": "news"}},
]
SCRIPT: list[dict[str, Any]] = [{"tools": GROUP}, {"answer": "done"}]


class GroupModel(ScriptedModel):
    """The script's reply for the conversation's turn, as from a
    deterministic model: a request asked again gets the same answer."""

    def __init__(self, script: list[dict[str, Any]] | None = None) -> None:
        super().__init__(script or SCRIPT)
        self.script = script or SCRIPT

    async def __call__(self, request: Any) -> Any:
        self.requests.append(copy.deepcopy(request))
        return copy.deepcopy(self.script[(len(request) - 1) // 2])


@dataclass
class GroupTools:
    """Tools that count their starts outside the journal. With ``together``
    set, no call returns before every call of the group has started: a group
    run one call at a time never finishes."""

    together: int = 0
    starts: Counter[str] = field(default_factory=Counter)
    keys: list[str] = field(default_factory=list)
    block: dict[str, asyncio.Event] = field(default_factory=dict)
    fail: set[str] = field(default_factory=set)
    hold_first: dict[str, int] = field(default_factory=dict)  # starts held for good
    report: bool = True  # each call reports its start as partial output
    _held: asyncio.Event = field(default_factory=asyncio.Event)
    _started: int = 0
    _all_started: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, run: ToolRun) -> Any:
        name = run.call.name
        self.starts[name] += 1
        self.keys.append(run.call.key)
        self._started += 1
        if self.together and self._started >= self.together:
            self._all_started.set()
        if self.report:
            await run.report(f"started {name};")
        if self.together:
            await self._all_started.wait()
        if name in self.block:
            await self.block[name].wait()
        if self.starts[name] <= self.hold_first.get(name, 0):
            await self._held.wait()  # a crashed holder's call: it never returns
        if name in self.fail:
            raise RuntimeError(f"{name} failed")
        return {"tool": name, "input": run.call.input}


def group_agent(model: GroupModel, tools: GroupTools, seen: Seen | None = None) -> Any:
    seen = seen or Seen()

    async def turn(tc: TaskContext) -> None:
        try:
            j = await tc.journal()
            history = await tc.load_checkpoint() or [tc.input]
            reply = await j.model(lambda: model(history))
            if "answer" in reply:
                await tc.checkpoint([*history, reply])
                await tc.complete(reply["answer"])
                return
            calls = [
                (
                    ToolCall(name=c["tool"], input=c["input"]),
                    Replay.SAFE if c["tool"] == "search" else Replay.UNSAFE,
                    tools.run,
                )
                for c in reply["tools"]
            ]
            results = await j.tools(calls)
            outcome = [
                {
                    "tool": c["tool"],
                    "output": r.output,
                    "error": r.error,
                    "interrupted": r.interrupted,
                    "partial": r.partial,
                }
                for c, r in zip(reply["tools"], results, strict=True)
            ]
            seen.results.extend(outcome)
            await tc.checkpoint([*history, reply, outcome])
            await tc.continue_()
        except BaseException as signal:
            seen.signals.append(type(signal).__name__)
            raise

    return turn


async def finished(client: Client, engine: EngineServer, run_id: str) -> pb.Run:
    run = await client.wait_for_run(run_id, timeout=40)
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    assert run_output(run) == "done"
    check = await journal_check(engine, run_id)
    assert list(check.violations) == [], check.violations
    return run


async def take_over(
    client: Client,
    engine: EngineServer,
    task: str,
    name: str,
    handler: Any,
    stopped: Callable[[], bool],
) -> str:
    """Start a run on a worker that sends no heartbeat; once ``stopped`` says
    its holder stopped, a successor takes the task over when the lease runs
    out and finishes the run. Returns the run's id."""
    async with remote(engine, {task: handler}, heartbeat_interval=NO_HEARTBEAT) as first:
        run = await client.start_run(name, {"ask": "weather"})
        await wait_for(stopped, timeout=20)
        async with remote(engine, {task: handler}):
            await first.stop(grace=0)
            await finished(client, engine, run.run_id)
    return run.run_id


def outputs(seen: Seen) -> list[Any]:
    return [r["output"] for r in seen.results]


async def test_a_group_runs_at_once_and_answers_in_the_responses_order(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    # No call reports: the three finish in one turn of the event loop.
    model, tools, seen = GroupModel(), GroupTools(together=3, report=False), Seen()
    async with remote(engine, {task: group_agent(model, tools, seen)}):
        run = await client.start_run(name, {"ask": "weather"})
        await finished(client, engine, run.run_id)
    assert tools.starts == {"search": 2, "send_email": 1}
    assert outputs(seen) == [{"tool": c["tool"], "input": c["input"]} for c in GROUP]
    assert len(set(tools.keys)) == 3, "each call keeps its own idempotency key"
    records = await read_journal(engine, run.run_id)
    (group,) = [r for r in records if r.HasField("tool_intents")]
    assert [i.name for i in group.tool_intents.intents] == [c["tool"] for c in GROUP]
    assert [i.position for i in group.tool_intents.intents] == [1, 2, 3]
    assert group.HasField("leading_model"), "the response rides the group's intents"
    results = [r for r in records if holds(r, "tool_result")]
    assert len(results) == 3
    assert all(r.seq > group.seq for r in results), "every intent before any result"
    printed = record_line(group).splitlines()  # as `dagnats journal show` prints it
    assert [line.split()[2] for line in printed] == [
        "claim",  # the first delivery's claim rides its first record
        "model",
        "tool_intent[0]",
        "tool_intent[1]",
        "tool_intent[2]",
    ]


async def test_a_tools_exception_is_its_own_result(client: Client, engine: EngineServer) -> None:
    task, name = await start(client)
    model, tools, seen = GroupModel(), GroupTools(fail={"send_email"}), Seen()
    async with remote(engine, {task: group_agent(model, tools, seen)}):
        run = await client.start_run(name, {"ask": "weather"})
        await finished(client, engine, run.run_id)
    assert [r["error"] for r in seen.results] == ["", "RuntimeError: send_email failed", ""]
    assert seen.results[0]["output"] == {"tool": "search", "input": {"q": "weather"}}


async def test_crash_after_the_groups_intents_runs_safe_calls_again_and_interrupts_unsafe(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = GroupModel(), GroupTools(), Seen()
    with Crasher("after_group_intents") as crash:
        await take_over(
            client, engine, task, name, group_agent(model, tools, seen), crash.hit.is_set
        )
    assert tools.starts == {"search": 2}, "the safe calls ran once, by the successor"
    assert [r["interrupted"] for r in seen.results] == [False, True, False]
    assert model.calls == 2, "the response that asked for the group was reused"


async def test_crash_between_results_reuses_the_stored_ones(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = GroupModel(), GroupTools(), Seen()
    tools.hold_first = {"search": 2}  # the send finishes first; the holder dies after it
    with Crasher("after_group_result") as crash:
        await take_over(
            client, engine, task, name, group_agent(model, tools, seen), crash.hit.is_set
        )
    assert tools.starts == {"search": 4, "send_email": 1}, "the unsafe call started once"
    (send,) = [r for r in seen.results if r["tool"] == "send_email"]
    assert send["output"] == {"tool": "send_email", "input": {"to": "ops"}}
    assert not send["interrupted"], "its stored result is reused"


async def test_crash_inside_an_unsafe_call_of_a_group_keeps_its_partial_output(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = GroupModel(), GroupTools(), Seen()
    tools.block["send_email"] = asyncio.Event()
    await take_over(
        client,
        engine,
        task,
        name,
        group_agent(model, tools, seen),
        lambda: tools.starts["search"] == 2 and tools.starts["send_email"] == 1,
    )
    tools.block["send_email"].set()
    assert tools.starts["send_email"] == 1, "started once, never again"
    (send,) = [r for r in seen.results if r["tool"] == "send_email"]
    assert send["interrupted"] and send["partial"] == "started send_email;"


async def test_a_zombie_inside_a_group_stores_no_result_after_its_successor(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = GroupModel(), GroupTools(), Seen()
    stall = Crasher("after_group_intents")
    with stall:

        async def check(run_id: str) -> None:
            await finished(client, engine, run_id)

        run_id = await fenced_after_stall(
            client,
            engine,
            task,
            name,
            group_agent(model, tools, seen),
            seen,
            stall,
            iteration=0,
            then=check,
        )
    records = await read_journal(engine, run_id)
    claims = [r for r in records if holds(r, "claim") and r.iteration == 0]
    zombie = claims[0].writer
    successor = max(r.seq for r in claims)
    assert not [r for r in records if r.writer == zombie and r.seq > successor], (
        "the fenced holder wrote nothing after its successor's claim"
    )
    # The zombie, let go after its intents were stored, starts its calls and
    # is fenced at its first result; its successor ran only the safe calls.
    assert tools.starts == {"search": 4, "send_email": 1}, "the unsafe call started once"
    (send,) = [r for r in seen.results if r["tool"] == "send_email"]
    assert send["interrupted"], "the successor did not run it again"


async def test_cancel_inside_a_group_answers_every_intent(
    client: Client, engine: EngineServer
) -> None:
    task, name = await start(client)
    model, tools, seen = GroupModel(), GroupTools(), Seen()
    tools.block = {"search": asyncio.Event(), "send_email": asyncio.Event()}
    async with remote(engine, {task: group_agent(model, tools, seen)}):
        run = await client.start_run(name, {"ask": "weather"})
        await wait_for(lambda: sum(tools.starts.values()) == 3, timeout=20)
        await client.cancel_run(run.run_id)
        ended = await client.wait_for_run(run.run_id, timeout=20)
        assert ended.status == pb.RUN_STATUS_CANCELLED
        await wait_for(lambda: "RunCancelled" in seen.signals or seen.signals, timeout=20)
    records = await read_journal(engine, run.run_id)
    (group,) = [r for r in records if r.HasField("tool_intents")]
    answered = {
        (r.tool_result.intent_seq, r.tool_result.intent_index)
        for r in records
        if r.HasField("tool_result")
    } | {
        (r.leading_tool_result.intent_seq, r.leading_tool_result.intent_index)
        for r in records
        if r.HasField("leading_tool_result")
    }
    assert answered == {(group.seq, i) for i in range(3)}, "each call's intent has a result"
    check = await journal_check(engine, run.run_id)
    assert list(check.violations) == [], check.violations


async def test_a_retry_honours_each_unsafe_call_of_the_earlier_attempts_group_once(
    client: Client, engine: EngineServer
) -> None:
    # Attempt 1 runs a group of two identical unsafe sends to the end; the
    # engine's retry (attempt 2) asks for the same group: each call is
    # honoured by one earlier intent, with its result, and none runs; a third
    # identical send after them has no earlier intent left and runs.
    send = jpb.ToolCallSpec(name="send", input=b'{"to": "ops"}', replay=jpb.REPLAY_UNSAFE)
    async with grpc.aio.insecure_channel(engine.target) as channel:
        journal = jgrpc.JournalServiceStub(channel)
        name, task = unique("honourwf"), unique("honour")
        await client.register_workflow(loop_workflow(name, task))
        run = await client.start_run(name, "go")
        first = await journal.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
        )
        begun = await journal.BeginTools(
            jpb.BeginToolsRequest(token=first.claimed.token, position=0, calls=[send, send])
        )
        token = begun.token
        for n, call in enumerate(begun.calls):
            assert call.run
            finished = await journal.FinishTool(
                jpb.FinishToolRequest(
                    token=token,
                    intent_seq=call.intent_seq,
                    intent_index=call.intent_index,
                    output=f'{{"n": {n}}}'.encode(),
                )
            )
            token = finished.token
        retry = await journal.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=2)
        )
        again = await journal.BeginTools(
            jpb.BeginToolsRequest(token=retry.claimed.token, position=0, calls=[send, send])
        )
        assert [c.run for c in again.calls] == [False, False]
        assert [c.result.output for c in again.calls] == [b'{"n": 0}', b'{"n": 1}']
        honoured = {(m.seq, m.index) for m in again.token.honoured_members}
        assert honoured == {(begun.calls[0].intent_seq, 0), (begun.calls[0].intent_seq, 1)}
        third = await journal.BeginTool(
            jpb.BeginToolRequest(
                token=again.token, position=2, name="send", input=send.input, replay=send.replay
            )
        )
        assert third.run, "each earlier intent is honoured once"
