"""Replay against new code before deploying: ``dagnats journal export`` and
``dagnats.sdk.testing.replay``.

Runs are recorded once per module on a real stack (a worker of the module's
engine, three iterations each: a model call, a tool call, from the second a
parallel group, the state carried by the commits); then new handler code is
replayed against their journals, read from the deployment or from exported
files, with no model and no tool called: an unchanged handler passes, a
changed call order is reported at its position with both calls.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from dagnats.cli.main import main
from dagnats.core.errors import InvalidArgument
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Client, JournalClient, Replay, TaskContext, ToolCall, ToolRun, Worker
from dagnats.sdk.export import VERSION, read_export
from dagnats.sdk.testing import Deployment, replay
from tests.approval_agents import approval_agent, group_agent
from tests.stack import loop_workflow, unique
from tests.test_approvals import asked, decide, ended, start

RUNS = 100
ITERATIONS = 3


def agent(
    counts: collections.Counter[str],
    *,
    change: str = "",
    last: int = ITERATIONS - 1,
    flaky: bool = False,
) -> Any:
    """The recorded handler, or new code with one ``change``: ``swapped``
    (the tool before the model), ``renamed`` (another tool), ``extra`` (one
    more model call), ``extra_tool`` (one more tool call), ``fewer`` (no tool
    call). ``last`` is the iteration that
    completes; ``flaky``: the first attempt's model call fails."""

    async def think(tc: TaskContext) -> Any:
        counts["model"] += 1
        if flaky and tc.attempt == 1:
            raise RuntimeError("the model is overloaded")
        return {"say": "thinking"}

    async def lookup(run: ToolRun) -> Any:
        counts["tool"] += 1
        return {"found": run.call.input}

    async def handler(tc: TaskContext) -> None:
        journal = await tc.journal()
        seen = (await tc.load_checkpoint() or {}).get("seen", [])
        name = "search" if change == "renamed" else "lookup"
        call = ToolCall(name=name, input={"q": tc.input["q"], "seen": len(seen)})
        if change == "swapped":
            await journal.tool(call, Replay.SAFE, lookup)
        reply = await journal.model(lambda: think(tc))
        if change not in ("swapped", "fewer"):
            await journal.tool(call, Replay.SAFE, lookup)
        if tc.iteration >= 1:
            pair = [(ToolCall(name="fetch", input={"i": i}), Replay.SAFE, lookup) for i in range(2)]
            await journal.tools(pair)
        if change == "extra":
            await journal.model(lambda: think(tc))
        if change == "extra_tool":
            await journal.tool(ToolCall(name="notify", input={}), Replay.UNSAFE, lookup)
        await tc.append_state("seen", [reply["say"]])
        if tc.iteration >= last:
            await tc.complete({"turns": tc.iteration + 1})
        else:
            await tc.continue_({"turn": tc.iteration})

    return handler


class Recorded:
    def __init__(
        self, workflow: str, task: str, run_ids: list[str], counts: collections.Counter[str]
    ) -> None:
        self.workflow, self.task, self.run_ids, self.counts = workflow, task, run_ids, counts


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def recorded(engine: EngineServer, client: Client) -> AsyncIterator[Recorded]:
    """``RUNS`` runs of the handler, completed, recorded on the module's engine."""
    workflow, task = unique("replayed"), TASK
    await client.register_workflow(loop_workflow(workflow, task))
    counts: collections.Counter[str] = collections.Counter()
    async with Worker(engine.target, handlers={task: agent(counts)}, concurrency=32, poll_wait=1.0):
        started = [await client.start_run(workflow, {"q": f"question {i}"}) for i in range(RUNS)]
        ended = await asyncio.gather(*(client.wait_for_run(r.run_id, timeout=120) for r in started))
    assert all(r.status == pb.RUN_STATUS_COMPLETED for r in ended), [r.error for r in ended]
    yield Recorded(workflow, task, [r.run_id for r in started], counts)


async def test_an_unchanged_handler_replays_every_recorded_run_without_a_model_or_tool(
    engine: EngineServer, recorded: Recorded
) -> None:
    counts: collections.Counter[str] = collections.Counter()
    source = Deployment(engine.target, workflow=recorded.workflow, limit=RUNS)
    report = await replay(source, {recorded.task: agent(counts)})
    assert report.ok, "\n".join(report.lines())
    assert (report.runs, report.dispatches) == (RUNS, RUNS * ITERATIONS)
    assert counts == {}, "the replay called a model or a tool"


async def test_a_changed_call_order_is_reported_at_its_position_with_both_calls(
    engine: EngineServer, recorded: Recorded
) -> None:
    counts: collections.Counter[str] = collections.Counter()
    run_id = recorded.run_ids[0]
    source = Deployment(engine.target, run_ids=[run_id])
    report = await replay(source, {recorded.task: agent(counts, change="swapped")})
    assert not report.ok
    assert counts == {}
    first = report.divergences[0]
    assert (first.run_id, first.step_id, first.iteration, first.position) == (run_id, "agent", 0, 0)
    assert first.kind == "different_call"
    assert first.recorded == "a model call"
    assert first.asked.startswith("tool 'lookup'")
    assert len(report.divergences) == ITERATIONS  # each iteration's dispatch, at its position 0


async def test_a_handler_that_ends_sooner_diverges_at_its_commit(
    engine: EngineServer, recorded: Recorded
) -> None:
    source = Deployment(engine.target, run_ids=[recorded.run_ids[1]])
    report = await replay(source, agent(collections.Counter(), last=1))
    [changed] = report.divergences
    assert (changed.iteration, changed.kind) == (1, "different_commit")
    assert (changed.recorded, changed.asked) == ("a continue commit", "a complete commit")


@pytest.mark.parametrize(
    ("change", "position", "kind", "was", "asked"),
    [
        ("renamed", 1, "different_call", "tool 'lookup'", "tool 'search'"),
        ("extra", 2, "unrecorded_call", "nothing: the calls end at position 1", "a model"),
        ("extra_tool", 2, "unrecorded_call", "nothing: the calls end at position 1", "tool 'n"),
        ("fewer", 1, "missing_calls", "tool 'lookup'", "a continue commit"),
    ],
    ids=["renamed", "extra", "extra_tool", "fewer"],
)
async def test_each_change_is_named_with_what_was_recorded_and_what_was_asked(
    engine: EngineServer,
    recorded: Recorded,
    change: str,
    position: int,
    kind: str,
    was: str,
    asked: str,
) -> None:
    source = Deployment(engine.target, run_ids=[recorded.run_ids[5]])
    counts: collections.Counter[str] = collections.Counter()
    report = await replay(source, agent(counts, change=change))
    assert counts == {}, "the replay called a model or a tool"
    first = report.divergences[0]
    assert (first.iteration, first.position, first.kind) == (0, position, kind)
    assert first.recorded.startswith(was) and first.asked.startswith(asked)


async def test_a_failed_attempt_replays_to_its_recorded_end_and_its_retry_in_full(
    engine: EngineServer, client: Client
) -> None:
    workflow, task = unique("flaky"), unique("flaky")
    retry = {"max_attempts": 2, "backoff": "fixed", "initial_delay": "10ms", "max_delay": "10ms"}
    await client.register_workflow(loop_workflow(workflow, task, retry=retry))
    handler = agent(collections.Counter(), last=0, flaky=True)
    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
        run = await client.start_run(workflow, {"q": "again"})
        done = await client.wait_for_run(run.run_id, timeout=60)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    report = await replay(Deployment(engine.target, run_ids=[run.run_id]), handler)
    # Attempt 1 failed in its model call, which the journal never stored: its
    # replay stops there. Attempt 2 is replayed through its commit.
    assert report.ok, report.lines()
    assert (report.dispatches, report.unfinished) == (2, 1)


@pytest.mark.parametrize("make", [approval_agent, group_agent], ids=["alone", "in-a-group"])
async def test_a_run_that_waited_for_an_approval_replays_its_ask_and_its_approved_call(
    engine: EngineServer, client: Client, http: httpx.AsyncClient, make: Any
) -> None:
    task = unique("approved")
    async with Worker(engine.target, handlers={task: make([])}, poll_wait=1.0):
        run_id = await start(client, task)
        call = await asked(client, http, run_id)
        assert (await decide(http, run_id, call, "approve", approver="carol")).status_code == 201
        done = await ended(client, run_id)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    ran: list[Any] = []
    report = await replay(Deployment(engine.target, run_ids=[run_id]), make(ran))
    # The iteration that asked and waited, then the one the approval woke.
    assert report.ok, report.lines()
    assert report.dispatches == 2 and ran == []


async def test_an_exported_file_replays_as_the_run_did(
    engine: EngineServer, recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = recorded.run_ids[2]
    path = tmp_path / f"{run_id}.jsonl"
    assert await export(engine, run_id, path) == 0
    exported = read_export(path.read_text().splitlines(), source=str(path))
    async with JournalClient(engine.target) as journal:
        stored = [r async for r in journal.read(run_id, "agent")]
    assert [r.SerializeToString() for r in exported.steps[0].records] == [
        r.SerializeToString() for r in stored
    ]
    assert exported.steps[0].input == {"q": "question 2"}
    report = await replay(tmp_path, {recorded.task: agent(collections.Counter())})
    assert report.ok and report.dispatches == ITERATIONS, report.lines()
    # The command CI runs: zero for the unchanged handler, one for the changed order.
    capsys.readouterr()
    assert await cli(["journal", "replay", str(path), "--handlers", NEW_CODE_SPEC]) == 0
    assert (
        await cli(["journal", "replay", str(path), "--handlers", NEW_CODE_SPEC + "_SWAPPED"]) == 1
    )
    out = capsys.readouterr().out
    assert f"run {run_id} step agent iteration 0 attempt 1 position 0: different_call" in out
    assert "recorded a model call; the new code asked for tool 'lookup'" in out
    swapped = ["journal", "replay", str(path), "--handlers", NEW_CODE_SPEC + "_SWAPPED", "--json"]
    assert await cli(swapped) == 1
    found = json.loads(capsys.readouterr().out)
    assert (found["runs"], found["dispatches"]) == (1, ITERATIONS)
    assert [(d["iteration"], d["position"], d["kind"]) for d in found["divergences"]] == [
        (i, 0, "different_call") for i in range(ITERATIONS)
    ]


async def test_a_run_replays_with_the_settings_it_ran_with(
    engine: EngineServer, client: Client, tmp_path: Path
) -> None:
    """A handler that reads ``tc.settings`` is given the recorded run's: its
    call at position 0 is the one the run made, not the default's."""

    async def lookup(run: ToolRun) -> Any:
        return {"found": run.call.input}

    async def chooses(tc: TaskContext) -> None:
        journal = await tc.journal()
        call = ToolCall(name=tc.settings.get("tool", "lookup"), input={})
        await journal.tool(call, Replay.SAFE, lookup)
        await tc.complete({"used": call.name})

    workflow, task = unique("replayed-settings"), unique("settings-agent")
    await client.register_workflow(loop_workflow(workflow, task))
    async with Worker(engine.target, handlers={task: chooses}, poll_wait=1.0):
        run = await client.start_run(workflow, {"q": "x"}, settings={"tool": "search"})
        done = await client.wait_for_run(run.run_id, timeout=60)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    path = tmp_path / f"{run.run_id}.jsonl"
    assert await export(engine, run.run_id, path) == 0
    assert read_export(path.read_text().splitlines()).settings == {"tool": "search"}
    report = await replay(path, {task: chooses})
    assert report.ok and report.dispatches == 1, report.lines()


# The handlers ``dagnats journal replay --handlers`` loads, by task type.
TASK = "replay-agent"
NEW_CODE = {TASK: agent(collections.Counter())}
NEW_CODE_SWAPPED = {TASK: agent(collections.Counter(), change="swapped")}
NEW_CODE_SPEC = "tests.test_journal_replay:NEW_CODE"


async def test_the_http_export_is_the_files_bytes(
    engine: EngineServer, recorded: Recorded, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    run_id = recorded.run_ids[3]
    path = tmp_path / "run.jsonl"
    assert await export(engine, run_id, path) == 0
    answer = await http.get(f"/runs/{run_id}/journal/export")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    assert answer.content == path.read_bytes()


async def test_a_missing_run_or_journal_is_a_clear_error(
    engine: EngineServer,
    client: Client,
    http: httpx.AsyncClient,
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = "0" * 32
    answer = await http.get(f"/runs/{missing}/journal/export")
    assert answer.status_code == 404
    assert (await http.get("/runs/NOT-A-RUN/journal/export")).status_code == 400
    workflow, task = unique("plain"), unique("plain")
    await client.register_workflow(loop_workflow(workflow, task))

    async def plain(tc: TaskContext) -> None:
        await tc.complete("done")  # no journal

    async with Worker(engine.target, handlers={task: plain}, poll_wait=1.0):
        run = await client.run(workflow, {"q": 1}, timeout=60)
    plain_id = (await client.list_runs(workflow=workflow, limit=1))[0].run_id
    assert run == "done"
    answer = await http.get(f"/runs/{plain_id}/journal/export")
    assert answer.status_code == 404
    assert "has no journal" in answer.json()["message"]
    capsys.readouterr()
    assert await cli(["journal", "export", plain_id, "--engine", engine.target]) == 1
    assert f"run {plain_id} has no journal" in capsys.readouterr().err


async def test_fields_a_newer_writer_adds_are_ignored(
    engine: EngineServer, recorded: Recorded, tmp_path: Path
) -> None:
    path = tmp_path / "newer.jsonl"
    assert await export(engine, recorded.run_ids[6], path) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[0]["settings"] = {"model": "another"}
    for line in lines[1:-1]:
        line["record"]["attested"] = True
        if "model" in line["record"]:
            line["record"]["model"]["usage"] = {"input_tokens": 12, "output_tokens": 3}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = await replay(path, agent(collections.Counter()))
    assert report.ok and report.dispatches == ITERATIONS, report.lines()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda lines: lines[:-1], "cut short"),
        (lambda lines: ["not json", *lines[1:]], "not a dagnats journal export"),
        (lambda lines: [_header(lines[0], version=VERSION + 1), *lines[1:]], "version 2 is not"),
        (lambda lines: [lines[0], "{]", *lines[1:]], "line 2: not JSON"),
        (lambda lines: [], "the file is empty"),
    ],
    ids=["cut-short", "not-an-export", "unknown-version", "corrupt-line", "empty"],
)
async def test_a_damaged_export_is_refused_naming_the_file_and_line(
    engine: EngineServer,
    recorded: Recorded,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Any,
    message: str,
) -> None:
    good = tmp_path / "good.jsonl"
    assert await export(engine, recorded.run_ids[4], good) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(f"{line}\n" for line in damage(good.read_text().splitlines())))
    with pytest.raises(InvalidArgument, match=message) as raised:
        await replay(bad, agent(collections.Counter()))
    assert str(bad) in raised.value.message
    capsys.readouterr()
    assert await cli(["journal", "replay", str(bad), "--handlers", NEW_CODE_SPEC]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}") and message in err


async def export(engine: EngineServer, run_id: str, path: Path) -> int:
    return await cli(["journal", "export", run_id, "-o", str(path), "--engine", engine.target])


async def cli(args: list[str]) -> int:
    """``dagnats ARGS`` (``main``, in a thread: it runs an event loop of its own)."""
    return await asyncio.to_thread(main, args)


def _header(line: str, **changes: Any) -> str:
    return json.dumps({**json.loads(line), **changes})
