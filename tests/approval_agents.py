"""The agents of the approval tests, in a module light enough for the
crash tests' worker processes to import quickly: one whose model asks for a
tool that needs approval, and one whose model asks for three tools at once,
the third needing approval (a parallel group)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from dagnats.sdk import ApprovalPending, Replay, TaskContext, ToolCall, ToolRun

EMAIL = {"to": "bob@example.com", "body": "the invoice is attached"}


def approval_agent(runs: list[Any]) -> Callable[[TaskContext], Awaitable[None]]:
    """A handler whose model asks for ``send_email``, a tool that needs
    approval; it saves the model's response before the call, so the iteration
    after the wait makes the same call, and completes with the tool's result."""

    async def send_email(run: ToolRun) -> Any:
        runs.append(run.call.input)
        return {"sent": True, "to": run.call.input["to"]}

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        state = await tc.load_checkpoint() or {}
        if "call" not in state:

            async def model() -> Any:
                return {"tool": "send_email", "input": EMAIL}

            state["call"] = await j.model(model)
            await tc.checkpoint(state)
        call = ToolCall(name=state["call"]["tool"], input=state["call"]["input"])
        result = await j.tool(call, Replay.UNSAFE, send_email, approval=True)
        await tc.complete({"output": result.output, "error": result.error})

    return handler


GROUP = [
    ("lookup", {"who": "bob"}),
    ("attach", {"file": "invoice.pdf"}),
    ("send_email", EMAIL),
]
MATRIX_SAFE = frozenset({"lookup"})  # the crash matrix's group: one safe call, one unsafe


def group_agent(
    runs: list[tuple[str, Any]],
    needs: frozenset[str] = frozenset({"send_email"}),
    safe: frozenset[str] = frozenset(),
) -> Callable[[TaskContext], Awaitable[None]]:
    """A handler whose model asks for three tools at once, the third needing
    approval: one parallel group; the calls named in ``safe`` are
    ``Replay.SAFE``, the others unsafe. When the group waits, it keeps the
    results the others had, so the iteration the approval wakes makes only
    the call that waited; it completes with the three results in the
    response's order."""

    async def tool(run: ToolRun) -> Any:
        runs.append((run.call.name, run.call.input))
        return {"done": run.call.name}

    async def handler(tc: TaskContext) -> None:
        j = await tc.journal()
        state = await tc.load_checkpoint() or {}
        if "calls" not in state:

            async def model() -> Any:
                return [{"tool": name, "input": args} for name, args in GROUP]

            state = {"calls": await j.model(model), "results": {}}
            await tc.checkpoint(state)
        todo = [i for i in range(len(state["calls"])) if str(i) not in state["results"]]
        group = [
            (
                ToolCall(name=state["calls"][i]["tool"], input=state["calls"][i]["input"]),
                Replay.SAFE if state["calls"][i]["tool"] in safe else Replay.UNSAFE,
                tool,
                state["calls"][i]["tool"] in needs,
            )
            for i in todo
        ]
        try:
            results = await j.tools(group)
        except ApprovalPending as waiting:
            for i, result in zip(todo, waiting.results, strict=True):
                if not result.awaiting_approval:
                    state["results"][str(i)] = result.output
            await tc.checkpoint(state)
            raise
        for i, result in zip(todo, results, strict=True):
            state["results"][str(i)] = result.output
        await tc.complete([state["results"][str(i)] for i in range(len(state["calls"]))])

    return handler
