"""The dependency graph of a workflow: unique step ids, known dependencies,
no cycles, and the order in which steps become ready.

Pure functions over the parsed definition (``dagnats.engine.definition``);
each problem is an ``InvalidArgument`` naming the offending field.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dagnats.core.errors import InvalidArgument

if TYPE_CHECKING:
    from dagnats.engine.definition import StepDef, WorkflowDef


def topological_order(wf: WorkflowDef) -> tuple[str, ...]:
    """Return the step ids with every step after its dependencies.

    Among steps that are ready at the same time, definition order decides.

    Args:
        wf: the workflow.

    Returns:
        Every step id once.

    Raises:
        InvalidArgument: if ``wf`` was built by hand with an unknown dependency or a cycle.
    """
    index = {step.id: i for i, step in enumerate(wf.steps)}
    waiting = [len(step.depends_on) for step in wf.steps]
    dependents: list[list[int]] = [[] for _ in wf.steps]
    for i, step in enumerate(wf.steps):
        for dep in step.depends_on:
            if dep in index:
                dependents[index[dep]].append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    order: list[str] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(wf.steps[i].id)
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < len(wf.steps):
        check_dependencies_known(wf.steps)
        check_acyclic(wf.steps)
    return tuple(order)


def check_unique_ids(steps: Sequence[StepDef]) -> None:
    first: dict[str, int] = {}
    for i, step in enumerate(steps):
        if step.id in first:
            raise InvalidArgument(
                f"duplicate step id {step.id!r} (steps[{first[step.id]}] and steps[{i}])",
                field=f"steps[{i}].id",
            )
        first[step.id] = i


def check_dependencies_known(steps: Sequence[StepDef]) -> None:
    known = {step.id for step in steps}
    for i, step in enumerate(steps):
        for j, dep in enumerate(step.depends_on):
            if dep not in known:
                raise InvalidArgument(
                    f"step {step.id!r} depends on unknown step {dep!r}",
                    field=f"steps[{i}].depends_on[{j}]",
                )


def check_acyclic(steps: Sequence[StepDef]) -> None:
    cycle = _find_cycle(steps)
    if cycle is not None:
        index = {step.id: i for i, step in enumerate(steps)}
        raise InvalidArgument(
            "dependency cycle: " + " -> ".join((*cycle, cycle[0])),
            field=f"steps[{index[cycle[0]]}].depends_on",
        )


def _find_cycle(steps: Sequence[StepDef]) -> tuple[str, ...] | None:
    # Iterative depth-first search along depends_on edges, so a long chain cannot hit
    # the recursion limit. "a -> b" in the result means a depends on b.
    deps = {step.id: step.depends_on for step in steps}
    done: set[str] = set()
    for root in deps:
        if root in done:
            continue
        path, stack = [root], [iter(deps[root])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return _rotate(path[path.index(nxt) :], list(deps))
            elif nxt in deps and nxt not in done:
                path.append(nxt)
                stack.append(iter(deps[nxt]))
    return None


def _rotate(cycle: list[str], definition_order: list[str]) -> tuple[str, ...]:
    # Start the cycle at its earliest-defined step, so the message does not depend on
    # where the search happened to enter it.
    start = min(range(len(cycle)), key=lambda i: definition_order.index(cycle[i]))
    return tuple(cycle[start:] + cycle[:start])
