"""What the commands share: the data directory's names, the usage error,
how a run and JSON are printed, and the handlers ``--handlers module:attr``
names (for ``serve all``, ``dev`` and ``journal replay``; importing them
needs no server extra)."""

from __future__ import annotations

import asyncio
import importlib
import json
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Handler
from dagnats.sdk.views import decode_payload, enum_name, run_dict

DEFAULT_DATA_DIR = ".dagnats"
DEV_FILE = "dev.json"


class UsageError(Exception):
    """Bad command-line input, reported like a domain error."""


def dumps(value: Any) -> str:
    """JSON for a person and for a program alike: indented, text as written."""
    return json.dumps(value, indent=2, ensure_ascii=False)


def print_run(run: pb.Run, as_json: bool) -> None:
    if as_json:
        print(dumps(run_dict(run)))
        return
    print(f"run       {run.run_id}")
    print(f"workflow  {run.workflow}")
    print(f"status    {enum_name(pb.RunStatus, run.status)}")
    if run.HasField("forked_from"):
        o = run.forked_from
        print(f"forked    from run {o.run_id} step {o.step_id} at seq {o.at_seq}")
    if run.settings:
        print(f"settings  {', '.join(f'{k}={v}' for k, v in sorted(run.settings.items()))}")
    if run.error:
        print(f"error     {run.error}")
    if run.output:
        print(f"output    {json.dumps(decode_payload(run.output), ensure_ascii=False)}")
    for step in run.steps:
        line = f"  step {step.step_id:<16} {enum_name(pb.StepStatus, step.status):<10}"
        line += f" iteration {step.iteration} attempt {step.attempt}"
        if step.build_id:
            line += f"  build {step.build_id}"
        if step.waiting_for_build:
            line += f"  waiting for build {step.build_id}"
        if step.error:
            line += f"  error: {step.error}"
        print(line)


def print_usage(usage: pb.RunUsage) -> None:
    """A run's usage under its ``run get``: the run's, then each step's; one
    line when no model call of the run reported any (a stand-in model, or
    none called)."""
    total = usage.total
    if not (total.spent.calls or total.copied.calls):
        print("usage     none reported by its model calls")
        return
    print(f"usage     {usage_line(usage.total)}")
    for step in usage.steps:
        print(f"  usage {step.step_id:<15} {usage_line(step.usage)}")


def usage_line(split: pb.UsageSplit) -> str:
    """Spent tokens and cost, what of it was kept, retried and fenced, and
    the calls a fork copied (its source's spending)."""
    spent = split.spent
    line = (
        f"{spent.calls} calls, {spent.input_tokens} in ({spent.cached_tokens} cached), "
        f"{spent.output_tokens} out"
    )
    if spent.cost_micros:
        line += f", cost {spent.cost_micros / 1_000_000:g}"
    parts = [f"{getattr(split, k).calls} {k}" for k in ("kept", "retried", "fenced")]
    if split.copied.calls:
        parts.append(f"{split.copied.calls} copied by a fork")
    return f"{line}; calls: {', '.join(parts)}"


def stop_on_signals() -> None:
    """SIGTERM and SIGINT cancel the running task once, so that its
    ``finally`` blocks stop everything in order: SIGINT too when it came in
    ignored (a process started in the background of a script), SIGTERM too
    (a container being stopped). A second signal while it stops changes
    nothing: cancelled again, the stop would be cut short."""
    main = asyncio.current_task()
    if main is None:
        return
    stopping = False

    def stop() -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop)


def load_handlers(spec: str) -> dict[str, Handler]:
    """The handlers that ``module:attr`` names, imported with the working
    directory on the import path (as ``python -m`` would have it).

    Raises:
        UsageError: the spec is malformed, the module does not import, or the
            attribute is not a mapping of task type to callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--handlers must be module:attribute, got {spec!r}")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"--handlers: cannot import {module_name}: {err}") from None
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise UsageError(f"--handlers: {module_name} has no {attr}") from None
        found = getattr(found, part)
    if not isinstance(found, Mapping) or not found:
        raise UsageError(
            f"--handlers: {spec} must be a mapping of task type to handler, "
            f"got {type(found).__name__}"
        )
    for task_type, handler in found.items():
        if not isinstance(task_type, str) or not callable(handler):
            raise UsageError(
                f"--handlers: {spec} maps {task_type!r} to {type(handler).__name__}; "
                "each task type (a string) needs an async handler"
            )
    return dict(found)
