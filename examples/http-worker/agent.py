"""The agent: one turn of a tool-using agent per iteration of an agent_loop
step, journaled through the bridge's replay actions. The same agent as
``examples/node-worker/agent.js``: a scripted model, and one tool,
``charge_card``, that is unsafe (running it twice would charge twice).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge_client import Task

Model = Callable[[list[Any]], Any]


@dataclass(frozen=True)
class Tool:
    replay: str  # "safe" or "unsafe"
    run: Callable[[dict[str, Any]], Any]


def agent_turn(task: Task, model: Model, tools: dict[str, Tool]) -> None:
    """One turn: claim the journal, load the conversation, ask the model, run
    the tool it picks and continue, or complete with its answer."""
    claim = task.read()  # the first journal action claims; earlier holders are fenced
    history: list[Any] = claim["state"] if claim["has_state"] else [task.input]
    reply = task.model(lambda: model(history))  # recorded; reused after a crash
    if "answer" in reply:
        # The state rides the commit the bridge writes before it reports.
        task.resolve("complete", output=reply["answer"], state=[*history, {"reply": reply}])
        return
    tool = tools.get(reply["tool"])
    if tool is None:
        task.resolve("fail_permanent", error=f"the model asked for an unknown tool: {reply}")
        return
    # A call an earlier holder started and did not finish comes back
    # interrupted (with the partial output it reported) instead of running.
    result = task.tool(reply["tool"], reply["input"], tool.replay, tool.run)
    turn = {"reply": reply, **result}
    task.resolve(
        "continue",
        output={"tool": reply["tool"], "interrupted": result["interrupted"]},
        state=[*history, turn],
    )


def scripted_model(calls_file: str | None = None) -> Model:
    """What a model would say: charge the order, then answer. A pure function
    of the conversation, so every process answers the same. Each request
    appends a line to ``calls_file``, so a test can tell a reused response
    from a new request."""

    def ask(history: list[Any]) -> Any:
        turns = sum(1 for entry in history if isinstance(entry, dict) and "reply" in entry)
        if calls_file:
            _append(calls_file, f"turn {turns}\n")
        first = history[0] if history and isinstance(history[0], dict) else {}
        order = first.get("order", "A-1001")
        amount = first.get("amount_cents", 4200)
        if turns == 0:
            return {"tool": "charge_card", "input": {"order": order, "amount_cents": amount}}
        return {"answer": f"Order {order}: payment submitted."}

    return ask


def charge_card(task: Task, starts_file: str | None, hang_marker: str | None) -> Tool:
    """The unsafe tool. Each start appends a line to ``starts_file`` first,
    outside the journal. With ``hang_marker``, the first start (the one that
    creates the marker file) reports partial output and then hangs until the
    task is lost, so a test can kill the process inside the tool."""

    def run(call: dict[str, Any]) -> Any:
        if starts_file:
            _append(starts_file, f"{call['name']} {call['key']}\n")
        order, amount = call["input"]["order"], call["input"]["amount_cents"]
        call["report"](f"charging {amount} cents for order {order};")
        if hang_marker and _create_once(hang_marker):
            task.done.wait()  # until killed, fenced or cancelled
            raise RuntimeError("the task was lost while charging")
        # A real payment API would take call["key"] as its idempotency key.
        return {"charged": True, "order": order, "amount_cents": amount, "charge_id": call["key"]}

    return Tool(replay="unsafe", run=run)


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _create_once(path: str) -> bool:
    try:
        with open(path, "x", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    except FileExistsError:
        return False
    return True
