"""Workflow definitions: the records, their validation and the retry arithmetic.

Pure rules: data in, decisions out. No I/O, no ``async``, no grpc, no nats. A definition
is parsed and validated once, when it is registered; the engine only ever sees the
frozen records below.

Invariants of every ``WorkflowDef`` that :func:`parse_mapping` returns:

* the name, each step id, task type and child workflow name is one NATS token;
* step ids are unique; every ``depends_on`` entry names another step, at most once;
* the dependency graph is acyclic, and ``steps`` keep definition order;
* task and agent-loop steps have a ``task``; sub-workflow steps have a ``workflow``;
* agent-loop steps always carry bounds (the defaults when the block is left out) and
  other steps never do.

Document conventions: an explicit ``null`` for a field means the same as leaving it
out; durations are seconds, as a number or as a string such as ``"500ms"``, ``"30s"``,
``"1h30m"`` or ``"2d"``. Every error is an ``InvalidArgument`` whose ``field`` is a
path such as ``steps[1].depends_on[0]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar, assert_never

import yaml

from dagnats.core.durations import parse_duration
from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_token
from dagnats.core.usage import Budget, budget_mapping, parse_budget
from dagnats.engine.graph import (
    check_acyclic,
    check_dependencies_known,
    check_unique_ids,
    topological_order,
)

__all__ = [
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
]


class StepType(Enum):
    """How a step runs."""

    TASK = "task"
    AGENT_LOOP = "agent_loop"
    SUB_WORKFLOW = "sub_workflow"


class BuildPolicy(Enum):
    """Which worker build runs a step's later dispatches, once a build
    committed the step: ``pinned``, that build's workers while any poll; or
    ``upgrade``, any worker (the next iteration may run newer code, and its
    replay is the handler's responsibility)."""

    PINNED = "pinned"
    UPGRADE = "upgrade"


class Backoff(Enum):
    """How the delay between attempts grows."""

    FIXED = "fixed"
    LINEAR = "linear"
    EXPONENTIAL = "exponential"


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Bounds the attempts of one iteration of a step.

    ``max_attempts`` counts every attempt, the first one included (1 means no retry);
    delays are seconds.
    """

    max_attempts: int = 3
    backoff: Backoff = Backoff.EXPONENTIAL
    initial_delay: float = 1.0
    max_delay: float = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLoopBounds:
    """Bounds of an agent-loop step; ``max_duration`` None means unbounded."""

    max_iterations: int = 100
    max_duration: float | None = None
    loop_delay: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDef:
    """One node of a workflow; ``retry`` None means the workflow default applies."""

    id: str
    type: StepType = StepType.TASK
    task: str | None = None
    workflow: str | None = None
    depends_on: tuple[str, ...] = ()
    retry: RetryPolicy | None = None
    timeout: float | None = None
    agent_loop: AgentLoopBounds | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowDef:
    """A registered workflow: its steps in definition order."""

    name: str
    version: str = ""
    steps: tuple[StepDef, ...]
    default_retry: RetryPolicy | None = None
    budget: Budget | None = None  # of each run that sets none of its own
    build_policy: BuildPolicy = BuildPolicy.PINNED

    def step(self, step_id: str) -> StepDef:
        """Return the step with id ``step_id``.

        Raises:
            KeyError: if there is no such step.
        """
        for step in self.steps:
            if step.id == step_id:
                return step
        raise KeyError(step_id)

    def retry_for(self, step_id: str) -> RetryPolicy:
        """Return the policy of a step: its own, else the workflow default, else DEFAULT_RETRY.

        Raises:
            KeyError: if there is no such step.
        """
        return self.step(step_id).retry or self.default_retry or DEFAULT_RETRY

    def dependents(self, step_id: str) -> tuple[StepDef, ...]:
        """Return the steps that depend on ``step_id``, in definition order.

        Raises:
            KeyError: if there is no such step.
        """
        self.step(step_id)
        return tuple(step for step in self.steps if step_id in step.depends_on)

    def ancestors(self, step_id: str) -> frozenset[str]:
        """Return the steps ``step_id`` depends on, directly or through others."""
        found: set[str] = set()
        todo = list(self.step(step_id).depends_on)
        while todo:
            dep = todo.pop()
            if dep not in found:
                found.add(dep)
                todo.extend(self.step(dep).depends_on)
        return frozenset(found)

    def sinks(self) -> tuple[StepDef, ...]:
        """Return the steps nothing depends on, in definition order."""
        depended_on = {dep for step in self.steps for dep in step.depends_on}
        return tuple(step for step in self.steps if step.id not in depended_on)


DEFAULT_RETRY = RetryPolicy(
    max_attempts=3, backoff=Backoff.EXPONENTIAL, initial_delay=1.0, max_delay=60.0
)
DEFAULT_AGENT_LOOP = AgentLoopBounds(max_iterations=100, max_duration=None, loop_delay=0.0)

_MAX_ATTEMPTS = 100
_MAX_ITERATIONS = 1_000_000
# 2.0 ** 1023 is the largest finite power of two; beyond the cap the delay is max_delay.
_MAX_DOUBLINGS = 1000


def backoff_delay(policy: RetryPolicy, failed_attempt: int) -> float:
    """Return the delay in seconds before the attempt that follows ``failed_attempt``.

    Fixed: ``initial_delay``; linear: ``initial_delay * failed_attempt``; exponential:
    ``initial_delay * 2 ** (failed_attempt - 1)``. The result is capped at ``max_delay``
    when that is positive. There is no jitter.

    Args:
        policy: the retry policy of the step.
        failed_attempt: number of the attempt that failed, from 1.

    Returns:
        The delay in seconds.

    Raises:
        ValueError: if ``failed_attempt`` is below 1.
    """
    if failed_attempt < 1:
        raise ValueError(f"failed_attempt counts from 1, got {failed_attempt}")
    delay = _uncapped_delay(policy, failed_attempt)
    return min(delay, policy.max_delay) if policy.max_delay > 0 else delay


def _uncapped_delay(policy: RetryPolicy, failed_attempt: int) -> float:
    match policy.backoff:
        case Backoff.FIXED:
            return policy.initial_delay
        case Backoff.LINEAR:
            return policy.initial_delay * failed_attempt
        case Backoff.EXPONENTIAL:
            return policy.initial_delay * 2.0 ** min(failed_attempt - 1, _MAX_DOUBLINGS)
        case _:
            assert_never(policy.backoff)


def _positive_duration(value: Any, field: str) -> float:
    seconds = parse_duration(value, field=field)
    if seconds == 0:
        raise InvalidArgument(
            f"{field} must be greater than 0; leave it out for no bound", field=field
        )
    return seconds


# ---------------------------------------------------------------------------------------
# Parsing

_WORKFLOW_KEYS = ("name", "version", "steps", "default_retry", "budget", "build_policy")
_STEP_KEYS = ("id", "type", "task", "workflow", "depends_on", "retry", "timeout", "agent_loop")
_RETRY_KEYS = ("max_attempts", "backoff", "initial_delay", "max_delay")
_LOOP_KEYS = ("max_iterations", "max_duration", "loop_delay")
_TARGET_OF = {
    StepType.TASK: "task",
    StepType.AGENT_LOOP: "task",
    StepType.SUB_WORKFLOW: "workflow",
}

_T = TypeVar("_T")
_E = TypeVar("_E", bound=Enum)


def parse_document(text: str) -> WorkflowDef:
    """Parse and validate a workflow written as YAML or JSON.

    Args:
        text: the document.

    Returns:
        The validated definition.

    Raises:
        InvalidArgument: if the text is not YAML, not a mapping, or not a valid workflow.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(
            f"document is not valid YAML or JSON: {_yaml_problem(exc)}", field="document"
        ) from exc
    except (ValueError, RecursionError) as exc:  # bad timestamps, absurd nesting
        raise InvalidArgument(f"document could not be read: {exc}", field="document") from exc
    if data is None:
        raise InvalidArgument("document is empty", field="document")
    if not isinstance(data, Mapping):
        raise InvalidArgument(
            f"document must be a mapping of workflow fields, got {_kind(data)}", field="document"
        )
    return parse_mapping(data)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(exc)


def parse_mapping(data: Mapping[str, Any]) -> WorkflowDef:
    """Validate a decoded document (or a mapping built from a message) into a definition.

    Args:
        data: the workflow fields: ``name``, ``version``, ``steps``, ``default_retry``,
            ``build_policy``.

    Returns:
        The validated definition, steps in definition order.

    Raises:
        InvalidArgument: for the first problem found; ``field`` is its path.
    """
    _check_keys(_mapping(data, "workflow"), _WORKFLOW_KEYS, "")
    name = check_token(_required(data, "name", ""), field="name")
    version = data.get("version")
    if version is not None and not isinstance(version, str):
        raise InvalidArgument(
            f"version must be a string, got {version!r} (quote it in YAML)", field="version"
        )
    return WorkflowDef(
        name=name,
        version=version or "",
        steps=_parse_steps(_required(data, "steps", "")),
        default_retry=_optional(data, "default_retry", "", _parse_retry),
        budget=_optional(data, "budget", "", parse_budget),
        build_policy=_optional(data, "build_policy", "", _build_policy) or BuildPolicy.PINNED,
    )


def _build_policy(value: Any, field: str) -> BuildPolicy:
    return _choice(BuildPolicy, value, field)


def _parse_steps(value: Any) -> tuple[StepDef, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidArgument(
            f"steps must be a non-empty list of steps, got {value!r}", field="steps"
        )
    steps = tuple(_parse_step(item, f"steps[{i}]") for i, item in enumerate(value))
    check_unique_ids(steps)
    check_dependencies_known(steps)
    check_acyclic(steps)
    return steps


def _parse_step(value: Any, path: str) -> StepDef:
    data = _mapping(value, path)
    _check_keys(data, _STEP_KEYS, path)
    step_id = check_token(_required(data, "id", path), field=f"{path}.id")
    step_type = _choice(StepType, data.get("type", "task"), f"{path}.type")
    return StepDef(
        id=step_id,
        type=step_type,
        task=_target(data, "task", step_type, path, step_id),
        workflow=_target(data, "workflow", step_type, path, step_id),
        depends_on=_depends_on(data.get("depends_on"), f"{path}.depends_on", step_id),
        retry=_optional(data, "retry", path, _parse_retry),
        timeout=_optional(data, "timeout", path, _positive_duration),
        agent_loop=_agent_loop(data, step_type, path, step_id),
    )


def _target(
    data: Mapping[str, Any], key: str, step_type: StepType, path: str, step_id: str
) -> str | None:
    # `task` names what workers poll for, `workflow` the child run to start; a step has
    # exactly the one its type calls for.
    value = data.get(key)
    field = f"{path}.{key}"
    if _TARGET_OF[step_type] == key and value is None:
        raise InvalidArgument(
            f"step {step_id!r} of type {step_type.value} requires field {key!r}", field=field
        )
    if _TARGET_OF[step_type] != key and value is not None:
        raise InvalidArgument(
            f"step {step_id!r} of type {step_type.value} must not set {key!r}", field=field
        )
    return None if value is None else check_token(value, field=field)


def _depends_on(value: Any, path: str, step_id: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise InvalidArgument(f"{path} must be a list of step ids, got {_kind(value)}", field=path)
    deps: list[str] = []
    for i, dep in enumerate(value):
        field = f"{path}[{i}]"
        if not isinstance(dep, str):
            raise InvalidArgument(f"{field} must be a step id, got {dep!r}", field=field)
        if dep == step_id:
            raise InvalidArgument(f"step {step_id!r} depends on itself", field=field)
        if dep in deps:
            raise InvalidArgument(f"step {step_id!r} lists dependency {dep!r} twice", field=field)
        deps.append(dep)
    return tuple(deps)


def _agent_loop(
    data: Mapping[str, Any], step_type: StepType, path: str, step_id: str
) -> AgentLoopBounds | None:
    value = data.get("agent_loop")
    if step_type is not StepType.AGENT_LOOP:
        if value is not None:
            raise InvalidArgument(
                f"step {step_id!r} of type {step_type.value} must not set 'agent_loop'; "
                "only agent_loop steps have loop bounds",
                field=f"{path}.agent_loop",
            )
        return None
    if value is None:
        return DEFAULT_AGENT_LOOP
    path = f"{path}.agent_loop"
    loop = _mapping(value, path)
    _check_keys(loop, _LOOP_KEYS, path)
    return AgentLoopBounds(
        max_iterations=_int_in_range(
            loop, "max_iterations", path, _MAX_ITERATIONS, DEFAULT_AGENT_LOOP.max_iterations
        ),
        max_duration=_optional(loop, "max_duration", path, _positive_duration),
        loop_delay=_duration_or(loop, "loop_delay", path, DEFAULT_AGENT_LOOP.loop_delay),
    )


def _parse_retry(value: Any, path: str) -> RetryPolicy:
    data = _mapping(value, path)
    _check_keys(data, _RETRY_KEYS, path)
    initial_delay = _duration_or(data, "initial_delay", path, DEFAULT_RETRY.initial_delay)
    max_delay = _duration_or(data, "max_delay", path, DEFAULT_RETRY.max_delay)
    if max_delay < initial_delay:
        raise InvalidArgument(
            f"{path}.max_delay ({max_delay:g}s) must be at least "
            f"initial_delay ({initial_delay:g}s)",
            field=f"{path}.max_delay",
        )
    return RetryPolicy(
        max_attempts=_int_in_range(
            data, "max_attempts", path, _MAX_ATTEMPTS, DEFAULT_RETRY.max_attempts
        ),
        backoff=_choice(Backoff, data.get("backoff", "exponential"), f"{path}.backoff"),
        initial_delay=initial_delay,
        max_delay=max_delay,
    )


# ---------------------------------------------------------------------------------------
# Field helpers


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{path} must be a mapping, got {_kind(value)}", field=path)
    return value


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
    for key in data:
        if key not in allowed:
            raise InvalidArgument(
                f"unknown field {key!r} in {prefix or 'workflow'}; "
                f"expected one of {', '.join(allowed)}",
                field=_join(prefix, str(key)),
            )


def _required(data: Mapping[str, Any], key: str, prefix: str) -> Any:
    value = data.get(key)
    if value is None:
        raise InvalidArgument(
            f"missing required field {key!r} in {prefix or 'workflow'}", field=_join(prefix, key)
        )
    return value


def _optional(
    data: Mapping[str, Any], key: str, prefix: str, parse: Callable[[Any, str], _T]
) -> _T | None:
    value = data.get(key)
    return None if value is None else parse(value, _join(prefix, key))


def _duration_or(data: Mapping[str, Any], key: str, prefix: str, default: float) -> float:
    value = data.get(key)
    return default if value is None else parse_duration(value, field=_join(prefix, key))


def _int_in_range(data: Mapping[str, Any], key: str, prefix: str, high: int, default: int) -> int:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        field = _join(prefix, key)
        raise InvalidArgument(
            f"{field} must be an integer from 1 to {high}, got {value!r}", field=field
        )
    return value


def _choice(enum_type: type[_E], value: Any, field: str) -> _E:
    for member in enum_type:
        if value is member or (isinstance(value, str) and value == member.value):
            return member
    choices = ", ".join(str(member.value) for member in enum_type)
    raise InvalidArgument(f"{field} must be one of {choices}, got {value!r}", field=field)


# ---------------------------------------------------------------------------------------
# Back to a mapping


def to_mapping(wf: WorkflowDef) -> dict[str, Any]:
    """Return ``wf`` as a JSON-compatible mapping that :func:`parse_mapping` accepts.

    Durations come out as seconds (floats); unset fields are left out.

    Args:
        wf: the workflow.

    Returns:
        A new dict of plain str, int, float, list and dict values.
    """
    data: dict[str, Any] = {"name": wf.name}
    if wf.version:
        data["version"] = wf.version
    if wf.default_retry is not None:
        data["default_retry"] = _retry_mapping(wf.default_retry)
    if wf.budget is not None:
        data["budget"] = budget_mapping(wf.budget)
    if wf.build_policy is not BuildPolicy.PINNED:
        data["build_policy"] = wf.build_policy.value
    data["steps"] = [_step_mapping(step) for step in wf.steps]
    return data


def _step_mapping(step: StepDef) -> dict[str, Any]:
    data: dict[str, Any] = {"id": step.id, "type": step.type.value}
    optional: dict[str, Any] = {
        "task": step.task,
        "workflow": step.workflow,
        "depends_on": list(step.depends_on) or None,
        "retry": None if step.retry is None else _retry_mapping(step.retry),
        "timeout": step.timeout,
        "agent_loop": None if step.agent_loop is None else _loop_mapping(step.agent_loop),
    }
    data.update((key, value) for key, value in optional.items() if value is not None)
    return data


def _retry_mapping(policy: RetryPolicy) -> dict[str, Any]:
    return {
        "max_attempts": policy.max_attempts,
        "backoff": policy.backoff.value,
        "initial_delay": policy.initial_delay,
        "max_delay": policy.max_delay,
    }


def _loop_mapping(bounds: AgentLoopBounds) -> dict[str, Any]:
    data: dict[str, Any] = {"max_iterations": bounds.max_iterations}
    if bounds.max_duration is not None:
        data["max_duration"] = bounds.max_duration
    data["loop_delay"] = bounds.loop_delay
    return data
