"""The pure rules of a fork and a diff, no server: where a forked step resumes
(``replay.fork_point``), a copied prefix's moved sequences and its digest
(``journal.fork``), the audit's ``fork_prefix`` rule, the engine's forked run
(``rules.fork_run``), a run's settings at the edge, and the diff of two runs'
journals (``dagnats.sdk.diff``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from dagnats.core.errors import InvalidArgument
from dagnats.core.run_settings import check_settings, merged, parse_assignments
from dagnats.core.usage import Budget, Policy
from dagnats.engine import rules
from dagnats.engine.definition import parse_document
from dagnats.engine.model import DispatchTask, ForkOrigin, Resume, StepStatus
from dagnats.journal.audit import ForkDigests, check_step
from dagnats.journal.fork import moved, prefix_digest
from dagnats.journal.model import CommitEntry, ForkEntry
from dagnats.journal.replay import NoResume, ResumeAt, fork_point
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.sdk.diff import diff_runs, entries, format_diff, step_diff
from tests.test_audit import Journal
from tests.test_audit import rules as found_rules

# ---- where a fork resumes -------------------------------------------------------------


def two_iterations() -> Journal:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    search = j.intent("search", safe=True)
    j.result(search)
    j.commit("continue")
    j.claim("w2", 1)
    j.model()
    j.intent("charge")
    j.commit("complete")
    return j


def test_a_fork_resumes_at_its_records_dispatch_on_the_commit_before() -> None:
    j = two_iterations()
    # seq 7 is iteration 1's model response; its base is the continue at seq 5.
    assert fork_point(j.entries[:7], 7) == ResumeAt(
        iteration=1, attempt=1, output=b"", base_seq=j.entries[6].base_seq
    )
    assert fork_point(j.entries[:3], 3) == ResumeAt(iteration=0, attempt=1, output=b"", base_seq=0)


def test_a_fork_at_a_continue_resumes_at_the_next_iteration() -> None:
    j = two_iterations()
    entries_ = [
        replace(e, output=b'{"n": 1}') if isinstance(e, CommitEntry) else e for e in j.entries[:5]
    ]
    assert fork_point(entries_, 5) == ResumeAt(
        iteration=1, attempt=1, output=b'{"n": 1}', base_seq=5
    )


def test_no_fork_after_a_commit_that_ends_the_step_or_at_no_record() -> None:
    j = two_iterations()
    ended = fork_point(j.entries, 9)
    assert isinstance(ended, NoResume) and "commit (complete) that ends the step" in ended.reason
    missing = fork_point(j.entries, 40)
    assert isinstance(missing, NoResume) and "not a record" in missing.reason


# ---- the copied prefix --------------------------------------------------------------


def source_records() -> list[pb.Record]:
    r1 = pb.Record(run_id="s", step_id="a", seq=10, claim=pb.Claim(delivery=1))
    r2 = pb.Record(
        run_id="s",
        step_id="a",
        seq=12,
        expected_seq=10,
        tool_intent=pb.ToolIntent(position=0, name="send", input=b"{}"),
    )
    r3 = pb.Record(
        run_id="s",
        step_id="a",
        seq=15,
        expected_seq=12,
        tool_result=pb.ToolResult(intent_seq=12, output=b'"ok"'),
    )
    return [r1, r2, r3]


def copied(records: list[pb.Record], run_id: str, first: int) -> list[pb.Record]:
    """``records`` copied as a fork copies them, to sequences from ``first``."""
    seqs: dict[int, int] = {}
    out = []
    for i, r in enumerate(records):
        c = moved(r, run_id, seqs)
        c.seq = seqs[r.seq] = first + 3 * i
        out.append(c)
    return out


def test_a_copy_points_back_at_the_copies_and_keeps_the_digest() -> None:
    source = source_records()
    copies = copied(source, "f", 100)
    assert [c.expected_seq for c in copies] == [0, 100, 103]
    assert copies[2].tool_result.intent_seq == 103
    assert all(c.run_id == "f" for c in copies)
    assert prefix_digest(copies) == prefix_digest(source)
    altered = copied(source, "f", 100)
    altered[2].tool_result.output = b'"changed"'
    assert prefix_digest(altered) != prefix_digest(source)
    with pytest.raises(KeyError):
        moved(source[2], "f", {})  # a reference to a record not copied before it


def forked_journal(copied: int = 2, digest: str = "sha256:x") -> Journal:
    j = Journal()
    j.claim("w1", 0)
    j.model()
    j.entries.append(
        ForkEntry(
            seq=3,
            iteration=0,
            attempt=1,
            writer="",
            expected_seq=2,
            source_run="s",
            source_step="agent",
            at_seq=2,
            copied=copied,
            digest=digest,
        )
    )
    j.claim("w2", 0)
    j.model()
    j.commit("complete")
    return j


def test_a_sound_fork_passes_and_fences_nothing() -> None:
    j = forked_journal()
    digests = ForkDigests(copied="sha256:x", source="sha256:x")
    assert check_step("agent", j.entries, fork=digests) == []
    assert check_step("agent", j.entries, fork=ForkDigests(copied="sha256:x", source=None)) == []


def test_an_altered_copy_a_forged_fork_record_and_a_wrong_count_are_found() -> None:
    j = forked_journal()
    altered = check_step("agent", j.entries, fork=ForkDigests(copied="sha256:y", source="sha256:x"))
    assert found_rules(altered) == ["fork_prefix"]
    assert "are not the ones it copied" in altered[0].message
    # The fork record made to match an altered copy: the source tells.
    forged = check_step("agent", j.entries, fork=ForkDigests(copied="sha256:x", source="sha256:z"))
    assert found_rules(forged) == ["fork_prefix"]
    assert "run s's records of step agent through seq 2" in forged[0].message
    counted = check_step("agent", forked_journal(copied=5).entries)
    assert found_rules(counted) == ["fork_prefix"] and "copied 5 records" in counted[0].message


# ---- the forked run -------------------------------------------------------------------

WORKFLOW = parse_document(
    """
name: wf
steps:
  - {id: prep, task: prep}
  - {id: agent, type: agent_loop, task: agent, depends_on: [prep]}
  - {id: side, task: side}
  - {id: after, task: after, depends_on: [agent]}
"""
)


def test_a_forked_run_carries_its_dependencies_and_dispatches_the_step_at_its_resume() -> None:
    budget = Budget(tokens=5000, policy=Policy.PAUSE)
    source = rules.start_run(
        run_id="s" * 32, workflow=WORKFLOW, input=b"{}", now=1.0, budget=budget
    ).run
    done = replace(source.step("prep"), status=StepStatus.COMPLETED, output=b'{"p": 1}')
    source = replace(source, steps=tuple(done if s.step_id == "prep" else s for s in source.steps))
    accepted = rules.fork_run(
        source,
        run_id="f" * 32,
        origin=ForkOrigin(run_id=source.run_id, step_id="agent", at_seq=7),
        resume=Resume(iteration=2, attempt=1, iterations=2, output=b'{"n": 2}'),
        input=b'{"x": 1}',
        settings=(("model", "b"),),
        now=5.0,
    )
    run = accepted.run
    assert run.forked_from == ForkOrigin(run_id=source.run_id, step_id="agent", at_seq=7)
    assert (
        run.step("prep").status is StepStatus.COMPLETED and run.step("prep").output == b'{"p": 1}'
    )
    agent = run.step("agent")
    assert (agent.status, agent.iteration, agent.attempt, agent.iterations) == (
        StepStatus.RUNNING,
        2,
        1,
        2,
    )
    assert run.step("after").status is StepStatus.PENDING
    tasks = [e for e in accepted.effects if isinstance(e, DispatchTask)]
    assert sorted(t.step_id for t in tasks) == ["agent", "side"]
    assert all(t.settings == (("model", "b"),) for t in tasks)
    assert run.budget == budget and all(t.budget is not None for t in tasks)
    agent_task = next(t for t in tasks if t.step_id == "agent")
    assert (agent_task.iteration, agent_task.input) == (2, b'{"p": 1}')


# ---- settings ---------------------------------------------------------------------------


def test_settings_are_checked_at_the_edge() -> None:
    assert parse_assignments(["model=b", "temp=0.2", "model=c"]) == {"model": "c", "temp": "0.2"}
    assert merged({"model": "a", "temp": "1"}, {"model": "b", "temp": ""}) == {"model": "b"}
    for bad, message in [
        ({"a.b": "x"}, "settings name"),
        ({"m": "x" * 1025}, "longer than 1024"),
        ({"m": "a\nb"}, "control character"),
        ({f"k{i}": "v" for i in range(33)}, "at most 32"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            check_settings(bad)
    with pytest.raises(InvalidArgument, match="takes name=value"):
        parse_assignments(["model"])


# ---- the diff ---------------------------------------------------------------------------


def rec(seq: int, kind: str, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "iteration": 0, "kind": kind, kind: body, "leading": None, **extra}


def journal_of(text: str, *, base: int = 0, fork: bool = False) -> list[dict[str, Any]]:
    rs = [
        rec(base + 1, "claim", {"delivery": 1}),
        {
            **rec(base + 2, "tool_intent", {"name": "search", "input": {"q": 1}}),
            "leading": "leading_model",
            "leading_model": {"response": {"text": "hi"}},
        },
        rec(base + 3, "tool_result", {"intent_seq": base + 2, "output": {"ok": True}}),
    ]
    if fork:
        rs.append(rec(base + 4, "fork", {"run_id": "s"}))
    rs += [
        rec(base + 5, "claim", {"delivery": 1}),
        rec(base + 6, "model", {"response": {"text": text}}),
        rec(base + 7, "commit", {"action": "complete", "output": {"answer": text}}),
    ]
    return rs


def test_entries_split_a_records_leading_entry_and_skip_claims_and_forks() -> None:
    found = entries(journal_of("a", fork=True))
    assert [e["kind"] for e in found] == ["model", "tool_intent", "tool_result", "model", "commit"]
    assert found[1]["text"] == 'tool search({"q":1})'


def test_the_diff_starts_where_the_content_differs_whatever_the_sequences() -> None:
    d = step_diff(journal_of("a"), journal_of("b", base=100, fork=True))
    assert d["common"] == 3
    assert [(r["a"]["kind"], r["b"]["kind"]) for r in d["rows"]] == [
        ("model", "model"),
        ("commit", "commit"),
    ]
    assert d["rows"][0]["a"]["text"] == 'model: {"text":"a"}'
    assert d["rows"][0]["b"]["seq"] == 106
    same = step_diff(journal_of("a"), journal_of("a", base=50))
    assert same == {"common": 5, "rows": []}
    shorter = step_diff(journal_of("a")[:3], journal_of("a"))
    assert shorter["common"] == 3 and [r["a"] for r in shorter["rows"]] == [None, None]


def test_two_runs_diff_with_their_outcomes_and_as_text() -> None:
    run_a = {"run_id": "a", "status": "completed", "output": {"x": 1}, "steps": [{"step_id": "s"}]}
    run_b = {**run_a, "run_id": "b", "output": {"x": 2}}
    found = diff_runs(run_a, run_b, {"s": journal_of("a")}, {"s": journal_of("b")})
    assert found["outcome"]["same"] is False
    assert found["steps"][0]["step"] == "s" and found["steps"][0]["common"] == 3
    text = format_diff(found)
    assert "step s: 3 entries in common" in text
    assert 'model: {"text":"a"}' in text and 'model: {"text":"b"}' in text
    assert 'outcome b: completed {"x":2}' in text


def test_every_sequence_a_record_names_moves_with_the_copy() -> None:
    group = pb.Record(
        seq=20,
        expected_seq=15,
        base_seq=10,
        tool_intents=pb.ToolIntents(
            intents=[pb.ToolIntent(name="a", honours_seq=12), pb.ToolIntent(name="b")]
        ),
    )
    commit = pb.Record(
        seq=22,
        expected_seq=21,
        base_seq=10,
        commit=pb.Commit(action=pb.ACTION_CONTINUE),
        leading_tool_result=pb.ToolResult(intent_seq=20, intent_index=1),
    )
    output = pb.Record(seq=21, expected_seq=20, tool_output=pb.ToolOutput(intent_seq=20))
    seqs = {10: 110, 12: 112, 15: 115, 20: 120, 21: 121}
    g = moved(group, "f", seqs)
    assert (g.expected_seq, g.base_seq) == (115, 110)
    assert [i.honours_seq for i in g.tool_intents.intents] == [112, 0]
    assert moved(output, "f", seqs).tool_output.intent_seq == 120
    c = moved(commit, "f", seqs)
    assert (c.expected_seq, c.base_seq, c.leading_tool_result.intent_seq) == (121, 110, 120)
    assert c.leading_tool_result.intent_index == 1 and c.seq == 0
