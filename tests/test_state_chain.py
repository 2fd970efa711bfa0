"""Conversations of any length: the journal stores what a turn adds.

A commit stores the step's state as a delta against the commit before it
(what the turn appended), with a snapshot every so many deltas or bytes while
the state fits a record; a claim rebuilds the state from one snapshot and the
deltas after it, and a worker that keeps its task holds the state in memory.
The rules are pure (``dagnats.core.statechain``) and tested first; then a
conversation on the in-process stack, a claim rebuilding the state after a
failed attempt, a state past the size setting refused with its size, and the
state at any commit read by the journal RPC and the REST endpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagnats.cli.handlers import in_process_worker
from dagnats.core import statechain as sc
from dagnats.core.errors import InvalidArgument
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal import audit, convert
from dagnats.journal import service as journal_service
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, JournalClient, TaskContext, Worker
from dagnats.sdk import _context as sdk_context
from dagnats.sdk._state import HeldState, HeldStates, chain_of, store
from tests.helpers import wait_for
from tests.stack import loop_workflow, unique
from tests.test_journal import journal_check

SETTINGS = sc.ChainSettings(snapshot_every=4, snapshot_bytes=1000, snapshot_max_bytes=10_000)


# ---- the rules ------------------------------------------------------------------------


def test_a_first_state_is_a_snapshot() -> None:
    plan = sc.plan_state(None, sc.Delta(keep=0, tail=b"[1]"), SETTINGS)
    assert plan == sc.WriteSnapshot(sc.Chain(size=3))


def test_a_turn_that_appends_stores_a_delta_one_further_from_the_snapshot() -> None:
    plan = sc.plan_state(
        sc.Chain(size=10, depth=1, delta_bytes=5), sc.Delta(keep=9, tail=b",2]"), SETTINGS
    )
    assert plan == sc.WriteDelta(
        sc.Delta(keep=9, tail=b",2]"), sc.Chain(size=12, depth=2, delta_bytes=8)
    )


def test_a_snapshot_every_n_deltas_or_m_bytes() -> None:
    by_count = sc.plan_state(sc.Chain(size=10, depth=3), sc.Delta(keep=9, tail=b",2]"), SETTINGS)
    assert by_count == sc.WriteSnapshot(sc.Chain(size=12))
    by_bytes = sc.plan_state(
        sc.Chain(size=900, depth=1, delta_bytes=998), sc.Delta(keep=899, tail=b",2]"), SETTINGS
    )
    assert by_bytes == sc.WriteSnapshot(sc.Chain(size=902))


def test_a_state_past_a_record_goes_on_in_deltas() -> None:
    big = sc.Chain(size=20_000, depth=3, delta_bytes=5000)
    plan = sc.plan_state(big, sc.Delta(keep=19_999, tail=b",2]"), SETTINGS)
    assert isinstance(plan, sc.WriteDelta) and plan.chain.depth == 4


def test_a_state_past_the_setting_is_refused_with_its_size() -> None:
    settings = sc.ChainSettings(state_max_bytes=100)
    plan = sc.plan_state(sc.Chain(size=90), sc.Delta(keep=90, tail=b"x" * 20), settings)
    assert plan == sc.StateOverLimit(110, 100)
    assert "the state is 110 bytes" in plan.message()


def test_diff_keeps_the_common_prefix() -> None:
    before = json.dumps({"messages": ["a" * 200_000, "b"], "n": 1}).encode()
    after = json.dumps({"messages": ["a" * 200_000, "b", "c"], "n": 2}).encode()
    delta = sc.diff(before, after)
    assert before[: delta.keep] + delta.tail == after
    assert len(delta.tail) < 30, "only what follows the last shared byte"
    assert sc.diff(b"abc", b"abc") == sc.Delta(keep=3, tail=b"")
    assert sc.diff(b"", b"x") == sc.Delta(keep=0, tail=b"x")


def test_rebuild_applies_the_deltas_in_order() -> None:
    deltas = [
        sc.StoredDelta(delta=sc.Delta(keep=2, tail=b",2]"), size=5, depth=1),
        sc.StoredDelta(delta=sc.Delta(keep=4, tail=b",3]"), size=7, depth=2),
    ]
    assert sc.rebuild(b"[1]", deltas) == sc.Rebuilt(b"[1,2,3]")


@pytest.mark.parametrize(
    ("delta", "why"),
    [
        (sc.StoredDelta(delta=sc.Delta(keep=9, tail=b"]"), size=10, depth=1), "keeps 9 bytes"),
        (sc.StoredDelta(delta=sc.Delta(keep=2, tail=b"]"), size=9, depth=1), "its commit says 9"),
        (sc.StoredDelta(delta=sc.Delta(keep=2, tail=b"]"), size=3, depth=2), "it is delta 1"),
    ],
)
def test_a_delta_that_does_not_apply_breaks_the_chain(delta: sc.StoredDelta, why: str) -> None:
    result = sc.rebuild(b"[1]", [delta])
    assert isinstance(result, sc.ChainBroken) and result.index == 0
    assert why in sc.describe(result)


# ---- the worker's held state ----------------------------------------------------------


def test_append_writes_only_what_follows_the_list() -> None:
    held = HeldState(json.dumps({"n": 0, "messages": ["a"]}).encode(), sc.Chain(size=24))
    held.append("messages", ["b"], {"n": 1})  # lays the state out: the list first
    commit = jpb.Commit()
    store(held, commit, SETTINGS)
    held.committed(chain_of(commit), 7)
    assert held.is_at(7)
    before = bytes(held.data)
    held.append("messages", ["c", {"d": 1}], {"n": 2})
    assert json.loads(bytes(held.data)) == {"messages": ["a", "b", "c", {"d": 1}], "n": 2}
    assert held.value() == {"messages": ["a", "b", "c", {"d": 1}], "n": 2}
    delta = held.delta()
    assert before[: delta.keep] + delta.tail == bytes(held.data)
    assert delta.tail == b',"c",{"d":1}],"n":2}'
    commit = jpb.Commit()
    store(held, commit, SETTINGS)
    assert commit.HasField("state_delta") and not commit.state
    # The first append laid the state out anew (delta 1); this is delta 2.
    assert commit.state_delta.depth == 2 and commit.state_delta.size == len(held.data)


def test_a_held_state_serves_only_the_commit_it_is_at() -> None:
    held = HeldState(b'{"messages":[]}', sc.Chain(size=15))
    held.committed(sc.Chain(size=15), 10)
    states = HeldStates(max_bytes=100)
    states.put("r", "s", held)
    assert states.take("r", "s", 11) is None, "another commit's state"
    states.put("r", "s", held)
    assert states.take("r", "s", 10) is held
    assert states.take("r", "s", 10) is None, "taken once"
    held.append("messages", [1], {})  # changed since its commit
    states.put("r", "s", held)
    assert states.take("r", "s", 10) is None
    states.put("r", "s", HeldState(b"1" * 60, None))
    states.put("r", "t", HeldState(b"2" * 60, None))
    assert states.take("r", "s", 0) is None, "the oldest went to keep 100 bytes"


def test_append_needs_an_object_with_a_list() -> None:
    with pytest.raises(InvalidArgument, match="JSON object"):
        HeldState(b"[1]", sc.Chain(size=3)).append("messages", [2], {})
    with pytest.raises(InvalidArgument, match="not a list"):
        HeldState(b'{"messages":1}', sc.Chain(size=14)).append("messages", [2], {})


def test_the_audit_finds_a_delta_that_does_not_apply() -> None:
    def record(seq: int, base: int, commit: jpb.Commit) -> jpb.Record:
        r = jpb.Record(run_id="r", step_id="s", iteration=seq, writer="w", seq=seq, base_seq=base)
        r.expected_seq = seq - 1
        r.commit.CopyFrom(commit)
        return r

    snapshot = jpb.Commit(action=jpb.ACTION_CONTINUE, has_state=True, state=b"[1]")
    good = jpb.StateDelta(keep=2, tail=b",2]", size=5, depth=1, chain_bytes=3)
    bad = jpb.StateDelta(keep=9, tail=b",3]", size=12, depth=2, chain_bytes=6)
    records = [
        record(1, 0, snapshot),
        record(2, 1, jpb.Commit(action=jpb.ACTION_CONTINUE, has_state=True, state_delta=good)),
    ]
    assert audit.check_step("s", convert.all_entries(records)) == []
    records.append(
        record(3, 2, jpb.Commit(action=jpb.ACTION_CONTINUE, has_state=True, state_delta=bad))
    )
    found = audit.check_step("s", convert.all_entries(records))
    assert [(f.seq, f.rule) for f in found] == [(3, "state_chain")], found
    assert "keeps 9 bytes of the 5" in found[0].message


# ---- on the stack ---------------------------------------------------------------------

TURN = 40  # bytes a turn adds


async def _records(engine: EngineServer, run_id: str) -> list[jpb.Record]:
    async with JournalClient(engine.target) as journal:
        return [r async for r in journal.read(run_id, "agent")]


async def _converse(
    client: Client,
    engine: EngineServer,
    turns: int,
    handler: Any,
    *,
    over_grpc: bool = False,
    **step: Any,
) -> pb.Run:
    task, name = unique("convo"), unique("convowf")
    await client.register_workflow(loop_workflow(name, task, max_iterations=turns + 5, **step))
    handlers = {task: handler}
    worker = (
        Worker(engine.target, handlers=handlers, poll_wait=1.0, local_socket="off")
        if over_grpc
        else in_process_worker(engine, handlers, concurrency=2, poll_wait=1.0)
    )
    async with worker:
        run = await client.start_run(name, input={"turns": turns})
        return await client.wait_for_run(run.run_id, timeout=120)


def _conversation(turns: int, fail_at: int = -1) -> Any:
    failed: set[int] = set()

    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        state = await tc.load_checkpoint()
        n = len(state["messages"]) if state is not None else 0
        assert n == tc.iteration, f"iteration {tc.iteration} found {n} messages"
        if tc.iteration == fail_at and fail_at not in failed:
            failed.add(fail_at)
            raise RuntimeError("a crash mid-conversation")
        await tc.append_state("messages", [f"{n:06d}" + "m" * (TURN - 6)], turns=n + 1)
        if n + 1 >= turns:
            await tc.complete({"messages": n + 1})
        else:
            await tc.continue_()

    return handler


async def test_a_long_conversation_stores_what_each_turn_adds(
    client: Client, engine: EngineServer
) -> None:
    turns = 2000
    done = await _converse(client, engine, turns, _conversation(turns))
    assert done.status == pb.RUN_STATUS_COMPLETED, done
    records = await _records(engine, done.run_id)
    commits = [r for r in records if r.HasField("commit")]
    assert len(commits) == turns
    deltas = [c for c in commits if c.commit.HasField("state_delta")]
    snapshots = [c for c in commits if c.commit.state]
    whole = len(
        json.dumps({"messages": ["m" * TURN] * turns, "turns": turns}, separators=(",", ":"))
    )
    # What a delta commit stores is what its turn appended, not the history.
    assert max(len(c.commit.state_delta.tail) for c in deltas) <= TURN + 30
    assert len(snapshots) <= turns // sc.SNAPSHOT_EVERY + 2
    # A delta commit's record is its turn's bytes and a constant rest, at the
    # end of a history of 2,000 turns as at its start.
    largest = max(c.ByteSize() for c in deltas)
    assert largest < TURN + 512 < whole // 100, largest
    snapshot_bytes = sum(len(c.commit.state) for c in snapshots)
    assert snapshot_bytes < whole * turns // sc.SNAPSHOT_EVERY, "the snapshots' share is bounded"
    assert (await journal_check(engine, done.run_id)).violations == []
    async with JournalClient(engine.target) as journal:
        state = json.loads(await journal.state(done.run_id, "agent") or b"")
        middle = json.loads(
            await journal.state(done.run_id, "agent", at_seq=deltas[500].seq) or b""
        )
    assert len(state["messages"]) == turns and state["turns"] == turns
    assert state["messages"][-1].startswith(f"{turns - 1:06d}")
    assert len(middle["messages"]) == middle["turns"] == deltas[500].iteration + 1


async def test_a_claim_rebuilds_the_state_from_its_chain(
    client: Client, engine: EngineServer
) -> None:
    # A failed attempt ends the kept task; the retry's claim reads the state
    # back from the journal: the last snapshot and the deltas after it.
    turns = 12
    retry = {"max_attempts": 3, "backoff": "fixed", "initial_delay": "100ms"}
    done = await _converse(client, engine, turns, _conversation(turns, fail_at=7), retry=retry)
    assert done.status == pb.RUN_STATUS_COMPLETED, done
    records = await _records(engine, done.run_id)
    base = next(r for r in records if r.HasField("commit") and r.iteration == 6)
    assert base.commit.HasField("state_delta"), "the claim had deltas to apply"
    assert (await journal_check(engine, done.run_id)).violations == []


async def test_a_state_larger_than_a_claims_answer_is_read_with_read_state(
    client: Client, engine: EngineServer
) -> None:
    # 50 turns of 100 KB: a 5 MB state, past a record, a claim's answer and
    # what a gRPC client receives, stored in deltas; a failed attempt at the
    # end makes the retry claim it, over gRPC.
    big = 100_000
    seen: list[int] = []
    failed: list[int] = []

    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        state = await tc.load_checkpoint() or {"messages": []}
        seen.append(sum(len(m) for m in state["messages"]))
        if tc.iteration == 50 and not failed:
            failed.append(tc.iteration)
            raise RuntimeError("a crash after 50 turns")
        if tc.iteration == 51:
            await tc.complete(len(state["messages"]))
            return
        await tc.append_state("messages", ["x" * big])
        await tc.continue_()

    retry = {"max_attempts": 3, "backoff": "fixed", "initial_delay": "100ms"}
    done = await _converse(client, engine, 55, handler, over_grpc=True, retry=retry)
    assert done.status == pb.RUN_STATUS_COMPLETED, done
    assert seen[-2:] == [50 * big, 51 * big], seen[-3:]
    assert (await journal_check(engine, done.run_id)).violations == []


async def test_a_state_past_the_size_setting_fails_the_step_with_its_size(
    client: Client, engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk_context, "CHAIN_SETTINGS", sc.ChainSettings(state_max_bytes=5000))

    async def handler(tc: TaskContext) -> None:
        await tc.journal()
        await tc.append_state("messages", ["y" * 1000])
        await tc.continue_()

    done = await _converse(client, engine, 20, handler)
    assert done.status == pb.RUN_STATUS_FAILED, done
    assert "the state is 5,0" in done.error and "at most 5,000 bytes" in done.error, done.error
    assert "restart limit" not in done.error


async def test_the_journal_refuses_a_commit_past_the_size_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    commit = jpb.Commit(
        action=jpb.ACTION_CONTINUE,
        has_state=True,
        state_delta=jpb.StateDelta(keep=90, tail=b"x" * 20, size=110, depth=1),
    )
    from dagnats.core.errors import StateTooLarge

    with pytest.raises(StateTooLarge, match="the state is 110 bytes"):
        journal_service._check_state(commit, 100)
    commit.state_delta.size = 111
    with pytest.raises(InvalidArgument, match="says 111"):
        journal_service._check_state(commit, 1000)


async def test_rest_answers_the_state_at_a_commit(
    client: Client, engine: EngineServer, http: httpx.AsyncClient
) -> None:
    turns = 5
    done = await _converse(client, engine, turns, _conversation(turns))
    records = await _records(engine, done.run_id)
    second = [r for r in records if r.HasField("commit")][1]
    got = await http.get(f"/runs/{done.run_id}/steps/agent/state", params={"at": second.seq})
    assert got.status_code == 200, got.text
    assert got.json()["state"]["turns"] == 2 and len(got.json()["state"]["messages"]) == 2
    last = await http.get(f"/runs/{done.run_id}/steps/agent/state")
    assert last.json()["state"]["turns"] == turns
    bad = await http.get(f"/runs/{done.run_id}/steps/agent/state", params={"at": -1})
    assert bad.status_code == 400
    past = records[-1].seq + 1000  # no record there, so no commit of this step
    no_commit = await http.get(f"/runs/{done.run_id}/steps/agent/state", params={"at": past})
    assert no_commit.status_code == 404, no_commit.text
    assert "no commit" in no_commit.json()["message"]
    shown = await http.get(f"/runs/{done.run_id}/steps/agent/journal")
    kinds = [r["commit"] for r in shown.json()["records"] if r["kind"] == "commit"]
    assert any("state_delta" in c and c["state_delta"]["tail"].endswith("}") for c in kinds)


# ---- a worker killed or frozen mid-conversation -------------------------------------


def _conversation_worker(
    target: str, task: str, turns: int, stop_at: int, marker: Path
) -> subprocess.Popen[bytes]:
    script = Path(__file__).parent / "workers" / "conversation_worker.py"
    args = [sys.executable, str(script), target, task, str(turns), str(stop_at), str(marker)]
    with open(f"{marker}.log", "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("mode", ["kill", "stall"])
async def test_a_successor_rebuilds_the_state_of_a_worker_stopped_mid_conversation(
    client: Client, engine: EngineServer, tmp_path: Path, mode: str
) -> None:
    # 300 turns of 2 KB; the holder stops at turn 230, deep in a chain of
    # deltas (a snapshot every 64), after appending and before committing.
    turns, stop_at = 300, 230
    task, name = unique("convokill"), unique("convokillwf")
    await client.register_workflow(loop_workflow(name, task, max_iterations=turns + 5))
    marker = tmp_path / "stopped"
    holder = _conversation_worker(engine.target, task, turns, stop_at, marker)
    successor: subprocess.Popen[bytes] | None = None
    try:
        run = await client.start_run(name)
        await wait_for(marker.exists, timeout=90, message="the holder never reached its stop")
        if mode == "kill":
            holder.kill()
            holder.wait()
        else:
            os.kill(holder.pid, signal.SIGSTOP)
        successor = _conversation_worker(engine.target, task, turns, -1, tmp_path / "none")
        done = await client.wait_for_run(run.run_id, timeout=90)
        if mode == "stall":
            os.kill(holder.pid, signal.SIGCONT)  # wakes behind its successor
    finally:
        for proc in (holder, successor):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert done.status == pb.RUN_STATUS_COMPLETED, (done.error, marker.with_suffix(".log"))
    assert (await journal_check(engine, run.run_id)).violations == []
    records = await _records(engine, run.run_id)
    # The stopped holder stored nothing of its turn (its claim rode the commit
    # it never made); the successor's claim is the task's next delivery.
    claims = [r.claim for r in records if r.iteration == stop_at and r.HasField("claim")]
    assert [c.delivery for c in claims] == [2], claims
    base = next(r for r in records if r.HasField("commit") and r.iteration == stop_at - 1)
    assert base.commit.state_delta.depth > 1, "the claim rebuilt a chain of deltas"
    async with JournalClient(engine.target) as journal:
        state = json.loads(await journal.state(run.run_id, "agent") or b"")
    assert state["turn"] == turns and len(state["messages"]) == turns
