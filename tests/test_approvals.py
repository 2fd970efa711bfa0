"""Approvals of a tool call, bound to its arguments, end to end: a tool that
needs approval waits holding no worker, an approval of other arguments is
refused and changes nothing, approve runs the tool once, deny gives the model
the denial as the tool's result, and edited arguments run instead."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from dagnats.core.approvals import call_digest, canonical_json
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, Worker
from tests.approval_agents import EMAIL, GROUP, approval_agent, group_agent
from tests.helpers import wait_for
from tests.matrix import APPROVAL_SEAMS, CASES, MATRIX, activate, child_env, lines, reap
from tests.stack import FAST, loop_workflow, steps_by_id, unique
from tests.test_cli import adagnats
from tests.test_journal import journal_check, read_journal
from tests.test_journal_api import as_its_worker, refused_field


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: Any) -> AsyncIterator[EngineServer]:
    """The module's engine, with the crash matrix's one-second leases: a
    holder stopped at a seam loses its task a second after its last heartbeat."""
    server = await start_engine(nats_server.url, config=MATRIX)
    yield server
    await server.stop()


async def start(client: Client, task: str) -> str:
    name = unique("approvewf")
    await client.register_workflow(loop_workflow(name, task))
    return (await client.start_run(name, "send the invoice")).run_id


async def waiting(http: httpx.AsyncClient, run_id: str) -> list[dict[str, Any]]:
    answer = await http.get(f"/runs/{run_id}/steps/agent/approvals")
    assert answer.status_code == 200, answer.text
    approvals: list[dict[str, Any]] = answer.json()["approvals"]
    return approvals


async def step_waits_for_input(client: Client, run_id: str) -> bool:
    step = steps_by_id(await client.get_run(run_id))["agent"]
    return step.status == pb.STEP_STATUS_WAITING and step.waiting_for_input


async def asked(client: Client, http: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    """The one call waiting, once the step waits for its approval."""
    await wait_for(lambda: step_waits_for_input(client, run_id), timeout=20)
    [call] = await waiting(http, run_id)
    return call


@contextlib.asynccontextmanager
async def a_call_waiting(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> AsyncIterator[tuple[str, dict[str, Any], list[Any]]]:
    """A run of :func:`approval_agent` with a worker, once its call waits:
    the run, the call as listed, and the inputs the tool ran with."""
    task, runs = unique("approve"), list[Any]()
    async with Worker(engine.target, handlers={task: approval_agent(runs)}):
        run_id = await start(client, task)
        yield run_id, await asked(client, http, run_id), runs


async def ended(client: Client, run_id: str) -> pb.Run:
    async def done() -> bool:
        return (await client.get_run(run_id)).status != pb.RUN_STATUS_RUNNING

    await wait_for(done, timeout=20)
    return await client.get_run(run_id)


def output_of(run: pb.Run) -> Any:
    return json.loads(steps_by_id(run)["agent"].output)


async def decide(
    http: httpx.AsyncClient, run_id: str, call: dict[str, Any], decision: str, **fields: Any
) -> httpx.Response:
    """POST the approvals of the run's step: ``decision`` on ``call`` as listed."""
    body = {"call": call["call"], "digest": call["digest"], "decision": decision, **fields}
    return await http.post(f"/runs/{run_id}/steps/agent/approvals", json=body)


async def approved_intents(engine: EngineServer, run_id: str) -> list[jpb.ToolIntent]:
    records = await read_journal(engine, run_id, "agent")
    return [
        r.tool_intent
        for r in records
        if r.WhichOneof("kind") == "tool_intent" and r.tool_intent.HasField("approval")
    ]


async def test_an_approval_of_the_digest_runs_the_tool_once(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    async with a_call_waiting(client, http, engine) as (run_id, call, runs):
        assert call["tool"] == "send_email" and call["args"] == EMAIL
        assert call["digest"] == call_digest("send_email", canonical_json(EMAIL))
        assert runs == []  # waiting: the tool did not run
        answer = await decide(http, run_id, call, "approve", approver="alice")
        assert answer.status_code == 201, answer.text
        run = await ended(client, run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert output_of(run) == {"output": {"sent": True, "to": EMAIL["to"]}, "error": ""}
    assert runs == [EMAIL]
    [intent] = await approved_intents(engine, run_id)
    assert (intent.approval.approver, intent.approval.approved) == ("alice", True)
    assert intent.approval.call == call["call"] and intent.approval.digest == call["digest"]
    assert intent.digest == call["digest"] and intent.approval.decided_at.seconds > 0
    assert list((await journal_check(engine, run_id)).violations) == []
    assert await waiting(http, run_id) == []


async def test_an_approval_of_other_arguments_is_refused_and_changes_nothing(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    async with a_call_waiting(client, http, engine) as (run_id, call, runs):
        path = f"/runs/{run_id}/steps/agent/approvals"
        other = call_digest("send_email", canonical_json({**EMAIL, "to": "eve@example.com"}))
        refused = await decide(http, run_id, {**call, "digest": other}, "approve")
        assert refused.status_code == 409, refused.text
        assert "not the ones approved" in refused.json()["message"]
        unknown = call["call"].rsplit(".", 1)[0] + ".99"
        missing = await decide(http, run_id, {**call, "call": unknown}, "approve")
        assert missing.status_code == 404, missing.text
        for bad in (
            {"call": "not-a-key", "digest": call["digest"], "decision": "approve"},
            {"call": call["call"], "digest": "md5:abc", "decision": "approve"},
            {"call": call["call"], "digest": call["digest"], "decision": "maybe"},
            {"call": call["call"], "digest": call["digest"], "decision": "deny", "args": {}},
        ):
            answer = await http.post(path, json=bad)
            assert answer.status_code == 400, (bad, answer.text)
        no_run = await http.post(
            f"/runs/{run_id[:-1]}x/steps/agent/approvals",
            json={"call": call["call"], "digest": call["digest"], "decision": "approve"},
        )
        assert no_run.status_code in (400, 404), no_run.text
        inputs = await http.get(f"/runs/{run_id}/steps/agent/inputs")
        assert inputs.json()["inputs"] == []  # nothing was queued
        assert await step_waits_for_input(client, run_id)
        assert runs == [] and await waiting(http, run_id) == [call]
        await client.cancel_run(run_id)


async def test_a_denial_reaches_the_model_as_the_tools_result(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    async with a_call_waiting(client, http, engine) as (run_id, call, runs):
        answer = await decide(
            http, run_id, call, "deny", reason="not to external addresses", approver="bob"
        )
        assert answer.status_code == 201, answer.text
        run = await ended(client, run_id)
    assert runs == []  # the tool never ran
    denial = {"denied": True, "reason": "not to external addresses"}
    assert output_of(run) == {"output": denial, "error": ""}
    [intent] = await approved_intents(engine, run_id)
    assert (intent.approval.approved, intent.approval.approver) == (False, "bob")
    assert list((await journal_check(engine, run_id)).violations) == []


async def test_edited_arguments_are_a_new_intent_approved_by_the_act(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    async with a_call_waiting(client, http, engine) as (run_id, call, runs):
        edited = {**EMAIL, "to": "billing@example.com"}
        answer = await decide(http, run_id, call, "approve", args=edited)
        assert answer.status_code == 201, answer.text
        new_digest = call_digest("send_email", canonical_json(edited))
        assert answer.json()["digest"] == new_digest and answer.json()["edited"]
        run = await ended(client, run_id)
    assert runs == [edited]
    assert output_of(run)["output"] == {"sent": True, "to": "billing@example.com"}
    [intent] = await approved_intents(engine, run_id)
    assert intent.digest == new_digest and intent.approval.edited
    assert intent.approval.digest == call["digest"]
    assert list((await journal_check(engine, run_id)).violations) == []


async def test_the_journal_refuses_an_approval_of_another_digest(engine: EngineServer) -> None:
    """A worker cannot store a call under an approval given for other
    arguments, nor a digest that is not its call's: refused whole, nothing
    written."""
    async with as_its_worker(engine, "approvejournal") as (run, stub):
        claimed = await stub.Claim(
            jpb.ClaimRequest(run_id=run.run_id, step_id="agent", iteration=0, attempt=1)
        )
        token = claimed.claimed.token
        data = canonical_json(EMAIL)
        digest = call_digest("send_email", data)
        other = call_digest("send_email", canonical_json({**EMAIL, "to": "eve"}))
        key = f"{run.run_id}.agent.0.0"

        def begin(**fields: Any) -> Any:
            return stub.BeginTool(
                jpb.BeginToolRequest(
                    token=token, position=0, name="send_email", input=data,
                    replay=jpb.REPLAY_UNSAFE, **fields,
                )
            )  # fmt: skip

        approval = jpb.Approval(call=key, digest=other, approved=True)
        assert await refused_field(begin(digest=digest, approval=approval)) == "approval.digest"
        assert await refused_field(begin(digest=other)) == "digest"
        elsewhere = jpb.Approval(call=f"{run.run_id}.other.0.0", digest=digest, approved=True)
        assert await refused_field(begin(digest=digest, approval=elsewhere)) == "approval.call"
        assert await refused_field(begin(approval=approval)) == "digest"
        records = await read_journal(engine, run.run_id, "agent")
        assert [r.WhichOneof("kind") for r in records] == ["claim"]


# ---- crashes and restarts -----------------------------------------------------------

APPROVAL_WORKER = Path(__file__).parent / "workers" / "approval_worker.py"


def approval_worker(
    target: str, task: str, state: Path, stop_at: str = "", *flags: str
) -> subprocess.Popen[bytes]:
    """:mod:`tests.workers.approval_worker` in a process of its own; ``flags``
    as its usage says (``--group``, ``--standby``, ``--journal TARGET``...)."""
    state.mkdir(exist_ok=True)
    args = [sys.executable, str(APPROVAL_WORKER), target, task, str(state), stop_at, *flags]
    with open(state / "worker.log", "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env())


async def test_a_waiting_approval_survives_the_worker_and_a_restart_of_every_service(
    nats_server: Any, tmp_path: Path
) -> None:
    """The step waits holding no worker and nothing in memory: the worker is
    killed and every service restarted while it waits, and the approval
    given afterwards runs the tool once."""
    task = unique("approverestart")
    engine = await start_engine(nats_server.url, config=FAST)
    worker = approval_worker(engine.target, task, tmp_path / "a")
    try:
        async with Client(engine.target) as client:
            run_id = await start(client, task)
            await wait_for(lambda: step_waits_for_input(client, run_id), timeout=30)
        worker.kill()
        worker.wait()
        await engine.stop()
        engine = await start_engine(nats_server.url, config=FAST)
        gateway = await start_gateway(GatewayConfig(engine_target=engine.target, port=0))
        worker = approval_worker(engine.target, task, tmp_path / "b")
        try:
            async with (
                Client(engine.target) as client,
                httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http,
            ):
                call = await asked(client, http, run_id)
                answer = await decide(http, run_id, call, "approve")
                assert answer.status_code == 201, answer.text
                run = await ended(client, run_id)
        finally:
            await gateway.stop()
    finally:
        reap(worker)
        await engine.stop()
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert lines(tmp_path / "a", "runs") == [] and len(lines(tmp_path / "b", "runs")) == 1


async def test_the_cli_lists_refuses_another_digest_and_approves(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    env = {"DAGNATS_ENGINE": engine.target}
    async with a_call_waiting(client, http, engine) as (run_id, call, runs):
        listed = await adagnats("run", "approvals", run_id, "--step", "agent", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == [call]
        text = await adagnats("run", "approvals", run_id, "--step", "agent", env=env)
        assert call["call"] in text.stdout and '"bob@example.com"' in text.stdout
        other = call_digest("send_email", canonical_json({**EMAIL, "to": "eve@example.com"}))
        base = ("--step", "agent", "--call", call["call"])
        refused = await adagnats("run", "approve", run_id, *base, "--digest", other, env=env)
        assert refused.returncode == 1 and "not the ones approved" in refused.stderr
        assert runs == [] and await waiting(http, run_id) == [call]
        approved = await adagnats(
            "run", "approve", run_id, *base, "--digest", call["digest"], "--approver", "dana",
            env=env,
        )  # fmt: skip
        assert approved.returncode == 0, approved.stderr
        assert f"approved {call['call']} with digest {call['digest']}" in approved.stdout
        run = await ended(client, run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED and runs == [EMAIL]
    [intent] = await approved_intents(engine, run_id)
    assert intent.approval.approver == "dana"


async def test_the_cli_denies_with_a_reason_for_the_digest_it_shows(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    env = {"DAGNATS_ENGINE": engine.target}
    async with a_call_waiting(client, http, engine) as (run_id, call, runs):
        denied = await adagnats(
            "run", "deny", run_id, "--step", "agent", "--call", call["call"],
            "--reason", "wrong recipient", env=env,
        )  # fmt: skip
        assert denied.returncode == 0, denied.stderr
        assert '"bob@example.com"' in denied.stdout  # the arguments it decided on
        run = await ended(client, run_id)
    assert runs == []
    assert output_of(run)["output"] == {"denied": True, "reason": "wrong recipient"}


# ---- a call of a parallel group that needs approval ---------------------------------------


@contextlib.asynccontextmanager
async def a_group_waiting(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> AsyncIterator[tuple[str, dict[str, Any], list[tuple[str, Any]]]]:
    """A run of :func:`group_agent` with a worker, once its third call waits."""
    task, runs = unique("approvegroup"), list[tuple[str, Any]]()
    async with Worker(engine.target, handlers={task: group_agent(runs)}):
        run_id = await start(client, task)
        yield run_id, await asked(client, http, run_id), runs


async def group_intents(engine: EngineServer, run_id: str) -> list[jpb.ToolIntent]:
    records = await read_journal(engine, run_id, "agent")
    return [
        intent
        for r in records
        if r.WhichOneof("kind") == "tool_intents"
        for intent in r.tool_intents.intents
    ]


async def test_a_group_runs_its_other_calls_while_one_waits_then_the_approved_one_once(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    async with a_group_waiting(client, http, engine) as (run_id, call, runs):
        # Waiting, holding no worker: the two others ran once, the third not.
        assert (call["tool"], call["args"]) == ("send_email", EMAIL)
        assert call["digest"] == call_digest("send_email", canonical_json(EMAIL))
        assert sorted(runs) == sorted(GROUP[:2])
        intents = await group_intents(engine, run_id)
        assert [(i.name, bool(i.digest)) for i in intents] == [
            ("lookup", False),
            ("attach", False),
            ("send_email", True),
        ]
        answer = await decide(http, run_id, call, "approve", approver="alice")
        assert answer.status_code == 201, answer.text
        run = await ended(client, run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert output_of(run) == [{"done": "lookup"}, {"done": "attach"}, {"done": "send_email"}]
    assert sorted(runs) == sorted(GROUP)  # each tool ran once
    [decided] = [i for i in await group_intents(engine, run_id) if i.HasField("approval")]
    assert (decided.name, decided.approval.approver) == ("send_email", "alice")
    assert decided.approval.digest == call["digest"]
    assert list((await journal_check(engine, run_id)).violations) == []


async def test_a_denied_call_of_a_group_gives_the_denial_as_its_result(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    async with a_group_waiting(client, http, engine) as (run_id, call, runs):
        answer = await decide(http, run_id, call, "deny", reason="not today", approver="bob")
        assert answer.status_code == 201, answer.text
        run = await ended(client, run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED
    denial = {"denied": True, "reason": "not today"}
    assert output_of(run) == [{"done": "lookup"}, {"done": "attach"}, denial]
    assert sorted(runs) == sorted(GROUP[:2])  # the denied tool never ran
    assert list((await journal_check(engine, run_id)).violations) == []


async def test_two_calls_of_a_group_waiting_are_both_named_and_each_approved_on_its_own(
    client: Client, http: httpx.AsyncClient, engine: EngineServer
) -> None:
    task, runs = unique("approvetwo"), list[tuple[str, Any]]()
    needs = frozenset({"attach", "send_email"})
    async with Worker(engine.target, handlers={task: group_agent(runs, needs)}):
        run_id = await start(client, task)
        await wait_for(lambda: step_waits_for_input(client, run_id), timeout=20)
        calls = await waiting(http, run_id)
        assert [c["tool"] for c in calls] == ["attach", "send_email"]
        assert runs == [GROUP[0]]  # only the call needing none ran
        output = json.loads(steps_by_id(await client.get_run(run_id))["agent"].output)
        assert [w["call"] for w in output["awaiting_approvals"]] == [c["call"] for c in calls]
        for call in calls:
            assert (await decide(http, run_id, call, "approve")).status_code == 201
        run = await ended(client, run_id)
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert output_of(run) == [{"done": "lookup"}, {"done": "attach"}, {"done": "send_email"}]
    assert sorted(runs) == sorted(GROUP)
    assert list((await journal_check(engine, run_id)).violations) == []


# ---- the approval seams' crash matrix -----------------------------------------------


async def approve_once_asked(
    client: Client, http: httpx.AsyncClient, run_id: str
) -> dict[str, Any]:
    call = await asked(client, http, run_id)
    answer = await decide(http, run_id, call, "approve", approver="carol")
    assert answer.status_code == 201, answer.text
    return call


async def stopped_at(
    client: Client,
    http: httpx.AsyncClient,
    target: str,
    state: Path,
    seam: str,
    mode: str,
    records: Callable[[str], Awaitable[list[jpb.Record]]],
    *flags: str,
) -> tuple[str, pb.Run]:
    """Run an approval agent whose holder stops at ``seam`` and is killed
    (``kill``) or frozen past its lease (``stall``); a standby successor
    finishes the run, the approval given when its call waits. A frozen
    holder is thawed once the run ended, and must write nothing more to the
    step's journal (``records``). Returns the run's id and the run."""
    task = unique("approvematrix")
    holder = approval_worker(target, task, state / "a", seam, *flags)
    successor = approval_worker(target, task, state / "b", "", "--standby", *flags)
    try:
        run_id = await start(client, task)
        asks = seam == "after_approval_intent"  # stopped before the step waits
        if not asks:
            await approve_once_asked(client, http, run_id)
        await wait_for(lambda: (state / "a" / "hit").exists(), timeout=30, message=seam)
        holder.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        await activate(successor, state / "b", "clean")
        if asks:
            await approve_once_asked(client, http, run_id)
        run = await ended(client, run_id)
        if mode == "stall":
            written = len(await records(run_id))
            holder.send_signal(signal.SIGCONT)
            # Thawed, it learns a successor holds the step: its write is
            # fenced, or its keep-alive finds the successor's claim and stops it.
            await wait_for(
                lambda: lines(state / "a", "turns")[-1:] in (["Fenced"], ["CancelledError"]),
                timeout=30,
                message="the thawed holder's turn stops",
            )
            after = len(await records(run_id))
            assert after == written, "the thawed holder wrote nothing more"
    finally:
        reap(holder, successor)
    return run_id, run


def approved_once(records: list[jpb.Record]) -> None:
    """The approval is recorded once, on the call's one approved intent."""
    intents = [r.tool_intent for r in records if r.HasField("tool_intent")]
    intents += [i for r in records if r.HasField("tool_intents") for i in r.tool_intents.intents]
    [decided] = [i for i in intents if i.HasField("approval")]
    assert (decided.name, decided.approval.approver) == ("send_email", "carol")
    assert decided.approval.approved and decided.digest == decided.approval.digest


def assert_call_outcome(seam: str, mode: str, output: Any, expected: Any, starts: int) -> None:
    """What the approved call ends with: its holder stopped before the
    approved intent was stored, the crash-free answer and one start; after
    it, the intent answered interrupted and never run by the successor (a
    frozen holder, thawed, may start it before its first write is fenced)."""
    if seam.startswith("after_approval"):
        assert (output, starts) == (expected, 1)
    elif seam == "approved_tool_returned":
        assert (output, starts) == (None, 1)  # it ran; its holder stopped before storing it
    else:
        assert output is None
        assert starts <= (1 if mode == "stall" else 0), f"the approved tool started {starts} times"


def assert_group_others(
    seam: str, outputs: list[Any], starts: dict[str, int], records: list[jpb.Record]
) -> None:
    """The group's two other calls: stopped after their iteration, each ran
    once and its result is the answer's. Stopped while the group asked, the
    safe call ran again only if its holder's result was not stored, and the
    unsafe one at most once, interrupted when it has none."""
    lookup, attach, _ = outputs
    if seam != "after_approval_intent":
        assert (lookup, attach) == ({"done": "lookup"}, {"done": "attach"})
        assert (starts["lookup"], starts["attach"]) == (1, 1)
        return
    group = next(r for r in records if r.HasField("tool_intents"))
    stored = {
        r.tool_result.intent_index: r
        for r in records
        if r.HasField("tool_result") and r.tool_result.intent_seq == group.seq
    }
    assert lookup == {"done": "lookup"}
    assert starts["lookup"] == (1 if stored[0].writer == group.writer else 2)
    assert starts["attach"] <= 1
    if stored[1].tool_result.interrupted:
        assert attach is None
    else:
        assert (attach, starts["attach"]) == ({"done": "attach"}, 1)


@pytest.mark.parametrize("mode", ["kill", "stall"])
@pytest.mark.parametrize(
    ("shape", "seam"), [(shape, seam) for shape, seams in APPROVAL_SEAMS.items() for seam in seams]
)
async def test_an_approval_keeps_its_guarantees_with_its_holder_stopped_at_each_seam(
    shape: str,
    seam: str,
    mode: str,
    client: Client,
    http: httpx.AsyncClient,
    engine: EngineServer,
    tmp_path: Path,
) -> None:
    """The holder of the step killed (SIGKILL), or frozen past its lease and
    thawed (SIGSTOP, SIGCONT), at each approval seam, with the call alone or
    the third of a parallel group: the crash-free answer, the approved tool
    started at most once, the group's safe call run again only when its
    result was not stored and its unsafe call at most once, the approval
    recorded once, a clean journal, and a thawed holder fenced."""
    group = shape == "group"

    def records(run_id: str) -> Awaitable[list[jpb.Record]]:
        return read_journal(engine, run_id, "agent")

    flags = ("--group",) if group else ()
    run_id, run = await stopped_at(
        client, http, engine.target, tmp_path, seam, mode, records, *flags
    )
    CASES["one server", f"{seam}/approval {shape}/{mode}"] += 1
    assert run.status == pb.RUN_STATUS_COMPLETED, run.error
    started = lines(tmp_path / "a", "runs") + lines(tmp_path / "b", "runs")
    journal = await records(run_id)
    approved_once(journal)
    assert list((await journal_check(engine, run_id)).violations) == []
    expected: Any = {"done": "send_email"} if group else {"sent": True, "to": EMAIL["to"]}
    if not group:
        assert_call_outcome(seam, mode, output_of(run)["output"], expected, len(started))
        return
    outputs = output_of(run)
    starts = {name: sum(line.startswith(f"('{name}',") for line in started) for name, _ in GROUP}
    assert_call_outcome(seam, mode, outputs[2], expected, starts["send_email"])
    assert_group_others(seam, outputs, starts, journal)
