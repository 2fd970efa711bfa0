"""Worker builds in the engine's pure rules, the task subjects' lanes and the
workflow's build policy: no event loop, no NATS."""

from __future__ import annotations

import pytest

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_build_id, check_lease
from dagnats.core.partitions import slot_of
from dagnats.core.subjects import (
    lane_build,
    lane_prefix,
    partition_filters,
    run_tasks,
    task_consumer,
    task_subject,
)
from dagnats.engine import model as m
from dagnats.engine import rules
from dagnats.engine.convert_workflow import workflow_from_proto, workflow_to_proto
from dagnats.engine.definition import BuildPolicy, parse_mapping

T0 = 1_000.0
KEPT = 7  # the TASKS sequence of the message a holder keeps


def loop(**extra: object) -> m.Run:
    step = {"id": "agent", "type": "agent_loop", "task": "agent", "agent_loop": {}}
    workflow = parse_mapping({"name": "wf", "steps": [step], **extra})
    return rules.start_run(run_id="r" * 32, workflow=workflow, input=b"1", now=T0).run


def commit(run: m.Run, build: str, *, kept_seq: int = KEPT) -> m.Accepted:
    step = run.step("agent")
    ident = m.Identity(iteration=step.iteration, attempt=step.attempt)
    report = m.StepReport(
        step_id="agent",
        identity=ident,
        outcome=m.Continued(output=b"1"),
        journal_seq=10 + step.iteration,
        kept_seq=kept_seq,
        build=build,
    )
    decision = rules.apply(run, report, T0 + 1)
    assert isinstance(decision, m.Accepted), decision
    return decision


def tasks(decision: m.Accepted) -> list[m.DispatchTask]:
    return [e for e in decision.effects if isinstance(e, m.DispatchTask)]


def test_a_steps_first_commit_records_its_build_and_later_ones_keep_it() -> None:
    first = commit(loop(), "A")
    assert first.run.step("agent").build == "A"
    assert first.run.step("agent").kept_seq == KEPT  # the holder carries on
    later = commit(first.run, "A")
    assert later.run.step("agent").build == "A" and later.run.step("agent").kept_seq == KEPT


def test_a_commit_of_another_build_keeps_no_message_and_dispatches_to_the_steps_build() -> None:
    pinned = commit(loop(), "A").run
    other = commit(pinned, "B")
    assert other.run.step("agent").build == "A"
    assert other.run.step("agent").kept_seq == 0
    assert [t.build for t in tasks(other)] == ["A"]


def test_an_unversioned_commit_changes_no_step() -> None:
    kept = commit(loop(), "").run
    after = commit(kept, "")
    assert after.run.step("agent").build == "" and after.run.step("agent").kept_seq == KEPT
    assert rules.carries_kept_loop_on(kept, after, "agent", KEPT)  # may be deferred


def test_a_kept_iteration_that_records_a_build_is_written_not_deferred() -> None:
    kept = commit(loop(), "").run  # an unversioned step, carried on on KEPT
    recorded = commit(kept, "A")
    assert not rules.carries_kept_loop_on(kept, recorded, "agent", KEPT)


def test_the_pinned_policy_dispatches_on_the_build_and_upgrade_on_any() -> None:
    for policy, lane in [({}, "A"), ({"build_policy": "upgrade"}, "")]:
        run = commit(loop(**policy), "A", kept_seq=0)
        assert [t.build for t in tasks(run)] == [lane]
    upgraded = commit(commit(loop(build_policy="upgrade"), "A").run, "B")
    assert upgraded.run.step("agent").build == "B"  # the latest build
    assert upgraded.run.step("agent").kept_seq == KEPT


def test_upgrade_dispatches_a_pinned_running_step_again_on_the_new_build() -> None:
    run = commit(loop(), "A", kept_seq=0).run  # its task is out, on A's lane
    moved = rules.apply(run, m.UpgradeRequested(build="B"), T0 + 2)
    assert isinstance(moved, m.Accepted)
    step = moved.run.step("agent")
    assert step.build == "B" and step.redispatches == 1 and step.kept_seq == 0
    [task] = tasks(moved)
    assert (task.build, task.iteration, task.attempt, task.redispatch) == ("B", 1, 1, 1)
    again = rules.apply(moved.run, m.UpgradeRequested(build="B"), T0 + 3)
    assert isinstance(again, m.Dropped)
    unpinned = rules.apply(loop(), m.UpgradeRequested(build="B"), T0 + 2)
    assert isinstance(unpinned, m.Dropped)  # no step recorded a build


def test_upgrade_of_a_waiting_step_only_changes_its_build() -> None:
    run = loop()
    ident = m.Identity(iteration=0, attempt=1)
    waits = m.Continued(output=b"1", wait=m.Wait(until_input=True))
    report = m.StepReport(step_id="agent", identity=ident, outcome=waits, journal_seq=3, build="A")
    waiting = rules.apply(run, report, T0 + 1)
    assert isinstance(waiting, m.Accepted) and waiting.run.step("agent").build == "A"
    moved = rules.apply(waiting.run, m.UpgradeRequested(build="B"), T0 + 2)
    assert isinstance(moved, m.Accepted) and tasks(moved) == []
    assert moved.run.step("agent").build == "B"
    assert moved.run.step("agent").status is m.StepStatus.WAITING


@pytest.mark.parametrize(
    ("pin", "lane", "worker", "leasable"),
    [
        ("", "", "", True),  # unversioned
        ("", "", "B", True),
        ("A", "A", "A", True),
        ("A", "", "A", True),  # a kept message, delivered again to its build
        ("A", "", "B", False),  # ... to another build: moved to A's lane
        ("A", "", "", False),  # ... to an unversioned worker: moved too
        ("B", "A", "A", False),  # left on an old build's lane by an upgrade
    ],
)
def test_which_lane_a_worker_may_lease_from(
    pin: str, lane: str, worker: str, leasable: bool
) -> None:
    assert rules.leasable_on_lane(pin, lane, worker) is leasable


@pytest.mark.parametrize(
    ("pin", "holder", "worker", "decision"),
    [
        ("", "", "B", m.LeaseHere()),  # no build recorded, an unversioned holder or none
        ("", "A", "A", m.LeaseHere()),  # delivered again to its first claim's build
        ("", "A", "B", m.MoveToLane(build="A")),  # ... to another build: moved to A's lane
        ("", "A", "", m.MoveToLane(build="A")),  # ... to an unversioned worker: moved too
        ("A", "", "B", m.MoveToLane(build="A")),  # pinned: decided on the pin alone
        ("A", "", "A", m.LeaseHere()),
    ],
)
def test_a_step_without_a_build_belongs_to_its_first_claims_build(
    pin: str, holder: str, worker: str, decision: m.LaneDecision
) -> None:
    found = rules.lane_for_lease(pin=pin, lane_build="", worker_build=worker, holder_build=holder)
    assert found == decision


def test_only_a_pinned_steps_redelivery_without_a_build_reads_its_holder() -> None:
    assert rules.asks_holder(pinned_policy=True, step_build="", delivery=2)
    assert not rules.asks_holder(pinned_policy=True, step_build="", delivery=1)  # first delivery
    assert not rules.asks_holder(pinned_policy=True, step_build="A", delivery=2)  # has its pin
    assert not rules.asks_holder(pinned_policy=False, step_build="", delivery=2)  # upgrade policy


def test_a_step_moved_to_its_first_claims_lane_records_that_build() -> None:
    run = loop()  # iteration 0 dispatched on the unpinned lane, nothing committed
    moved = rules.apply(run, m.TaskVanished(step_id="agent", iteration=0, attempt=1, build="A"), T0)
    assert isinstance(moved, m.Accepted)
    step = moved.run.step("agent")
    assert step.build == "A" and step.redispatches == 1
    [task] = tasks(moved)
    assert (task.build, task.iteration, task.attempt, task.redispatch) == ("A", 0, 1, 1)
    upgraded = rules.apply(moved.run, m.UpgradeRequested(build="B"), T0 + 1)
    assert isinstance(upgraded, m.Accepted) and [t.build for t in tasks(upgraded)] == ["B"]
    # A step that recorded a build (upgraded meanwhile) keeps its own.
    late = m.TaskVanished(step_id="agent", iteration=0, attempt=1, build="A")
    again = rules.apply(upgraded.run, late, T0 + 2)
    assert isinstance(again, m.Accepted) and again.run.step("agent").build == "B"
    assert [t.build for t in tasks(again)] == ["B"]


def test_a_pinned_lane_never_overlaps_the_unpinned_one_and_purges_with_its_run() -> None:
    run = "r" * 32
    pinned, unpinned = task_subject("agent", run, "s", "A"), task_subject("agent", run, "s")
    slot = slot_of(run)
    assert pinned == f"tasks.agent@A.{slot}.{run}.s" and unpinned == f"tasks.agent.{slot}.{run}.s"
    assert (lane_build(pinned), lane_build(unpinned)) == ("A", "")
    unpinned_lane, pinned_lane = lane_prefix("agent"), lane_prefix("agent", "A")
    assert partition_filters(unpinned_lane, 0, 1) == ["tasks.agent.>"]
    assert partition_filters(pinned_lane, 0, 1) == ["tasks.agent@A.>"]
    assert run_tasks(run) == f"tasks.*.{slot}.{run}.>"  # both lanes
    lease = f"$JS.ACK.TASKS.{task_consumer('agent', 'A', 3)}.1.5.3.1700000000000000000.0"
    assert check_lease(lease) == lease


@pytest.mark.parametrize("bad", ["v1.2", "a b", "*", ">", "x" * 65, "a@b"])
def test_a_build_id_is_one_bounded_token(bad: str) -> None:
    assert check_build_id("") == "" and check_build_id("2026-12-06_a1") == "2026-12-06_a1"
    with pytest.raises(InvalidArgument, match="build_id"):
        check_build_id(bad)


def test_the_build_policy_of_a_workflow_definition() -> None:
    step = {"id": "s", "task": "t"}
    assert parse_mapping({"name": "w", "steps": [step]}).build_policy is BuildPolicy.PINNED
    upgrade = parse_mapping({"name": "w", "steps": [step], "build_policy": "upgrade"})
    assert upgrade.build_policy is BuildPolicy.UPGRADE
    assert workflow_from_proto(workflow_to_proto(upgrade)) == upgrade
    assert workflow_to_proto(parse_mapping({"name": "w", "steps": [step]})).build_policy == 0
    with pytest.raises(InvalidArgument, match="build_policy must be one of pinned, upgrade"):
        parse_mapping({"name": "w", "steps": [step], "build_policy": "latest"})
    unknown = workflow_to_proto(upgrade)
    unknown.build_policy = 9  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match="build_policy"):
        workflow_from_proto(unknown)
