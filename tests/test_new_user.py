"""The README's own path, as a new user walks it: ``dagnats dev`` in its own
process with its data in a directory of its own, the ``dagnats`` command as
a process (finding that engine through ``--data-dir``, never through
``DAGNATS_ENGINE``), and HTTP requests shaped like the ``curl`` lines of
docs/how-to/http-api.md and the spec's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from dagnats.core.ids import MAX_SEQ
from tests.stack import DevProcess, loop_workflow, start_dev, unique

# What `curl -d` sends when no Content-Type is given.
CURL_FORM = {"Content-Type": "application/x-www-form-urlencoded"}


class Dev:
    """The running ``dagnats dev`` of this module and how to reach it."""

    def __init__(self, process: DevProcess, data: Path, stderr: Path, elsewhere: Path) -> None:
        self.process, self.data, self.stderr, self.elsewhere = process, data, stderr, elsewhere
        self.http = httpx.Client(base_url=process.gateway, timeout=30)

    def cli(self, *args: str, data_dir: bool = True, **kw: Any) -> Any:
        """``dagnats [--data-dir D] args`` from another directory, with no
        ``DAGNATS_*`` variable set."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAGNATS_")}
        prefix = ["--data-dir", str(self.data)] if data_dir else []
        command = [sys.executable, "-m", "dagnats.cli.main", *prefix, *args]
        kw.setdefault("capture_output", True)
        return subprocess.run(command, text=True, timeout=90, env=env, cwd=self.elsewhere, **kw)

    def demo_run(self) -> str:
        runs = self.http.get("/runs", params={"workflow": "demo-agent"}).json()["runs"]
        run_id: str = runs[-1]["run_id"]
        return run_id


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    root = tmp_path_factory.mktemp("new-user")
    data, stderr, elsewhere = root / "data", root / "dev.stderr", root / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGNATS_")}
    process = start_dev(data, env=env, stderr=stderr)
    found = Dev(process, data, stderr, elsewhere)
    try:
        yield found
    finally:
        found.http.close()
        process.proc.terminate()
        process.proc.communicate(timeout=30)
    problems = stderr.read_text()
    assert "Traceback" not in problems and "Exception in ASGI" not in problems, problems


# ---- the demo agent and the CLI ----------------------------------------------------


def test_the_readme_run_start_wait_completes_again_and_again(dev: Dev) -> None:
    # `dagnats dev` ran the demo once; the README then starts it twice more.
    for question in ("again?", "and once more?"):
        started = dev.cli(
            "run", "start", "demo-agent", "--input", json.dumps({"question": question}), "--wait"
        )
        assert started.returncode == 0, started.stdout + started.stderr
        assert "status    completed" in started.stdout
        assert "Lisbon" in started.stdout
    listed = dev.cli("run", "list", "--workflow", "demo-agent", "--json")
    runs = json.loads(listed.stdout)
    assert [r["status"] for r in runs] == ["completed"] * 3
    # The demo is journaled: what `dagnats dev` tells the user to look at shows it.
    run_id = runs[0]["run_id"]
    read = dev.cli("journal", "read", run_id, "agent")
    assert read.returncode == 0 and "tool_result" in read.stdout, read.stderr
    check = dev.cli("journal", "check", run_id)
    assert check.returncode == 0 and "0 violations" in check.stdout, check.stdout


def test_the_data_dir_names_the_dev_json_to_use(dev: Dev) -> None:
    found = dev.cli("run", "list")
    assert found.returncode == 0, found.stderr
    assert dev.demo_run() in found.stdout
    # From another directory, with no --data-dir, there is no dev.json to find.
    lost = dev.cli("run", "list", data_dir=False)
    assert lost.returncode == 1 and lost.stderr.startswith("error: ")
    assert len(lost.stderr.strip().splitlines()) == 1, lost.stderr
    assert "no .dagnats/dev.json" in lost.stderr and "--data-dir" in lost.stderr


def test_dev_serves_the_services_counters_for_prometheus(dev: Dev) -> None:
    # The URL it printed, also in dev.json for tools.
    metrics = json.loads((dev.data / "dev.json").read_text())["metrics"]
    scraped = httpx.get(metrics, timeout=30)
    assert scraped.status_code == 200
    # The demo's commits went to the engine of the same process, by a call.
    counted = re.search(
        r'^dagnats_engine_events_total\{event="local_applied"\} (\S+)$', scraped.text, re.M
    )
    assert counted is not None and float(counted[1]) >= 1, scraped.text


def test_a_second_dev_on_the_same_data_dir_is_refused(dev: Dev) -> None:
    # Two nats-servers on one store would corrupt it; the second says whose it is.
    second = dev.cli("dev", "--no-demo", "--exit-after-demo")
    assert second.returncode == 1, second.stdout + second.stderr
    assert second.stderr.startswith("error: ") and "in use by dagnats dev" in second.stderr
    assert f"pid {dev.process.proc.pid}" in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["journal", "read", "{run}", "agent"],
        ["journal", "read", "{run}", "agent", "--json"],
        ["journal", "check", "{run}"],
        ["run", "get", "{run}", "--json"],
        ["run", "list"],
        ["workflow", "list"],
    ],
)
def test_a_reader_that_stops_early_ends_the_command_quietly(dev: Dev, command: list[str]) -> None:
    # `dagnats journal read ... | head`: the reader is gone before the output
    # comes (a pipe whose read end is closed, so every write fails).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        args = [part.format(run=dev.demo_run()) for part in command]
        result = dev.cli(*args, stdout=write_end, stderr=subprocess.PIPE, capture_output=False)
    finally:
        os.close(write_end)
    assert result.stderr == "", result.stderr
    assert result.returncode == 141


# ---- the HTTP API ------------------------------------------------------------------


def _idle_step(dev: Dev) -> str:
    """A running step no worker serves, so inputs stay queued."""
    name = unique("idle")
    assert (
        dev.http.post("/workflows", json=loop_workflow(name, unique("nobody"))).status_code == 200
    )
    started = dev.http.post("/runs", json={"workflow": name})
    assert started.status_code == 201, started.text
    run_id: str = started.json()["run_id"]
    return run_id


def test_the_spec_curl_for_inputs_is_taken_as_json(dev: Dev) -> None:
    run_id = _idle_step(dev)
    inputs = f"/runs/{run_id}/steps/agent/inputs"
    body = (
        b'{"request_id": "msg-42", "mode": "steer",'
        b' "content": {"text": "use the staging database"}}'
    )
    first = dev.http.post(inputs, content=body, headers=CURL_FORM)
    assert first.status_code == 201, first.text
    assert first.json()["content"] == {"text": "use the staging database"}
    assert dev.http.post(inputs, content=body, headers=CURL_FORM).status_code == 200
    # No Content-Type at all, and http-api.md's start of a run without one.
    bare = dev.http.post(inputs, content=body.replace(b"msg-42", b"msg-43"))
    assert bare.status_code == 201, bare.text
    run = dev.http.post("/runs", content=b'{"workflow": "demo-agent"}', headers=CURL_FORM)
    assert run.status_code == 201, run.text
    # A body that is not JSON is still a 400 naming the body.
    bad = dev.http.post(inputs, content=b"request_id=x&content=1", headers=CURL_FORM)
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_argument", bad.text
    assert bad.json()["field"] == "body" and "not JSON" in bad.json()["message"], bad.text
    dev.http.post(f"/runs/{run_id}/cancel")


def test_ids_and_cursors_out_of_range_are_400s_with_the_grpc_messages(dev: Dev) -> None:
    from dagnats.core.errors import InvalidArgument
    from dagnats.core.ids import check_request_id

    run_id = _idle_step(dev)
    done = dev.demo_run()
    inputs = f"/runs/{run_id}/steps/agent/inputs"
    journal = f"/runs/{done}/steps/agent/journal"
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        (journal + f"?from={MAX_SEQ + 1}", {}, 400, "from"),
        (journal + f"?from={10**30}", {}, 400, "from"),
        (journal + f"?follow=1&from={MAX_SEQ + 1}", {}, 400, "from"),
        (journal + "?follow=1", {"Last-Event-ID": str(MAX_SEQ)}, 400, "Last-Event-ID"),
        (journal + "?follow=1", {"Last-Event-ID": str(10**30)}, 400, "Last-Event-ID"),
        (journal + "?follow=1", {"Last-Event-ID": "-1"}, 400, "Last-Event-ID"),
        (journal + "?follow=1", {"Last-Event-ID": "1e3"}, 400, "Last-Event-ID"),
        (f"/runs/{'0' * 32}/steps/agent/inputs", {}, 404, "run_id"),
        (f"/runs/{run_id}/steps/nostep/inputs", {}, 404, "step_id"),
        (f"/runs/{run_id}/steps/nostep/journal", {}, 404, "step_id"),
    ]
    for path, headers, status, field in cases:
        response = dev.http.get(path, headers=headers)
        assert response.status_code == status, (path, headers, response.text)
        assert response.json()["field"] == field and response.json()["message"], response.text
    # The last sequence there can be is a cursor like any other.
    page = dev.http.get(journal, params={"from": MAX_SEQ})
    assert page.status_code == 200 and page.json() == {"records": [], "next": MAX_SEQ}

    # A request id that could not be addressed again afterwards is refused,
    # with the message the gRPC services give, and nothing is stored.
    for request_id in ("a/b", "/", ".", ".."):
        with pytest.raises(InvalidArgument) as rule:
            check_request_id(request_id)
        response = dev.http.post(inputs, json={"request_id": request_id, "content": 1})
        assert response.status_code == 400, (request_id, response.text)
        assert response.json() == {
            "code": "invalid_argument",
            "message": rule.value.message,
            "field": "request_id",
        }
    assert dev.http.get(inputs).json() == {"inputs": []}
    # Ids any client can send in a path are taken and found again.
    for request_id in ("a.b", "é *>", "...", "a\\b"):
        created = dev.http.post(inputs, json={"request_id": request_id, "content": 1})
        assert created.status_code == 201, (request_id, created.text)
        got = dev.http.get(f"{inputs}/{quote(request_id, safe='')}")
        assert got.status_code == 200 and got.json()["request_id"] == request_id, got.text
    dev.http.post(f"/runs/{run_id}/cancel")


def test_a_wait_with_if_status_answers_a_change_made_before_it(dev: Dev) -> None:
    run_id = _idle_step(dev)
    path = f"/runs/{run_id}/steps/agent/inputs/r-1"
    submitted = dev.http.post(path.rsplit("/", 1)[0], json={"request_id": "r-1", "content": 1})
    assert submitted.json()["status"] == "queued"
    # It changes before the caller asks again.
    assert dev.http.delete(path).status_code == 204
    # The caller says what it saw last; the change is answered at once, well
    # inside a client deadline far shorter than the wait asked for.
    with httpx.Client(base_url=dev.process.gateway, timeout=20) as quick:
        seen = quick.get(path, params={"wait": "60s", "if_status": "queued"})
    assert seen.status_code == 200 and seen.json()["status"] == "withdrawn", seen.text
    # No change from what the caller saw: the wait runs out and says so.
    same = dev.http.get(path, params={"wait": "1s", "if_status": "withdrawn"})
    assert same.json()["status"] == "withdrawn"
    bad = dev.http.get(path, params={"wait": "1s", "if_status": "lost"})
    assert bad.status_code == 400 and bad.json()["field"] == "if_status"
    too_long = dev.http.get(path, params={"wait": "2m"})
    assert too_long.status_code == 400 and too_long.json()["field"] == "wait"
    dev.http.post(f"/runs/{run_id}/cancel")


def _sse(dev: Dev, path: str, headers: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Every event of a stream, read until the server closes it."""
    events: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    with httpx.Client(base_url=dev.process.gateway, timeout=60) as http:
        with http.stream("GET", path, headers=headers or {}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line == "":
                    if "event" in fields:
                        events.append(fields)
                    fields = {}
                elif not line.startswith(":"):
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")
    return events


def test_following_a_finished_step_ends_with_an_end_event(dev: Dev) -> None:
    run_id = dev.demo_run()
    path = f"/runs/{run_id}/steps/agent/journal"
    records = dev.http.get(path).json()["records"]
    assert records and records[-1]["commit"]["action"] == "complete"

    events = _sse(dev, path + "?follow=1")
    assert [e["event"] for e in events] == ["record"] * len(records) + ["end"]
    assert [int(e["id"]) for e in events[:-1]] == [r["seq"] for r in records]
    end = events[-1]
    assert "id" not in end, "the end event leaves the client's Last-Event-ID alone"
    assert json.loads(end["data"]) == {"run_status": "completed", "step_status": "completed"}
    # A reconnect after the last record, or from beyond it, gets only the end.
    for headers in ({"Last-Event-ID": str(records[-1]["seq"])}, {"Last-Event-ID": "99999999"}):
        assert [e["event"] for e in _sse(dev, path + "?follow=1", headers)] == ["end"]
    # `dagnats journal read --follow` ends the same way, after the last record.
    followed = dev.cli("journal", "read", run_id, "agent", "--follow", "--json")
    assert followed.returncode == 0, followed.stderr
    assert [json.loads(line)["seq"] for line in followed.stdout.splitlines()] == [
        r["seq"] for r in records
    ]


def test_the_openapi_document_needs_the_token_when_one_is_set(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGNATS_")}
    env["DAGNATS_API_TOKEN"] = "new-user-secret"
    process = start_dev(tmp_path / "data", "--no-demo", env=env, stderr=tmp_path / "err")
    try:
        with httpx.Client(base_url=process.gateway, timeout=30) as http:
            for path in ("/openapi.json", "/docs", "/runs"):
                response = http.get(path)
                assert response.status_code == 401, (path, response.status_code)
                assert response.json()["code"] == "unauthenticated"
            assert http.get("/redoc").status_code == 404, "no second, open view of the document"
            token = {"Authorization": "Bearer new-user-secret"}
            spec = http.get("/openapi.json", headers=token)
            assert spec.status_code == 200 and "/runs" in spec.json()["paths"]
            docs = http.get("/docs", headers=token)
            assert docs.status_code == 200 and "/openapi.json" in docs.text
            assert http.get("/healthz").status_code == 200
    finally:
        process.proc.terminate()
        process.proc.communicate(timeout=30)
