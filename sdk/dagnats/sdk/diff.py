"""Two runs' journals side by side, from their common prefix: the comparison
``dagnats run diff``, ``GET /runs/{a}/diff/{b}`` and the console's diff view
show. Pure: runs and records in (as ``dagnats.sdk.views`` shows them), a
value out; no I/O.

A record is compared by what it records, not where or by whom: the model's
response, a tool call's name and input, a result, an input placed, a commit's
action and output. Claims and a fork's own record are left out (a forked
run's copies keep their source's content, under other sequences and
writers), and so is a commit's state, which the next records show anyway.
Each step's entries (a record's leading entry first) are matched from the
start; the first that differ, and every one after, are the difference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["diff_runs", "entries", "format_diff", "step_diff"]

SKIPPED = frozenset({"claim", "fork", "cancel"})
TEXT_LIMIT = 400


def entries(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A step's records (``views.record_dict``) as the entries a diff
    compares, in order: ``seq``, ``kind``, ``iteration``, ``text`` (what a
    person reads) and ``content`` (what is compared)."""
    found: list[dict[str, Any]] = []
    for r in records:
        for name in (r.get("leading"), r.get("kind")):
            if not name or name.removeprefix("leading_") in SKIPPED:
                continue
            kind = name.removeprefix("leading_")
            body = r.get(name) or {}
            content = _content(kind, body)
            found.append(
                {
                    "seq": r.get("seq", 0),
                    "kind": kind,
                    "iteration": r.get("iteration", 0),
                    "text": _text(kind, content),
                    "content": content,
                }
            )
    return found


def step_diff(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One step's records in two runs: how many entries they share from the
    start (``common``), and the rest side by side (``rows``: ``a`` and ``b``,
    either None where one run has no more)."""
    left, right = entries(a), entries(b)
    common = 0
    while (
        common < min(len(left), len(right)) and left[common]["content"] == right[common]["content"]
    ):
        common += 1
    rest_a, rest_b = left[common:], right[common:]
    rows = [
        {"a": _shown(rest_a, i), "b": _shown(rest_b, i)}
        for i in range(max(len(rest_a), len(rest_b)))
    ]
    return {"common": common, "rows": rows}


def diff_runs(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    journals_a: Mapping[str, Sequence[Mapping[str, Any]]],
    journals_b: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """Two runs (``views.run_dict``) and their steps' records: each step's
    diff, in the first run's step order, and the outcomes.

    Returns:
        ``{"a", "b", "outcome": {"a", "b", "same"}, "steps": [{"step",
        "common", "rows", "same"}]}``.
    """
    order = [s["step_id"] for s in a.get("steps", [])]
    order += [s["step_id"] for s in b.get("steps", []) if s["step_id"] not in order]
    steps = []
    for step in order:
        d = step_diff(journals_a.get(step, ()), journals_b.get(step, ()))
        steps.append({"step": step, **d, "same": not d["rows"]})
    outcome_a, outcome_b = _outcome(a), _outcome(b)
    return {
        "a": a.get("run_id", ""),
        "b": b.get("run_id", ""),
        "outcome": {"a": outcome_a, "b": outcome_b, "same": outcome_a == outcome_b},
        "steps": steps,
    }


def format_diff(diff: Mapping[str, Any], *, width: int = 60) -> str:
    """``diff_runs``'s answer as text: per step, the entries in common, then
    the rest in two columns (``a`` left, ``b`` right); then the outcomes."""
    lines = [f"a: run {diff['a']}", f"b: run {diff['b']}"]
    for step in diff["steps"]:
        same = " (the same)" if step["same"] else ""
        common = step["common"]
        lines.append(f"step {step['step']}: {common} {_entries(common)} in common{same}")
        for row in step["rows"]:
            left, right = (_cell(row[side], width) for side in ("a", "b"))
            lines.append(f"  {left:<{width + 8}} | {right}")
    outcome = diff["outcome"]
    for side in ("a", "b"):
        o = outcome[side]
        shown = o["error"] or _json(o["output"])
        lines.append(f"outcome {side}: {o['status']} {shown}")
    if outcome["same"]:
        lines.append("the outcomes are the same")
    return "\n".join(lines)


def _entries(n: int) -> str:
    return "entry" if n == 1 else "entries"


def _cell(entry: Mapping[str, Any] | None, width: int) -> str:
    if entry is None:
        return "-"
    text = entry["text"]
    text = text if len(text) <= width else text[: width - 1] + "…"
    return f"{entry['seq']:>6} {text}"


def _outcome(run: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "status": run.get("status", ""),
        "output": run.get("output"),
        "error": run.get("error", ""),
    }


def _content(kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
    match kind:
        case "model":
            return {"response": body.get("response")}
        case "tool_intent":
            return {"tool": body.get("name"), "input": body.get("input")}
        case "tool_intents":
            return {"tools": [[i.get("name"), i.get("input")] for i in body.get("intents", [])]}
        case "tool_result":
            return {
                "output": body.get("output"),
                "error": body.get("error", ""),
                "interrupted": bool(body.get("interrupted")),
            }
        case "tool_output":
            return {"chunk": body.get("chunk", "")}
        case "commit":
            return {"action": body.get("action"), "output": body.get("output")}
        case "input_placed":
            return {"mode": body.get("mode"), "content": body.get("content")}
    return {"body": dict(body)}


def _text(kind: str, content: Mapping[str, Any]) -> str:
    match kind:
        case "model":
            text = f"model: {_json(content['response'])}"
        case "tool_intent":
            text = f"tool {content['tool']}({_json(content['input'])})"
        case "tool_intents":
            text = "tools " + ", ".join(f"{n}({_json(i)})" for n, i in content["tools"])
        case "tool_result" if content["interrupted"]:
            text = "result: interrupted"
        case "tool_result":
            text = f"result: {content['error'] or _json(content['output'])}"
        case "commit":
            text = f"commit {content['action']}: {_json(content['output'])}"
        case "input_placed":
            text = f"input {content['mode']}: {_json(content['content'])}"
        case _:
            text = f"{kind}: {_json(content)}"
    return text if len(text) <= TEXT_LIMIT else text[: TEXT_LIMIT - 1] + "…"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _shown(rest: Sequence[Mapping[str, Any]], i: int) -> dict[str, Any] | None:
    if i >= len(rest):
        return None
    e = rest[i]
    return {"seq": e["seq"], "kind": e["kind"], "iteration": e["iteration"], "text": e["text"]}
