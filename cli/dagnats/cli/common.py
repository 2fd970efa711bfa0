"""What the commands share: the data directory's names, the usage error, and
how a run and JSON are printed."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

from dagnats.engine.v1 import engine_pb2 as pb
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
