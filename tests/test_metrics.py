"""The services' counters for Prometheus (``dagnats serve --metrics-port``,
``dagnats dev``): what an operator's scrape reads, and the refusals of a
port that cannot serve them; the CLI's port flags refuse a value out of
range in one line. ``tests/test_new_user.py`` scrapes the one
``dagnats dev`` serves."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dagnats.core import errors
from dagnats.engine.metrics import serve_metrics
from dagnats.engine.server import EngineServer
from dagnats.sdk import Client
from tests.test_journal import found, run_without_a_crash


async def _scrape(url: str, query: str = "") -> dict[tuple[str, str], float]:
    """Every sample of a scrape, by name and its ``event`` label ("" without one)."""

    def get() -> str:
        with urllib.request.urlopen(url + query, timeout=30) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"].startswith("text/plain")
            text: str = answer.read().decode()
            return text

    text = await asyncio.to_thread(get)
    return {
        (sample.name, sample.labels.get("event", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_scrape_reads_what_the_engine_and_the_local_socket_counted(
    client: Client, engine: EngineServer
) -> None:
    endpoint = serve_metrics(engine, "127.0.0.1", 0)
    try:
        before = await _scrape(endpoint.url)
        # A worker that finds the socket; each commit's event goes to the
        # engine of the same process, by a call.
        await run_without_a_crash(client, engine, found)
        after = await _scrape(endpoint.url)
        # A scrape of named families has those alone.
        picked = await _scrape(endpoint.url, "?name[]=dagnats_local_socket_polls_total")
    finally:
        endpoint.stop()

    def grew(name: str, event: str = "") -> bool:
        return after[(name, event)] > before.get((name, event), 0)

    assert grew("dagnats_engine_events_total", "local_applied")
    assert grew("dagnats_local_socket_connections_total")
    assert grew("dagnats_local_socket_polls_total")
    assert ("dagnats_local_socket_open", "") in after
    assert list(picked) == [("dagnats_local_socket_polls_total", "")]
    assert (
        after[("dagnats_engine_events_total", "local_applied")]
        == (engine.engine.counters["local_applied"])
    )
    with pytest.raises(urllib.error.URLError):  # stopped: the port is closed
        await _scrape(endpoint.url)


def test_a_metrics_port_in_use_is_refused_by_name(engine: EngineServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.Unavailable, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_metrics(engine, "127.0.0.1", port)


@pytest.mark.parametrize(
    ("args", "env", "code", "said"),
    [
        (["serve", "gateway", "--metrics-port", "0"], {}, 1, "the gateway has its own /metrics"),
        (["serve", "all"], {"DAGNATS_METRICS_PORT": "abc"}, 2, "--metrics-port: not a port"),
        (["serve", "all", "--port", "70000"], {}, 2, "--port: a port is 0-65535, got 70000"),
        (["dev", "--gateway-port", "-1"], {}, 2, "--gateway-port: a port is 0-65535, got -1"),
        (["dev", "--metrics-port", "65536"], {}, 2, "--metrics-port: a port is 0-65535"),
    ],
)
def test_the_cli_refuses_a_port_it_cannot_serve_in_one_line(
    args: list[str], env: dict[str, str], code: int, said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dagnats.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("DAGNATS_")}, **env},
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr
