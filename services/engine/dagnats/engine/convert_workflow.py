"""Conversion between workflow definitions and ``dagnats.engine.v1.Workflow`` messages.

This is the only module where the generated workflow types meet
:mod:`dagnats.engine.definition`. A message coming in is turned into the mapping a
document would decode to and validated by ``parse_mapping``, so a bad message gets the
same ``InvalidArgument`` (message and field path) as the same mistake in YAML.

Proto3 cannot tell unset from zero, so zero means unset where the contract allows it:

* ``STEP_TYPE_UNSPECIFIED`` is a task step; ``BACKOFF_STRATEGY_UNSPECIFIED`` is exponential;
* an empty name, version, task or workflow string is absent;
* a retry policy with ``max_attempts`` 0 is no policy; an absent ``initial_delay`` or
  ``max_delay`` takes the default;
* a zero ``timeout`` or ``max_duration`` is no bound; ``max_iterations`` 0 takes the
  default; an absent ``loop_delay`` is 0.

Enum numbers this build does not know are passed on as numbers, and rejected by name of
the field.
"""

from __future__ import annotations

import functools
from typing import Any

from dagnats.core.budget_wire import budget_to_proto, check_budget
from dagnats.core.timestamps import duration, duration_seconds
from dagnats.core.usage import budget_mapping
from dagnats.engine.definition import (
    AgentLoopBounds,
    Backoff,
    BuildPolicy,
    RetryPolicy,
    StepDef,
    StepType,
    WorkflowDef,
    parse_mapping,
)
from dagnats.engine.v1 import engine_pb2

__all__ = [
    "stored_workflow",
    "stored_workflow_proto",
    "workflow_from_proto",
    "workflow_to_proto",
]

# Distinct stored definitions whose validated form is kept (see ``stored_workflow``).
STORED_WORKFLOWS = 1024


_STEP_TYPE_TO_PROTO: dict[StepType, engine_pb2.StepType.ValueType] = {
    StepType.TASK: engine_pb2.STEP_TYPE_TASK,
    StepType.AGENT_LOOP: engine_pb2.STEP_TYPE_AGENT_LOOP,
    StepType.SUB_WORKFLOW: engine_pb2.STEP_TYPE_SUB_WORKFLOW,
}
_STEP_TYPE_FROM_PROTO: dict[int, str] = {
    engine_pb2.STEP_TYPE_UNSPECIFIED: StepType.TASK.value,
    **{number: step_type.value for step_type, number in _STEP_TYPE_TO_PROTO.items()},
}
# The default, pinned, is stored as unset: a definition that does not
# choose is stored as it was before the policy existed.
_BUILD_POLICY_TO_PROTO: dict[BuildPolicy, engine_pb2.BuildPolicy.ValueType] = {
    BuildPolicy.PINNED: engine_pb2.BUILD_POLICY_UNSPECIFIED,
    BuildPolicy.UPGRADE: engine_pb2.BUILD_POLICY_UPGRADE,
}
_BUILD_POLICY_FROM_PROTO: dict[int, str] = {
    engine_pb2.BUILD_POLICY_UNSPECIFIED: BuildPolicy.PINNED.value,
    engine_pb2.BUILD_POLICY_PINNED: BuildPolicy.PINNED.value,
    engine_pb2.BUILD_POLICY_UPGRADE: BuildPolicy.UPGRADE.value,
}
_BACKOFF_TO_PROTO: dict[Backoff, engine_pb2.BackoffStrategy.ValueType] = {
    Backoff.FIXED: engine_pb2.BACKOFF_STRATEGY_FIXED,
    Backoff.LINEAR: engine_pb2.BACKOFF_STRATEGY_LINEAR,
    Backoff.EXPONENTIAL: engine_pb2.BACKOFF_STRATEGY_EXPONENTIAL,
}
_BACKOFF_FROM_PROTO: dict[int, str] = {
    engine_pb2.BACKOFF_STRATEGY_UNSPECIFIED: Backoff.EXPONENTIAL.value,
    **{number: backoff.value for backoff, number in _BACKOFF_TO_PROTO.items()},
}


def workflow_to_proto(wf: WorkflowDef) -> engine_pb2.Workflow:
    """Return ``wf`` as a message.

    Args:
        wf: a definition, normally one returned by ``parse_mapping``.

    Returns:
        A new ``Workflow`` message; unset fields of ``wf`` are left unset.
    """
    return engine_pb2.Workflow(
        name=wf.name,
        version=wf.version,
        steps=[_step_to_proto(step) for step in wf.steps],
        default_retry=None if wf.default_retry is None else _retry_to_proto(wf.default_retry),
        budget=None if wf.budget is None else budget_to_proto(wf.budget),
        build_policy=_BUILD_POLICY_TO_PROTO[wf.build_policy],
    )


def workflow_from_proto(msg: engine_pb2.Workflow) -> WorkflowDef:
    """Validate a message into a definition, with the same rules as a document.

    Args:
        msg: the message, as a client sent it.

    Returns:
        The validated definition.

    Raises:
        InvalidArgument: for the first problem found; ``field`` is its path.
    """
    return parse_mapping(
        {
            "name": msg.name or None,
            "version": msg.version or None,
            "steps": [_step_mapping(step) for step in msg.steps],
            "default_retry": _retry_mapping(msg.default_retry),
            "budget": budget_mapping(check_budget(msg.budget)) if msg.HasField("budget") else None,
            "build_policy": _BUILD_POLICY_FROM_PROTO.get(msg.build_policy, msg.build_policy),
        }
    )


def stored_workflow(msg: engine_pb2.Workflow) -> WorkflowDef:
    """:func:`workflow_from_proto` of a definition as stored (a registered
    workflow, or the one a run record carries), validated once per distinct
    message: a run's definition does not change while it runs, and every
    change of the run reads it again. The definition is immutable, so the one
    kept is shared."""
    return _validated(msg.SerializeToString())


@functools.lru_cache(maxsize=STORED_WORKFLOWS)
def _validated(data: bytes) -> WorkflowDef:
    return workflow_from_proto(engine_pb2.Workflow.FromString(data))


@functools.lru_cache(maxsize=STORED_WORKFLOWS)
def stored_workflow_proto(wf: WorkflowDef) -> engine_pb2.Workflow:
    """:func:`workflow_to_proto` of a run's definition, made once per distinct
    definition, for every write of the run. Shared: copy it, never change it."""
    return workflow_to_proto(wf)


def _step_to_proto(step: StepDef) -> engine_pb2.Step:
    return engine_pb2.Step(
        id=step.id,
        type=_STEP_TYPE_TO_PROTO[step.type],
        task=step.task or "",
        workflow=step.workflow or "",
        depends_on=step.depends_on,
        retry=None if step.retry is None else _retry_to_proto(step.retry),
        timeout=None if step.timeout is None else duration(step.timeout),
        agent_loop=None if step.agent_loop is None else _loop_to_proto(step.agent_loop),
    )


def _retry_to_proto(policy: RetryPolicy) -> engine_pb2.RetryPolicy:
    return engine_pb2.RetryPolicy(
        max_attempts=policy.max_attempts,
        backoff=_BACKOFF_TO_PROTO[policy.backoff],
        initial_delay=duration(policy.initial_delay),
        max_delay=duration(policy.max_delay),
    )


def _loop_to_proto(bounds: AgentLoopBounds) -> engine_pb2.AgentLoop:
    return engine_pb2.AgentLoop(
        max_iterations=bounds.max_iterations,
        max_duration=None if bounds.max_duration is None else duration(bounds.max_duration),
        loop_delay=duration(bounds.loop_delay),
    )


def _step_mapping(step: engine_pb2.Step) -> dict[str, Any]:
    return {
        "id": step.id or None,
        "type": _STEP_TYPE_FROM_PROTO.get(step.type, step.type),
        "task": step.task or None,
        "workflow": step.workflow or None,
        "depends_on": list(step.depends_on),
        "retry": _retry_mapping(step.retry),
        "timeout": duration_seconds(step.timeout) or None,
        "agent_loop": _loop_mapping(step.agent_loop) if step.HasField("agent_loop") else None,
    }


def _retry_mapping(policy: engine_pb2.RetryPolicy) -> dict[str, Any] | None:
    if policy.max_attempts == 0:
        return None
    return {
        "max_attempts": policy.max_attempts,
        "backoff": _BACKOFF_FROM_PROTO.get(policy.backoff, policy.backoff),
        "initial_delay": (
            duration_seconds(policy.initial_delay) if policy.HasField("initial_delay") else None
        ),
        "max_delay": duration_seconds(policy.max_delay) if policy.HasField("max_delay") else None,
    }


def _loop_mapping(bounds: engine_pb2.AgentLoop) -> dict[str, Any]:
    return {
        "max_iterations": bounds.max_iterations or None,
        "max_duration": duration_seconds(bounds.max_duration) or None,
        "loop_delay": duration_seconds(bounds.loop_delay)
        if bounds.HasField("loop_delay")
        else None,
    }
