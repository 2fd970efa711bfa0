"""Workflow definitions: parsing, validation, conversion and retry delays (pure, no I/O)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from google.protobuf import duration_pb2

from dagnats.core.errors import InvalidArgument
from dagnats.engine import definition
from dagnats.engine.convert_workflow import (
    stored_workflow,
    stored_workflow_proto,
    workflow_from_proto,
    workflow_to_proto,
)
from dagnats.engine.definition import (
    DEFAULT_AGENT_LOOP,
    DEFAULT_RETRY,
    AgentLoopBounds,
    Backoff,
    RetryPolicy,
    StepDef,
    StepType,
    WorkflowDef,
    backoff_delay,
    parse_document,
    parse_mapping,
    to_mapping,
    topological_order,
)
from dagnats.engine.v1 import engine_pb2

RESEARCH = """
name: research
version: "2024-06"
default_retry:
  max_attempts: 5
  backoff: linear
  initial_delay: 500ms
  max_delay: 2m
steps:
  - id: plan
    task: planner
    timeout: 30s
  - id: browse
    type: agent_loop
    task: browser-agent
    depends_on: [plan]
    agent_loop:
      max_iterations: 25
      max_duration: 1h30m
      loop_delay: 2s
  - id: summarize
    type: sub_workflow
    workflow: summarize_v2
    depends_on: [browse]
    retry:
      max_attempts: 1
  - id: notify
    task: notifier
    depends_on: [plan]
    retry:
      max_attempts: 4
      backoff: fixed
      initial_delay: 10
      max_delay: 10
"""


def minimal(*steps: dict[str, Any], **top: Any) -> dict[str, Any]:
    """A valid workflow mapping with the given steps (one task step by default)."""
    return {"name": "flow", "steps": list(steps) or [{"id": "a", "task": "t"}], **top}


def rejection(data: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        parse_mapping(data)
    return info.value


# --------------------------------------------------------------------------------------
# Happy paths


def test_research_document_parses_into_the_expected_definition() -> None:
    wf = parse_document(RESEARCH)

    assert wf.name == "research"
    assert wf.version == "2024-06"
    assert [step.id for step in wf.steps] == ["plan", "browse", "summarize", "notify"]
    assert wf.default_retry == RetryPolicy(
        max_attempts=5, backoff=Backoff.LINEAR, initial_delay=0.5, max_delay=120.0
    )
    assert wf.step("plan") == StepDef(
        id="plan",
        type=StepType.TASK,
        task="planner",
        workflow=None,
        depends_on=(),
        retry=None,
        timeout=30.0,
        agent_loop=None,
    )


def test_agent_loop_step_keeps_its_bounds() -> None:
    step = parse_document(RESEARCH).step("browse")

    assert step.type is StepType.AGENT_LOOP
    assert step.task == "browser-agent"
    assert step.depends_on == ("plan",)
    assert step.agent_loop == AgentLoopBounds(
        max_iterations=25, max_duration=5400.0, loop_delay=2.0
    )


def test_agent_loop_without_bounds_gets_the_defaults() -> None:
    wf = parse_mapping(minimal({"id": "loop", "type": "agent_loop", "task": "agent"}))

    assert wf.step("loop").agent_loop == AgentLoopBounds(
        max_iterations=100, max_duration=None, loop_delay=0.0
    )
    assert wf.step("loop").agent_loop == DEFAULT_AGENT_LOOP


def test_agent_loop_block_fills_missing_keys_with_defaults() -> None:
    step = parse_mapping(
        minimal(
            {"id": "loop", "type": "agent_loop", "task": "agent", "agent_loop": {"loop_delay": 1}}
        )
    ).step("loop")

    assert step.agent_loop == AgentLoopBounds(max_iterations=100, max_duration=None, loop_delay=1.0)


def test_sub_workflow_step_names_the_child_workflow_and_no_task() -> None:
    step = parse_document(RESEARCH).step("summarize")

    assert step.type is StepType.SUB_WORKFLOW
    assert step.workflow == "summarize_v2"
    assert step.task is None
    assert step.agent_loop is None


def test_retry_block_fills_missing_keys_with_defaults() -> None:
    step = parse_document(RESEARCH).step("summarize")

    assert step.retry == RetryPolicy(
        max_attempts=1, backoff=Backoff.EXPONENTIAL, initial_delay=1.0, max_delay=60.0
    )


def test_retry_for_prefers_step_then_workflow_default_then_builtin_default() -> None:
    wf = parse_document(RESEARCH)

    assert wf.retry_for("notify") == RetryPolicy(
        max_attempts=4, backoff=Backoff.FIXED, initial_delay=10.0, max_delay=10.0
    )
    assert wf.retry_for("plan") == wf.default_retry
    assert parse_mapping(minimal()).retry_for("a") == DEFAULT_RETRY
    assert (
        RetryPolicy(max_attempts=3, backoff=Backoff.EXPONENTIAL, initial_delay=1.0, max_delay=60.0)
        == DEFAULT_RETRY
    )


def test_step_type_defaults_to_task_and_version_to_empty() -> None:
    wf = parse_mapping(minimal())

    assert wf.steps[0].type is StepType.TASK
    assert wf.version == ""
    assert wf.default_retry is None


def test_json_document_is_accepted() -> None:
    text = json.dumps(minimal({"id": "a", "task": "t", "timeout": 1.5}))

    assert parse_document(text).step("a").timeout == 1.5


def test_explicit_null_means_left_out() -> None:
    wf = parse_mapping(
        minimal(
            {"id": "a", "task": "t", "retry": None, "timeout": None, "depends_on": None},
            version=None,
            default_retry=None,
        )
    )

    assert wf == parse_mapping(minimal())


def test_graph_queries() -> None:
    wf = parse_document(RESEARCH)

    assert [step.id for step in wf.dependents("plan")] == ["browse", "notify"]
    assert wf.dependents("summarize") == ()
    assert wf.sinks() == (wf.step("summarize"), wf.step("notify"))


def test_unknown_step_id_raises_key_error() -> None:
    wf = parse_document(RESEARCH)

    with pytest.raises(KeyError):
        wf.step("nope")
    with pytest.raises(KeyError):
        wf.retry_for("nope")
    with pytest.raises(KeyError):
        wf.dependents("nope")


def test_steps_keep_definition_order_and_topological_order_puts_dependencies_first() -> None:
    wf = parse_mapping(
        minimal(
            {"id": "report", "task": "t", "depends_on": ["fetch", "rank"]},
            {"id": "rank", "task": "t", "depends_on": ["fetch"]},
            {"id": "fetch", "task": "t"},
            {"id": "audit", "task": "t"},
        )
    )

    assert [step.id for step in wf.steps] == ["report", "rank", "fetch", "audit"]
    assert topological_order(wf) == ("fetch", "rank", "report", "audit")


def test_topological_order_breaks_ties_by_definition_order() -> None:
    wf = parse_mapping(
        minimal(
            {"id": "c", "task": "t", "depends_on": ["a"]},
            {"id": "b", "task": "t"},
            {"id": "a", "task": "t"},
        )
    )

    assert topological_order(wf) == ("b", "a", "c")


def test_topological_order_rejects_a_hand_built_cycle() -> None:
    wf = WorkflowDef(
        name="w",
        steps=(
            StepDef(id="a", task="t", depends_on=("b",)),
            StepDef(id="b", task="t", depends_on=("a",)),
        ),
    )

    with pytest.raises(InvalidArgument, match=r"dependency cycle: a -> b -> a"):
        topological_order(wf)


# --------------------------------------------------------------------------------------
# Round trips


def test_mapping_round_trip() -> None:
    wf = parse_document(RESEARCH)

    assert parse_mapping(to_mapping(wf)) == wf


def test_to_mapping_is_json_and_yaml_compatible() -> None:
    wf = parse_document(RESEARCH)
    data = to_mapping(wf)

    assert parse_document(json.dumps(data)) == wf
    assert parse_document(yaml.safe_dump(data)) == wf


def test_to_mapping_leaves_unset_fields_out() -> None:
    assert to_mapping(parse_mapping(minimal())) == {
        "name": "flow",
        "steps": [{"id": "a", "type": "task", "task": "t"}],
    }


def test_proto_round_trip_including_the_wire() -> None:
    wf = parse_document(RESEARCH)

    msg = workflow_to_proto(wf)
    wire = engine_pb2.Workflow.FromString(msg.SerializeToString())

    assert workflow_from_proto(wire) == wf


def test_a_stored_definition_is_validated_once_and_converts_as_a_new_one() -> None:
    wf = parse_document(RESEARCH)
    wire = engine_pb2.Workflow.FromString(workflow_to_proto(wf).SerializeToString())

    first = stored_workflow(wire)
    again = stored_workflow(engine_pb2.Workflow.FromString(wire.SerializeToString()))

    assert first == wf and again is first
    assert stored_workflow_proto(wf) == workflow_to_proto(wf)
    invalid = engine_pb2.Workflow(name="x")  # no steps
    for _ in range(2):  # a refusal is never kept as a definition
        with pytest.raises(InvalidArgument):
            stored_workflow(invalid)


def test_proto_fields_match_the_definition() -> None:
    msg = workflow_to_proto(parse_document(RESEARCH))

    assert msg.name == "research"
    assert msg.default_retry.backoff == engine_pb2.BACKOFF_STRATEGY_LINEAR
    assert msg.default_retry.initial_delay.ToNanoseconds() == 500_000_000
    browse, summarize = msg.steps[1], msg.steps[2]
    assert browse.type == engine_pb2.STEP_TYPE_AGENT_LOOP
    assert browse.agent_loop.max_duration.seconds == 5400
    assert summarize.type == engine_pb2.STEP_TYPE_SUB_WORKFLOW
    assert summarize.workflow == "summarize_v2"
    assert summarize.task == ""
    assert not msg.steps[0].HasField("retry")
    assert not msg.steps[0].HasField("agent_loop")


def test_proto_zero_values_mean_unset() -> None:
    msg = engine_pb2.Workflow(
        name="w",
        steps=[
            engine_pb2.Step(
                id="a",
                type=engine_pb2.STEP_TYPE_UNSPECIFIED,
                task="t",
                timeout=duration_pb2.Duration(),
                retry=engine_pb2.RetryPolicy(
                    max_attempts=0, backoff=engine_pb2.BACKOFF_STRATEGY_FIXED
                ),
            ),
            engine_pb2.Step(
                id="b",
                type=engine_pb2.STEP_TYPE_AGENT_LOOP,
                task="t",
                retry=engine_pb2.RetryPolicy(max_attempts=2),
                agent_loop=engine_pb2.AgentLoop(max_duration=duration_pb2.Duration()),
            ),
        ],
    )

    wf = workflow_from_proto(msg)

    assert wf.step("a") == StepDef(id="a", type=StepType.TASK, task="t")
    assert wf.step("b").retry == RetryPolicy(
        max_attempts=2, backoff=Backoff.EXPONENTIAL, initial_delay=1.0, max_delay=60.0
    )
    assert wf.step("b").agent_loop == DEFAULT_AGENT_LOOP


@pytest.mark.parametrize(
    ("msg", "field", "message"),
    [
        (engine_pb2.Workflow(steps=[engine_pb2.Step(id="a", task="t")]), "name", "missing"),
        (engine_pb2.Workflow(name="w"), "steps", "non-empty list"),
        (
            engine_pb2.Workflow(
                name="w",
                steps=[engine_pb2.Step(id="a", type=engine_pb2.StepType.ValueType(9), task="t")],
            ),
            "steps[0].type",
            "must be one of task, agent_loop, sub_workflow, got 9",
        ),
        (
            engine_pb2.Workflow(
                name="w",
                steps=[
                    engine_pb2.Step(id="a", task="t", depends_on=["b"]),
                    engine_pb2.Step(id="b", task="t", depends_on=["a"]),
                ],
            ),
            "steps[0].depends_on",
            "dependency cycle: a -> b -> a",
        ),
        (
            engine_pb2.Workflow(
                name="w",
                steps=[
                    engine_pb2.Step(id="a", task="t", timeout=duration_pb2.Duration(seconds=-5))
                ],
            ),
            "steps[0].timeout",
            "must not be negative",
        ),
        (
            engine_pb2.Workflow(
                name="w",
                steps=[engine_pb2.Step(id="a", task="t", agent_loop=engine_pb2.AgentLoop())],
            ),
            "steps[0].agent_loop",
            "of type task must not set 'agent_loop'",
        ),
        (
            engine_pb2.Workflow(
                name="w",
                steps=[
                    engine_pb2.Step(
                        id="c", type=engine_pb2.STEP_TYPE_SUB_WORKFLOW, task="t", workflow="w2"
                    )
                ],
            ),
            "steps[0].task",
            "must not set 'task'",
        ),
        (
            engine_pb2.Workflow(
                name="w",
                steps=[engine_pb2.Step(id="a", task="t")],
                default_retry=engine_pb2.RetryPolicy(max_attempts=101),
            ),
            "default_retry.max_attempts",
            "from 1 to 100",
        ),
    ],
    ids=[
        "no-name",
        "no-steps",
        "unknown-type",
        "cycle",
        "negative-timeout",
        "loop-on-task",
        "task-on-sub",
        "attempts",
    ],
)
def test_bad_proto_gets_the_same_errors_as_a_document(
    msg: engine_pb2.Workflow, field: str, message: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        workflow_from_proto(msg)

    assert info.value.field == field
    assert message in info.value.message


# --------------------------------------------------------------------------------------
# Rejections


def with_step(step: dict[str, Any], **top: Any) -> dict[str, Any]:
    return minimal(step, **top)


def loop_step(**bounds: Any) -> dict[str, Any]:
    return {"id": "loop", "type": "agent_loop", "task": "agent", "agent_loop": bounds}


def retry_step(**retry: Any) -> dict[str, Any]:
    return {"id": "a", "task": "t", "retry": retry}


REJECTIONS: list[tuple[str, dict[str, Any], str, str]] = [
    # top level
    ("unknown-top", minimal(owner="me"), "owner", "unknown field 'owner' in workflow"),
    ("no-name", {"steps": [{"id": "a", "task": "t"}]}, "name", "missing required field 'name'"),
    ("dotted-name", minimal(name="my.flow"), "name", "'my.flow'"),
    ("version-number", minimal(version=2), "version", "version must be a string"),
    ("no-steps", {"name": "w"}, "steps", "missing required field 'steps' in workflow"),
    ("empty-steps", {"name": "w", "steps": []}, "steps", "steps must be a non-empty list"),
    ("steps-mapping", {"name": "w", "steps": {"a": 1}}, "steps", "non-empty list"),
    (
        "step-not-mapping",
        {"name": "w", "steps": ["a"]},
        "steps[0]",
        "steps[0] must be a mapping, got str",
    ),
    # step keys
    (
        "unknown-step-key",
        with_step({"id": "a", "task": "t", "foo": 1}),
        "steps[0].foo",
        "unknown field 'foo' in steps[0]",
    ),
    (
        "no-id",
        minimal({"id": "a", "task": "t"}, {"task": "t"}),
        "steps[1].id",
        "missing required field 'id' in steps[1]",
    ),
    ("dotted-id", with_step({"id": "fetch.page", "task": "t"}), "steps[0].id", "'fetch.page'"),
    ("star-id", with_step({"id": "fetch*", "task": "t"}), "steps[0].id", "'fetch*'"),
    ("gt-id", with_step({"id": ">", "task": "t"}), "steps[0].id", "'>'"),
    ("space-id", with_step({"id": "a b", "task": "t"}), "steps[0].id", "'a b'"),
    (
        "bad-type",
        with_step({"id": "a", "type": "cron", "task": "t"}),
        "steps[0].type",
        "steps[0].type must be one of task, agent_loop, sub_workflow, got 'cron'",
    ),
    (
        "task-missing",
        with_step({"id": "a"}),
        "steps[0].task",
        "step 'a' of type task requires field 'task'",
    ),
    (
        "loop-task-missing",
        with_step({"id": "l", "type": "agent_loop"}),
        "steps[0].task",
        "step 'l' of type agent_loop requires field 'task'",
    ),
    (
        "sub-with-task",
        with_step({"id": "c", "type": "sub_workflow", "workflow": "w2", "task": "t"}),
        "steps[0].task",
        "step 'c' of type sub_workflow must not set 'task'",
    ),
    (
        "sub-no-workflow",
        with_step({"id": "c", "type": "sub_workflow"}),
        "steps[0].workflow",
        "step 'c' of type sub_workflow requires field 'workflow'",
    ),
    (
        "task-with-workflow",
        with_step({"id": "a", "task": "t", "workflow": "w2"}),
        "steps[0].workflow",
        "step 'a' of type task must not set 'workflow'",
    ),
    ("bad-task", with_step({"id": "a", "task": "web.fetch"}), "steps[0].task", "'web.fetch'"),
    (
        "bad-workflow",
        with_step({"id": "c", "type": "sub_workflow", "workflow": "x>"}),
        "steps[0].workflow",
        "'x>'",
    ),
    # dependencies
    (
        "unknown-dep",
        minimal({"id": "a", "task": "t"}, {"id": "b", "task": "t", "depends_on": ["a", "x"]}),
        "steps[1].depends_on[1]",
        "step 'b' depends on unknown step 'x'",
    ),
    (
        "self-dep",
        with_step({"id": "a", "task": "t", "depends_on": ["a"]}),
        "steps[0].depends_on[0]",
        "step 'a' depends on itself",
    ),
    (
        "twice-dep",
        minimal({"id": "a", "task": "t"}, {"id": "b", "task": "t", "depends_on": ["a", "a"]}),
        "steps[1].depends_on[1]",
        "step 'b' lists dependency 'a' twice",
    ),
    (
        "deps-string",
        minimal({"id": "a", "task": "t"}, {"id": "b", "task": "t", "depends_on": "a"}),
        "steps[1].depends_on",
        "steps[1].depends_on must be a list of step ids, got str",
    ),
    (
        "dep-number",
        minimal({"id": "a", "task": "t"}, {"id": "b", "task": "t", "depends_on": [1]}),
        "steps[1].depends_on[0]",
        "must be a step id, got 1",
    ),
    (
        "duplicate-id",
        minimal({"id": "a", "task": "t"}, {"id": "b", "task": "t"}, {"id": "a", "task": "u"}),
        "steps[2].id",
        "duplicate step id 'a' (steps[0] and steps[2])",
    ),
    (
        "cycle-3",
        minimal(
            {"id": "a", "task": "t", "depends_on": ["c"]},
            {"id": "b", "task": "t", "depends_on": ["a"]},
            {"id": "c", "task": "t", "depends_on": ["b"]},
        ),
        "steps[0].depends_on",
        "dependency cycle: a -> c -> b -> a",
    ),
    (
        "cycle-downstream",
        minimal(
            {"id": "start", "task": "t"},
            {"id": "x", "task": "t", "depends_on": ["start", "y"]},
            {"id": "y", "task": "t", "depends_on": ["x"]},
        ),
        "steps[1].depends_on",
        "dependency cycle: x -> y -> x",
    ),
    # agent loop
    (
        "loop-on-task",
        with_step({"id": "a", "task": "t", "agent_loop": {"max_iterations": 3}}),
        "steps[0].agent_loop",
        "step 'a' of type task must not set 'agent_loop'",
    ),
    (
        "loop-not-mapping",
        with_step({"id": "l", "type": "agent_loop", "task": "t", "agent_loop": 5}),
        "steps[0].agent_loop",
        "steps[0].agent_loop must be a mapping, got int",
    ),
    (
        "loop-unknown-key",
        with_step(loop_step(max_iters=3)),
        "steps[0].agent_loop.max_iters",
        "unknown field 'max_iters' in steps[0].agent_loop",
    ),
    *[
        (
            f"iterations-{value!r}",
            with_step(loop_step(max_iterations=value)),
            "steps[0].agent_loop.max_iterations",
            "steps[0].agent_loop.max_iterations must be an integer from 1 to 1000000",
        )
        for value in (0, 1_000_001, -1, 2.5, "10", True)
    ],
    (
        "zero-max-duration",
        with_step(loop_step(max_duration=0)),
        "steps[0].agent_loop.max_duration",
        "steps[0].agent_loop.max_duration must be greater than 0",
    ),
    (
        "negative-loop-delay",
        with_step(loop_step(loop_delay=-1)),
        "steps[0].agent_loop.loop_delay",
        "steps[0].agent_loop.loop_delay must not be negative",
    ),
    # retry
    (
        "retry-not-mapping",
        with_step({"id": "a", "task": "t", "retry": 3}),
        "steps[0].retry",
        "steps[0].retry must be a mapping, got int",
    ),
    (
        "retry-unknown-key",
        with_step(retry_step(jitter=True)),
        "steps[0].retry.jitter",
        "unknown field 'jitter' in steps[0].retry",
    ),
    *[
        (
            f"attempts-{value!r}",
            with_step(retry_step(max_attempts=value)),
            "steps[0].retry.max_attempts",
            "steps[0].retry.max_attempts must be an integer from 1 to 100",
        )
        for value in (0, 101, 3.0, "3", True)
    ],
    (
        "bad-backoff",
        with_step(retry_step(backoff="random")),
        "steps[0].retry.backoff",
        "must be one of fixed, linear, exponential, got 'random'",
    ),
    (
        "max-below-initial",
        with_step(retry_step(initial_delay="2m")),
        "steps[0].retry.max_delay",
        "steps[0].retry.max_delay (60s) must be at least initial_delay (120s)",
    ),
    (
        "bad-initial-delay",
        with_step(retry_step(initial_delay="soon")),
        "steps[0].retry.initial_delay",
        "steps[0].retry.initial_delay must be seconds",
    ),
    (
        "default-retry-attempts",
        minimal(default_retry={"max_attempts": 0}),
        "default_retry.max_attempts",
        "default_retry.max_attempts must be an integer from 1 to 100, got 0",
    ),
    (
        "default-retry-unknown",
        minimal(default_retry={"tries": 2}),
        "default_retry.tries",
        "unknown field 'tries' in default_retry",
    ),
    # timeout
    (
        "zero-timeout",
        with_step({"id": "a", "task": "t", "timeout": 0}),
        "steps[0].timeout",
        "steps[0].timeout must be greater than 0",
    ),
    (
        "zero-string-timeout",
        with_step({"id": "a", "task": "t", "timeout": "0s"}),
        "steps[0].timeout",
        "must be greater than 0",
    ),
    (
        "word-timeout",
        with_step({"id": "a", "task": "t", "timeout": "soon"}),
        "steps[0].timeout",
        "steps[0].timeout must be seconds as a number or a string like '500ms'",
    ),
    (
        "bool-timeout",
        with_step({"id": "a", "task": "t", "timeout": True}),
        "steps[0].timeout",
        "got True",
    ),
]


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [case[1:] for case in REJECTIONS],
    ids=[case[0] for case in REJECTIONS],
)
def test_invalid_definition_is_rejected_with_field_and_reason(
    data: dict[str, Any], field: str, message: str
) -> None:
    error = rejection(copy.deepcopy(data))

    assert error.field == field
    assert message in error.message


def test_workflow_that_is_not_a_mapping_is_rejected() -> None:
    error = rejection(["a"])

    assert error.message == "workflow must be a mapping, got list"


def test_unknown_field_message_lists_the_expected_fields() -> None:
    error = rejection(with_step({"id": "a", "task": "t", "depends": ["b"]}))

    assert "expected one of id, type, task, workflow, depends_on" in error.message


def test_rejection_happens_through_documents_too() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_document("name: w\nsteps:\n  - id: a.b\n    task: t\n")

    assert info.value.field == "steps[0].id"
    assert "'a.b'" in info.value.message


# --------------------------------------------------------------------------------------
# Documents


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: w\nsteps: [\n", "document is not valid YAML or JSON:"),
        ('{"name": "w", "steps": [}', "document is not valid YAML or JSON:"),
        ("- name: w\n", "document must be a mapping of workflow fields, got list"),
        ("just words", "document must be a mapping of workflow fields, got str"),
        ("", "document is empty"),
        ("# only a comment\n", "document is empty"),
        ("name: w\nversion: 2001-02-30\n", "document could not be read"),
    ],
    ids=["yaml-syntax", "json-syntax", "list", "scalar", "empty", "comment", "bad-date"],
)
def test_unreadable_document_is_rejected_without_a_traceback(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_document(text)

    assert info.value.field == "document"
    assert info.value.message.startswith(message)


def test_yaml_syntax_error_names_the_line() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_document("name: w\nsteps:\n  - id: a\n   task: t\n")

    assert "line 4" in info.value.message


# --------------------------------------------------------------------------------------
# Backoff


def policy(backoff: Backoff, *, initial: float = 2.0, cap: float = 1000.0) -> RetryPolicy:
    return RetryPolicy(max_attempts=10, backoff=backoff, initial_delay=initial, max_delay=cap)


def test_fixed_backoff_waits_the_same_every_time() -> None:
    assert [backoff_delay(policy(Backoff.FIXED), n) for n in (1, 2, 5)] == [2.0, 2.0, 2.0]


def test_linear_backoff_grows_by_initial_delay() -> None:
    assert [backoff_delay(policy(Backoff.LINEAR), n) for n in (1, 2, 3, 4)] == [2, 4, 6, 8]


def test_exponential_backoff_doubles() -> None:
    delays = [backoff_delay(policy(Backoff.EXPONENTIAL), n) for n in (1, 2, 3, 4)]

    assert delays == [2.0, 4.0, 8.0, 16.0]


def test_backoff_is_capped_at_max_delay() -> None:
    assert backoff_delay(policy(Backoff.EXPONENTIAL, cap=10.0), 4) == 10.0
    assert backoff_delay(policy(Backoff.LINEAR, cap=5.0), 3) == 5.0
    assert backoff_delay(policy(Backoff.EXPONENTIAL, cap=10.0), 100_000) == 10.0


def test_default_policy_delays() -> None:
    delays = [backoff_delay(DEFAULT_RETRY, n) for n in range(1, 9)]

    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]


def test_zero_max_delay_means_no_cap() -> None:
    assert backoff_delay(policy(Backoff.EXPONENTIAL, initial=1.0, cap=0.0), 11) == 1024.0


def test_backoff_counts_failed_attempts_from_one() -> None:
    with pytest.raises(ValueError, match="from 1"):
        backoff_delay(DEFAULT_RETRY, 0)


# --------------------------------------------------------------------------------------
# Public surface


def test_exported_names() -> None:
    assert set(definition.__all__) == {
        "DEFAULT_AGENT_LOOP",
        "DEFAULT_RETRY",
        "AgentLoopBounds",
        "Backoff",
        "RetryPolicy",
        "StepDef",
        "StepType",
        "WorkflowDef",
        "backoff_delay",
        "parse_document",
        "parse_mapping",
        "to_mapping",
        "topological_order",
    }
    assert all(hasattr(definition, name) for name in definition.__all__)
