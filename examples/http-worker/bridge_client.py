"""A small client of the dagnats HTTP bridge, with nothing but the standard
library: no dagnats SDK, no gRPC.

``Bridge`` makes the calls; ``Task`` is one leased task. It keeps the latest
task token (every journal action returns the next one) and makes one call at
a time, so a heartbeat from the background thread always sends the token of
the last write.

Errors come back as JSON ``{"code", "message"}``; ``BridgeError`` carries
them. Two families end a task without anything left to do:

- 409 ``fenced`` (a successor holds the task) and ``cancelled`` (the run was
  cancelled): stop, and do not resolve;
- 410 ``stale``, ``committed``, ``restart_limit``: the task is finished
  (the bridge settled it when the journal said so).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

# Codes after which a task is over for this worker.
LOST = frozenset({"fenced", "cancelled", "stale", "committed", "restart_limit"})


class BridgeError(Exception):
    """The bridge answered with an error."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message

    @property
    def lost(self) -> bool:
        """The task is finished or held by another worker: stop working on it."""
        return self.code in LOST


class Bridge:
    """POSTs JSON to the bridge at ``url`` (such as ``http://127.0.0.1:8080``)."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def call(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            f"{self.url}/bridge/{path}",
            data=json.dumps(body).encode(),
            headers=headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:
            try:
                answer = json.load(err)
            except ValueError:
                answer = {}
            raise BridgeError(
                err.code, answer.get("code", "error"), answer.get("message", err.reason)
            ) from None

    def poll(self, task_types: list[str], *, wait: float, worker_id: str) -> list[Task]:
        """Lease up to one task, waiting up to ``wait`` seconds for it."""
        body = {"task_types": task_types, "wait": wait, "worker_id": worker_id}
        answer = self.call("poll", body, timeout=wait + self.timeout)
        return [Task(self, leased) for leased in answer["tasks"]]


class Task:
    """One leased task and its latest token."""

    def __init__(self, bridge: Bridge, leased: dict[str, Any]) -> None:
        self.bridge = bridge
        self.info: dict[str, Any] = leased["task"]
        self.lease_seconds: float = leased["lease_seconds"]
        self.token: str = leased["token"]
        self.done = threading.Event()  # set once the task is settled, finished elsewhere or lost
        self._lock = threading.Lock()

    @property
    def input(self) -> Any:
        return self.info["input"]

    def call(self, path: str, **body: Any) -> Any:
        with self._lock:
            try:
                answer = self.bridge.call(path, {"token": self.token, **body})
            except BridgeError as err:
                if err.lost:
                    self.done.set()
                raise
            if "token" in answer:
                self.token = answer["token"]
            return answer

    # The journal. The first call claims it.

    def read(self) -> dict[str, Any]:
        """Claim the journal; this iteration's records and the state loaded."""
        answer: dict[str, Any] = self.call("journal/read")
        return answer

    def model(self, ask: Callable[[], Any]) -> Any:
        """The response recorded at this position, or ``ask()`` recorded."""
        begun = self.call("journal/model/begin")
        if begun["recorded"]:
            return begun["response"]
        response = ask()
        self.call("journal/model/record", response=response)
        return response

    def tool(
        self, name: str, value: Any, replay: str, run: Callable[[dict[str, Any]], Any]
    ) -> dict[str, Any]:
        """Run a tool call durably: the intent before ``run``, the result after.

        ``run`` gets ``{"name", "input", "key", "report"}``; ``report(chunk)``
        records partial output. An exception from ``run`` is the tool's own
        error, part of its result. A call an earlier holder started and did not
        finish comes back ``interrupted`` instead of running again (for an
        unsafe tool).
        """
        begun = self.call("journal/tool/begin", name=name, input=value, replay=replay)
        if not begun["run"]:
            result: dict[str, Any] = begun["result"]
            return result

        def report(chunk: str) -> None:
            self.call("journal/tool/output", chunk=chunk)

        call = {"name": name, "input": value, "key": begun["key"], "report": report}
        try:
            output = run(call)
        except BridgeError:
            raise
        except Exception as err:  # the tool's own error is part of its result
            error = f"{type(err).__name__}: {err}"
            self.call("journal/tool/finish", error=error)
            return {"output": None, "error": error, "interrupted": False, "partial": ""}
        self.call("journal/tool/finish", output=output)
        return {"output": output, "error": "", "interrupted": False, "partial": ""}

    # Settling.

    def resolve(self, outcome: str, **fields: Any) -> dict[str, Any]:
        """``continue``, ``complete``, ``fail``, ``fail_permanent`` or ``pause``.
        Once the journal is claimed, the bridge commits (with ``state``) first."""
        answer: dict[str, Any] = self.call("resolve", outcome=outcome, **fields)
        self.done.set()  # settled: nothing left to keep alive
        return answer

    def heartbeat(self) -> None:
        self.call("heartbeat")

    def keep_alive(self) -> threading.Thread:
        """Heartbeat in the background, a third of the lease apart, until the
        task is settled or lost."""

        def beat() -> None:
            interval = max(self.lease_seconds / 3, 0.05)
            while not self.done.wait(interval):
                try:
                    self.heartbeat()
                except BridgeError:
                    continue  # a lost task sets done; anything else: try again
                except OSError:
                    continue  # the gateway is unreachable; the lease is longer

        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        return thread
