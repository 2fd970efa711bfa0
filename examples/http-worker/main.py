"""Runs the example agent (agent.py) over the HTTP bridge until SIGINT or SIGTERM.

    python examples/http-worker/main.py [task-type]

Settings come from the environment:

    DAGNATS_GATEWAY       the gateway's URL; else the one in .dagnats/dev.json of
                          the current directory (written by `dagnats dev`); else
                          http://127.0.0.1:8080
    DAGNATS_BRIDGE_TOKEN  bearer token of the bridge, when the gateway has one
    DAGNATS_TASK_TYPE     task type to poll for, when not given as an argument
                          (default http-agent)
    TOOL_STARTS_FILE      append a line per start of the unsafe tool here
    MODEL_CALLS_FILE      append a line per model request here
    HANG_IN_TOOL_MARKER   the first start of the tool creates this file and
                          hangs (later starts, in any process, do not)
    WORKER_POLL_WAIT      seconds one poll waits for tasks (default 5)
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

from agent import agent_turn, charge_card, scripted_model
from bridge_client import Bridge, BridgeError, Task

log = logging.getLogger("http-worker")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s http-worker %(message)s")
    env = os.environ
    task_type = (sys.argv[1:] or [env.get("DAGNATS_TASK_TYPE") or "http-agent"])[0]
    url = env.get("DAGNATS_GATEWAY") or _dev_gateway() or "http://127.0.0.1:8080"
    bridge = Bridge(url, token=env.get("DAGNATS_BRIDGE_TOKEN"))
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    poll_wait = float(env.get("WORKER_POLL_WAIT") or 5)

    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        log.info("%s: stopping after the current task", signal.Signals(signum).name)
        stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)

    log.info("gateway %s, task type %s, worker %s", url, task_type, worker_id)
    failures = 0
    while not stopping.is_set():
        try:
            tasks = bridge.poll([task_type], wait=poll_wait, worker_id=worker_id)
        except (BridgeError, OSError) as err:
            failures += 1
            delay = min(0.2 * 2**failures, 10.0)
            log.warning("poll failed (%s); retrying in %.1fs", err, delay)
            stopping.wait(delay)
            continue
        failures = 0
        for task in tasks:
            handle(task, env)


def handle(task: Task, env: os._Environ[str]) -> None:
    info = task.info
    log.info("run %s step %s iteration %s", info["run_id"], info["step_id"], info["iteration"])
    tools = {
        "charge_card": charge_card(
            task, env.get("TOOL_STARTS_FILE"), env.get("HANG_IN_TOOL_MARKER")
        )
    }
    task.keep_alive()
    try:
        agent_turn(task, scripted_model(env.get("MODEL_CALLS_FILE")), tools)
    except BridgeError as err:
        if err.lost:  # finished, fenced or cancelled: nothing to resolve
            log.info("task over: %s", err)
            return
        _fail(task, f"bridge error: {err}")
    except Exception as err:
        log.exception("the turn failed")
        _fail(task, f"{type(err).__name__}: {err}")
    finally:
        task.done.set()  # stops the heartbeats


def _fail(task: Task, error: str) -> None:
    """Fail the attempt (the step's retry policy applies), unless the task is lost."""
    if task.done.is_set():
        return
    try:
        task.resolve("fail", error=error)
    except (BridgeError, OSError) as err:
        log.warning("could not fail the task (%s); its lease will run out", err)


def _dev_gateway() -> str | None:
    try:
        gateway = json.loads(Path(".dagnats/dev.json").read_text())["gateway"]
    except (OSError, ValueError, KeyError):
        return None
    return str(gateway)


if __name__ == "__main__":
    main()
