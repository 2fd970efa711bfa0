"""Forking a run from a record of its journal, and diffing two runs.

One source run of a two-step workflow (``prep``, then the journaled agent
loop ``agent``) is forked at a model record, at a tool result and inside its
unsafe tool's window (the intent stored, no result). Each fork replays the
copied records: the scripted models' calls and the tools' log show that
nothing before the fork point ran again; the fork that sets ``model=b``
reaches the handler as ``tc.settings``, and a steer reaches it as a placed
input. ``journal check`` is clean on every fork, and finds a copied prefix
that was altered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from dagnats.core import errors, seam
from dagnats.core.ids import new_run_id
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway.rundiff import run_diff
from dagnats.journal.fork import moved
from dagnats.journal.store import JournalStore
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import (
    Client,
    InputMode,
    JournalClient,
    Replay,
    TaskContext,
    ToolCall,
    ToolRun,
    Worker,
)
from dagnats.sdk.diff import format_diff
from dagnats.sdk.rpc import EngineRpc
from dagnats.sdk.testing import ScriptedModel
from tests.helpers import wait_for
from tests.test_cli import adagnats

pytestmark = pytest.mark.asyncio(loop_scope="module")

WORKFLOW = {
    "name": "fork-agent",
    "steps": [
        {"id": "prep", "task": "fork-prep"},
        {
            "id": "agent",
            "type": "agent_loop",
            "task": "fork-agent",
            "depends_on": ["prep"],
            "agent_loop": {"max_iterations": 5},
        },
    ],
}


class Harness:
    """The handlers, their models (one per setting) and the tools' log."""

    def __init__(self) -> None:
        self.models = {
            name: ScriptedModel([{"text": f"{name}{i}"} for i in range(100)]) for name in "ab"
        }
        self.tools: list[tuple[str, str, Any]] = []  # (run, tool, input) per start
        self.prep_runs: list[str] = []
        self.settings: dict[str, dict[str, str]] = {}

    async def prep(self, tc: TaskContext) -> None:
        self.prep_runs.append(tc.run_id)
        await tc.complete({"topic": tc.input["topic"]})

    async def agent(self, tc: TaskContext) -> None:
        self.settings[tc.run_id] = dict(tc.settings)
        model = self.models[tc.settings.get("model", "a")]
        j = await tc.journal()
        steers = [p.content for p in await j.place_inputs(InputMode.STEER)]
        first = await j.model(lambda: model([tc.run_id, tc.iteration, "first"]))

        async def tool(run: ToolRun) -> Any:
            self.tools.append((tc.run_id, run.call.name, run.call.input))
            return {"ran": run.call.name}

        call = ToolCall(name="search", input={"q": first["text"]})
        searched = await j.tool(call, Replay.SAFE, tool)
        sent = await j.tool(ToolCall(name="send", input={"to": "ops"}), Replay.UNSAFE, tool)
        second = await j.model(lambda: model([tc.run_id, tc.iteration, "second"]))
        state = await tc.load_checkpoint() or {"turns": []}
        send = "interrupted" if sent.interrupted else sent.output["ran"]
        state["turns"].append([first["text"], searched.output["ran"], send, second["text"]])
        await tc.checkpoint(state)
        out = {"turns": state["turns"], "steers": steers}
        if tc.iteration < 1:
            await tc.continue_(out, until_input=tc.settings.get("wait") == "input")
        else:
            await tc.complete(out)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(engine: EngineServer, client: Client) -> AsyncIterator[Harness]:
    h = Harness()
    await client.register_workflow(WORKFLOW)
    handlers = {"fork-prep": h.prep, "fork-agent": h.agent}
    async with Worker(engine.target, handlers=handlers, poll_wait=1.0):
        yield h


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def journal(engine: EngineServer) -> AsyncIterator[JournalClient]:
    async with JournalClient(engine.target) as j:
        yield j


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def source(harness: Harness, client: Client) -> pb.Run:
    run = await client.start_run("fork-agent", {"topic": "t"}, settings={"model": "a"})
    return await client.wait_for_run(run.run_id)


async def records(journal: JournalClient, run_id: str, step: str = "agent") -> list[jpb.Record]:
    return [r async for r in journal.read(run_id, step)]


def kinds(rs: list[jpb.Record]) -> list[str]:
    return [f"{r.seq}:{r.iteration}.{r.attempt}:{r.WhichOneof('kind')}" for r in rs]


async def test_source_runs_with_its_settings(
    source: pb.Run, harness: Harness, journal: JournalClient, client: Client
) -> None:
    # One WatchRun that starts a run carries its settings too.
    out = await client.run("fork-agent", {"topic": "s"}, settings={"model": "b"})
    assert all(turn[0].startswith("b") for turn in out["turns"])
    assert source.status == pb.RUN_STATUS_COMPLETED, source.error
    assert dict(source.settings) == {"model": "a"}
    assert harness.settings[source.run_id] == {"model": "a"}
    assert [r.WhichOneof("kind") for r in await records(journal, source.run_id)] == SHAPE


# The source's journal of ``agent``: per iteration, the first response with
# the safe tool's intent, its result, the unsafe tool's intent, its result,
# and the second response with the commit.
SHAPE = ["tool_intent", "tool_result", "tool_intent", "tool_result", "commit"] * 2


def asked(harness: Harness, run_id: str) -> dict[str, list[tuple[int, str]]]:
    """Each model's requests for ``run_id``: (iteration, which call)."""
    return {
        name: [(r[1], r[2]) for r in model.requests if r[0] == run_id]
        for name, model in harness.models.items()
    }


def started(harness: Harness, run_id: str) -> list[str]:
    return [name for run, name, _ in harness.tools if run == run_id]


async def fork(
    client: Client, source: pb.Run, journal: JournalClient, index: int, **changes: Any
) -> tuple[pb.Run, list[jpb.Record]]:
    """Fork ``source`` after its ``index``-th record of ``agent``; the
    ended fork and its journal."""
    at = (await records(journal, source.run_id))[index].seq
    answer = await client.fork_run(source.run_id, "agent", at, **changes)
    assert answer.created and answer.copied == index + 1
    assert answer.run.forked_from.run_id == source.run_id
    assert answer.run.forked_from.at_seq == at
    ended = await client.wait_for_run(answer.run.run_id)
    assert ended.status == pb.RUN_STATUS_COMPLETED, ended.error
    check = await journal.check(ended.run_id)
    assert list(check.violations) == []
    rs = await records(journal, ended.run_id)
    # Its first delivery claimed it: nothing was lost to a fenced first record.
    after = rs[index + 2 :]
    claims = [r.claim if r.HasField("claim") else r.leading_claim for r in after]
    assert [c.delivery for c in claims if c.delivery] == [1] * len(
        [c for c in claims if c.delivery]
    )
    assert rs[index + 1].HasField("fork")
    return ended, rs


async def test_fork_at_a_model_record_with_another_model(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient
) -> None:
    # Record 0 holds the first response (leading) and the safe tool's intent.
    forked, rs = await fork(client, source, journal, 0, settings={"model": "b"})
    assert harness.settings[forked.run_id] == {"model": "b"}
    assert dict(forked.settings) == {"model": "b"}
    # The first response is the source's; nothing asked model a again.
    assert asked(harness, forked.run_id) == {
        "a": [],
        "b": [(0, "second"), (1, "first"), (1, "second")],
    }
    # The safe tool's intent had no result in the prefix: it runs again.
    assert started(harness, forked.run_id) == ["search", "send", "search", "send"]
    turns = run_output(forked)["turns"]
    assert turns[0][0] == run_output(source)["turns"][0][0]
    assert turns[0][3].startswith("b") and turns[1][0].startswith("b")
    assert rs[1].WhichOneof("kind") == "fork"
    assert rs[1].fork.copied == 1 and rs[1].fork.run_id == source.run_id
    assert harness.prep_runs.count(forked.run_id) == 0  # carried over, not run


async def test_fork_at_a_tool_result(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient
) -> None:
    forked, _ = await fork(client, source, journal, 1)
    assert asked(harness, forked.run_id)["a"] == [(0, "second"), (1, "first"), (1, "second")]
    assert started(harness, forked.run_id) == ["send", "search", "send"]
    assert run_output(forked)["turns"][0][:2] == run_output(source)["turns"][0][:2]


async def test_fork_inside_the_unsafe_tools_window(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient
) -> None:
    # Record 2 is the unsafe tool's intent; its result is not copied.
    forked, rs = await fork(client, source, journal, 2)
    assert started(harness, forked.run_id) == ["search", "send"]  # iteration 1 only
    assert run_output(forked)["turns"][0][2] == "interrupted"
    results = [r for r in rs if r.WhichOneof("kind") == "tool_result" and r.tool_result.interrupted]
    assert len(results) == 1 and results[0].tool_result.intent_seq == rs[2].seq
    assert asked(harness, forked.run_id)["a"] == [(0, "second"), (1, "first"), (1, "second")]


async def test_fork_at_a_continue_with_a_steer_and_input(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient
) -> None:
    forked, _ = await fork(client, source, journal, 4, steer={"say": "left"}, input={"topic": "u"})
    out = run_output(forked)
    assert out["steers"] == [{"say": "left"}]
    assert out["turns"][0] == run_output(source)["turns"][0]  # the state of the commit
    assert asked(harness, forked.run_id)["a"] == [(1, "first"), (1, "second")]
    assert started(harness, forked.run_id) == ["search", "send"]
    assert json.loads(forked.input) == {"topic": "u"}


def run_output(run: pb.Run) -> Any:
    return json.loads(run.output)


async def test_diff_of_two_forks(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient, engine: EngineServer
) -> None:
    a, _ = await fork(client, source, journal, 1)
    b, _ = await fork(client, source, journal, 1, settings={"model": "b"})
    async with Client(engine.target) as c, JournalClient(engine.target) as j:
        found = await run_diff(c, j, a.run_id, b.run_id)
    agent = next(s for s in found["steps"] if s["step"] == "agent")
    # The copied model response, the search and its result, then the same
    # unsafe call and result (the same tool and input): five in common.
    assert agent["common"] == 5
    first = agent["rows"][0]
    assert first["a"]["kind"] == first["b"]["kind"] == "model"
    assert first["a"]["text"].startswith('model: {"text":"a')
    assert first["b"]["text"].startswith('model: {"text":"b')
    assert not found["outcome"]["same"]
    assert found["outcome"]["a"]["status"] == found["outcome"]["b"]["status"] == "completed"
    prep = next(s for s in found["steps"] if s["step"] == "prep")
    assert prep["same"]
    text = format_diff(found)
    assert "step agent: 5 entries in common" in text and "outcome b: completed" in text


async def test_bad_forks_are_refused(
    source: pb.Run, client: Client, journal: JournalClient, engine: EngineServer
) -> None:
    rs = await records(journal, source.run_id)
    other = "0" * 32
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"run_id": other}, errors.NotFound, "does not exist"),
        ({"step_id": "nope"}, errors.NotFound, "no step 'nope'"),
        ({"step_id": "prep"}, errors.InvalidArgument, "is not a record"),
        ({"at_seq": 0}, errors.InvalidArgument, "at_seq is required"),
        ({"at_seq": rs[-1].seq + 10_000}, errors.InvalidArgument, "is not a record"),
        ({"at_seq": rs[-1].seq}, errors.InvalidArgument, r"commit \(complete\) that ends the step"),
        ({"run_id": "nothex"}, errors.InvalidArgument, "run_id"),
        ({"step_id": "a.b"}, errors.InvalidArgument, "step_id"),
        ({"settings": {"a.b": "x"}}, errors.InvalidArgument, "settings name"),
        ({"settings": {"m": "x" * 1025}}, errors.InvalidArgument, "longer than 1024"),
        ({"steer": b"{"}, errors.InvalidArgument, "changes.steer"),
        ({"input": b"nope"}, errors.InvalidArgument, "changes.input"),
    ]
    rpc = EngineRpc(engine.target, timeout=10.0)
    try:
        for change, error, message in cases:
            fields: dict[str, Any] = {
                "run_id": source.run_id,
                "step_id": "agent",
                "at_seq": rs[0].seq,
                **change,
            }
            request = pb.ForkRunRequest(
                run_id=fields["run_id"],
                step_id=fields["step_id"],
                at_seq=fields["at_seq"],
                changes=pb.ForkChanges(
                    settings=fields.get("settings", {}),
                    steer=fields.get("steer", b""),
                    input=fields.get("input", b""),
                    has_input="input" in fields,
                ),
            )
            with pytest.raises(error, match=message):
                await rpc.fork_run(request)
    finally:
        await rpc.close()
    # A purged source is gone: its fork is refused as not found.
    done = await client.start_run("fork-agent", {"topic": "p"})
    done = await client.wait_for_run(done.run_id)
    at = (await records(journal, done.run_id))[0].seq
    await client.purge_run(done.run_id)
    with pytest.raises(errors.NotFound, match="does not exist"):
        await client.fork_run(done.run_id, "agent", at)


async def test_a_fork_stopped_half_way_is_finished_by_its_retry_and_an_altered_copy_is_found(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient, engine: EngineServer
) -> None:
    rs = await records(journal, source.run_id)
    stopped = asyncio.Event()

    async def crash(name: str) -> None:
        if name == "after_fork_first_copy" and not stopped.is_set():
            stopped.set()
            raise RuntimeError("crashed after the first copy")

    seam.install(crash)
    try:
        with pytest.raises(errors.DagnatsError):
            await client.fork_run(source.run_id, "agent", rs[2].seq, idempotency_key="half")
    finally:
        seam.install(None)
    # No run was stored: nothing of the half-copied journal can be claimed.
    listed = await client.list_runs(workflow="fork-agent", limit=100)
    assert len(listed) == len({r.run_id for r in listed})
    before = {r.run_id for r in listed}
    answer = await client.fork_run(source.run_id, "agent", rs[2].seq, idempotency_key="half")
    assert answer.created and answer.run.run_id not in before
    again = await client.fork_run(source.run_id, "agent", rs[2].seq, idempotency_key="half")
    assert not again.created and again.run.run_id == answer.run.run_id
    assert again.run.idempotency_key == "fork.half"
    ended = await client.wait_for_run(answer.run.run_id)
    assert ended.status == pb.RUN_STATUS_COMPLETED
    copied = await records(journal, ended.run_id)
    assert [r.WhichOneof("kind") for r in copied[:4]] == [*SHAPE[:3], "fork"]
    assert list((await journal.check(ended.run_id)).violations) == []
    assert asked(harness, ended.run_id)["a"] == [(0, "second"), (1, "first"), (1, "second")]

    # A copy altered between the crash and the retry: journal check finds it.
    store = JournalStore(engine.nc)
    target = new_run_id()
    first = moved(rs[0], target, {})
    seq = await store.append_copied(first, after=0, msg_id=f"{target}.agent.copy.0")
    altered = moved(rs[1], target, {rs[0].seq: seq})
    altered.tool_result.output = b'{"ran": "something else"}'
    await store.append_copied(altered, after=seq, msg_id=f"{target}.agent.copy.1")
    bound = await engine.engine.store.claim_run_key("fork-agent", "fork.altered", target)
    assert bound == target
    forged = await client.fork_run(source.run_id, "agent", rs[2].seq, idempotency_key="altered")
    assert forged.run.run_id == target
    await client.wait_for_run(target)
    check = await journal.check(target)
    assert [v.rule for v in check.violations] == ["fork_prefix"]
    assert "are not the ones it copied" in check.violations[0].message


async def test_fork_and_diff_over_rest(
    source: pb.Run, harness: Harness, http: httpx.AsyncClient, journal: JournalClient
) -> None:
    started = await http.post(
        "/runs",
        json={"workflow": "fork-agent", "input": {"topic": "r"}, "settings": {"model": "b"}},
    )
    assert started.status_code == 201 and started.json()["settings"] == {"model": "b"}
    bad = await http.post("/runs", json={"workflow": "fork-agent", "settings": {"a b": "x"}})
    assert bad.status_code == 400 and bad.json()["field"] == "settings name", bad.text
    # An HTTP worker reads the run's settings in the task the bridge leases it.
    await http.post(
        "/workflows", json={"name": "fork-bridge", "steps": [{"id": "s", "task": "fb"}]}
    )
    bridged = await http.post("/runs", json={"workflow": "fork-bridge", "settings": {"model": "c"}})
    polled = await http.post("/bridge/poll", json={"task_types": ["fb"], "wait": "10s"})
    assert polled.status_code == 200, polled.text
    assert polled.json()["tasks"][0]["task"]["settings"] == {"model": "c"}
    await http.post(f"/runs/{bridged.json()['run_id']}/cancel", json={})
    at = (await records(journal, source.run_id))[1].seq
    body = {"step_id": "agent", "at_seq": at, "settings": {"model": "b"}, "idempotency_key": "rest"}
    made = await http.post(f"/runs/{source.run_id}/fork", json=body)
    assert made.status_code == 201, made.text
    forked = made.json()
    assert forked["forked_from"] == {"run_id": source.run_id, "step_id": "agent", "at_seq": at}
    assert forked["copied"] == 2 and forked["settings"] == {"model": "b"}
    again = await http.post(f"/runs/{source.run_id}/fork", json=body)
    assert again.status_code == 200 and again.json()["run_id"] == forked["run_id"]
    ended = await wait_rest(http, forked["run_id"])
    assert ended["status"] == "completed"
    diff = await http.get(f"/runs/{source.run_id}/diff/{forked['run_id']}")
    assert diff.status_code == 200, diff.text
    agent = next(s for s in diff.json()["steps"] if s["step"] == "agent")
    assert agent["common"] == 5 and agent["rows"][0]["b"]["text"].startswith('model: {"text":"b')
    for url, payload, status, field in [
        (f"/runs/{source.run_id}/fork", {**body, "at_seq": 0}, 400, "at_seq"),
        (f"/runs/{source.run_id}/fork", {**body, "step_id": "x.y"}, 400, "step_id"),
        (f"/runs/{source.run_id}/fork", {**body, "step_id": "ghost"}, 404, "step_id"),
        (f"/runs/{'0' * 32}/fork", body, 404, "run_id"),
        ("/runs/nothex/fork", body, 400, "run_id"),
    ]:
        answer = await http.post(url, json={**payload, "idempotency_key": ""})
        assert answer.status_code == status, (url, payload, answer.text)
        assert field in answer.json().get("field", "") + answer.text
    bad_diff = await http.get(f"/runs/{source.run_id}/diff/nothex")
    assert bad_diff.status_code == 400 and bad_diff.json()["field"] == "other"
    missing = await http.get(f"/runs/{source.run_id}/diff/{'0' * 32}")
    assert missing.status_code == 404


async def wait_rest(http: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    found: dict[str, Any] = (await http.get(f"/runs/{run_id}", params={"wait": "10s"})).json()
    return found


async def test_fork_and_diff_from_the_cli(
    source: pb.Run, harness: Harness, engine: EngineServer, journal: JournalClient
) -> None:
    env = {"DAGNATS_ENGINE": engine.target}
    at = str((await records(journal, source.run_id))[4].seq)
    forked = await adagnats(
        "run",
        "fork",
        source.run_id,
        "--step",
        "agent",
        "--at",
        at,
        "--set",
        "model=b",
        "--steer",
        "go right",
        "--wait",
        "--json",
        env=env,
    )
    assert forked.returncode == 0, forked.stderr
    run = json.loads(forked.stdout)
    assert run["status"] == "completed" and run["settings"] == {"model": "b"}
    assert run["output"]["steers"] == ["go right"]
    refused = [
        (["run", "fork", source.run_id, "--step", "agent", "--at", "x"], "--at"),
        (
            ["run", "fork", source.run_id, "--step", "agent", "--at", at, "--set", "model"],
            "name=value",
        ),
        (["run", "diff", source.run_id, "nothex"], "run_b"),
        (["run", "start", "fork-agent", "--set", "a.b=c"], "--set name"),
    ]
    # Each command is a process of its own: run them side by side.
    shown, read, diff, *failed = await asyncio.gather(
        adagnats("run", "get", run["run_id"], env=env),
        adagnats("journal", "read", run["run_id"], "agent", env=env),
        adagnats("run", "diff", source.run_id, run["run_id"], env=env),
        *(adagnats(*args, env=env) for args, _ in refused),
    )
    assert f"forked    from run {source.run_id} step agent at seq {at}" in shown.stdout
    assert "settings  model=b" in shown.stdout
    assert f"5 records copied from run {source.run_id} step agent through seq {at}" in read.stdout
    assert diff.returncode == 0, diff.stderr
    assert "step agent: 7 entries in common" in diff.stdout
    assert "input steer" in diff.stdout and "outcome b: completed" in diff.stdout
    for (args, needle), result in zip(refused, failed, strict=True):
        assert result.returncode != 0 and needle in result.stderr, (args, result.stderr)


async def test_forks_sent_at_once_with_one_key_make_one_run_with_one_copy(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient
) -> None:
    at = (await records(journal, source.run_id))[3].seq
    answers = await asyncio.gather(
        *(client.fork_run(source.run_id, "agent", at, idempotency_key="at-once") for _ in range(4))
    )
    assert len({a.run.run_id for a in answers}) == 1
    run_id = answers[0].run.run_id
    await client.wait_for_run(run_id)
    rs = await records(journal, run_id)
    assert [r.WhichOneof("kind") for r in rs[:5]] == [*SHAPE[:4], "fork"]
    assert list((await journal.check(run_id)).violations) == []


async def test_a_running_run_is_forked_from_what_it_has_stored(
    harness: Harness, client: Client, journal: JournalClient
) -> None:
    run = await client.start_run("fork-agent", {"topic": "w"}, settings={"wait": "input"})

    async def waiting() -> bool:
        found = await client.get_run(run.run_id)
        return found.steps[1].waiting_for_input

    await wait_for(waiting, timeout=10, message="the source waits for an input")
    rs = await records(journal, run.run_id)
    answer = await client.fork_run(run.run_id, "agent", rs[1].seq, settings={"wait": ""})
    assert dict(answer.run.settings) == {}  # an empty value removes a setting
    forked = await client.wait_for_run(answer.run.run_id)
    assert forked.status == pb.RUN_STATUS_COMPLETED, forked.error
    assert list((await journal.check(forked.run_id)).violations) == []
    still = await client.get_run(run.run_id)
    assert still.status == pb.RUN_STATUS_RUNNING and still.steps[1].waiting_for_input
    await client.cancel_run(run.run_id)


async def test_a_fork_of_a_fork_copies_both_prefixes_and_checks_clean(
    source: pb.Run, harness: Harness, client: Client, journal: JournalClient
) -> None:
    first, rs = await fork(client, source, journal, 1, settings={"model": "b"})
    # After the first fork's own record: its claim, then its records; fork
    # at the unsafe tool's result, past the copies and the fork record.
    at = next(i for i, r in enumerate(rs) if r.HasField("tool_result") and i > 3)
    second, rs2 = await fork(client, first, journal, at)
    assert [r.HasField("fork") for r in rs2].count(True) == 2
    assert asked(harness, second.run_id)["b"] == [(0, "second"), (1, "first"), (1, "second")]
    assert started(harness, second.run_id) == ["search", "send"]
