"""Fixtures: a real nats-server (and a 3-node cluster) on free ports with temp
stores, the engine on it (gRPC on port 0) with a client, and an in-memory span
exporter for tracing assertions. With ``DAGNATS_TEST_NATS_AUTH=1`` the servers
require credentials and TLS, and the services use them (``tests/secured.py``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dagnats.core.natsserver import NatsCluster, NatsServer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.gateway import GatewayConfig, GatewayServer, start_gateway
from dagnats.sdk import Client, Worker
from tests.gates import Gates, two_steps
from tests.secured import install_suite_certs, suite_auth, suite_security
from tests.stack import FAST, socket_dir, unique

# No test reaches a real model: a model or a key set in the shell that runs the
# tests would send the demo and the examples (run as processes) to a provider.
for _name in ("DAGNATS_MODEL", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL"):
    os.environ.pop(_name, None)


def pytest_configure(config: pytest.Config) -> None:
    """With ``DAGNATS_TEST_NATS_AUTH=1``, the session's certificates and the
    services' NATS settings, before any server starts."""
    if suite_auth():
        certs = install_suite_certs(Path(tempfile.mkdtemp(prefix="dagnats-nats-certs-")))
        config.add_cleanup(lambda: shutil.rmtree(certs.dir, ignore_errors=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A failed test's report carries the end of the log of every nats-server
    it used: a server that stopped answering says why there."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        servers = value.servers if isinstance(value, NatsCluster) else [value]
        for server in servers:
            if isinstance(server, NatsServer) and (tail := server.log_tail()):
                report.sections.append((f"nats-server log ({name}, {server.url})", tail))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nats_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NatsServer]:
    """A JetStream server (sync_interval: always) shared by the tests of one module."""
    server = await NatsServer.start(tmp_path_factory.mktemp("nats"), security=suite_security())
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="module", params=["r1", "r3"])
def topology(request: pytest.FixtureRequest) -> tuple[str, str, int]:
    """Each test of a module that asks for it runs on one server (R1) and on a
    3-node cluster (R3): (name, url, replicas), each server started only when used."""
    if request.param == "r1":
        server: NatsServer = request.getfixturevalue("nats_server")
        return "r1", server.url, 1
    cluster: NatsCluster = request.getfixturevalue("nats_cluster")
    return "r3", cluster.url, 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NatsCluster]:
    """A 3-node JetStream cluster on loopback, shared by the tests of one module."""
    cluster = await NatsCluster.start(
        tmp_path_factory.mktemp("nats-cluster"), security=suite_security()
    )
    try:
        yield cluster
    finally:
        await cluster.stop()


@pytest.fixture(scope="session")
def span_exporter_session() -> Iterator[InMemorySpanExporter]:
    """Install the process-wide TracerProvider once; OpenTelemetry allows only one."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture
def span_exporter(span_exporter_session: InMemorySpanExporter) -> InMemorySpanExporter:
    """The session's exporter, emptied so a test sees only its own spans."""
    span_exporter_session.clear()
    return span_exporter_session


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    """The engine (with the journal and inputs services) on the module's
    server, its journal's local socket in a short temporary directory."""
    with socket_dir() as sockets:
        server = await start_engine(
            nats_server.url, config=FAST, local_socket=sockets / "local.sock"
        )
        yield server
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine: EngineServer) -> AsyncIterator[Client]:
    async with Client(engine.target) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(engine: EngineServer) -> AsyncIterator[GatewayServer]:
    """The HTTP gateway in front of the module's engine, on a free loopback port."""
    server = await start_gateway(GatewayConfig(engine_target=engine.target, port=0))
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(gateway: GatewayServer) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the module's gateway."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def gated(engine: EngineServer) -> AsyncIterator[tuple[str, Gates]]:
    """A two-step workflow on the module's engine whose steps wait for their
    gates (``tests.gates``), and a worker for it; its name and the gates."""
    name, task, gates = unique("gated"), unique("gated-task"), Gates()
    async with Client(engine.target) as client:
        await client.register_workflow(two_steps(name, task))
    async with Worker(engine.target, handlers={task: gates.handle}, poll_wait=1.0):
        yield name, gates
        gates.open_all()  # let a handler still waiting finish


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel run's worker process, the modules that hold a ``slow``
    test come first, each whole and in its own order: the run hands out
    modules in this order (``--no-loadscope-reorder``), so the long ones
    start early and the short ones fill the processes' ends."""
    if not hasattr(config, "workerinput"):
        return
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


# What the processes of a parallel run (``pytest -n``, ``make test``) counted:
# each sends its soak reports and matrix cases back as it ends, and the
# controlling process, which runs no test, prints them with its own.
_WORKERS_CASES: Counter[tuple[str, str]] = Counter()
_WORKERS_SOAKS: list[list[str]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a parallel run's worker process: its soak reports and matrix cases,
    for the controlling process's summary."""
    output = getattr(session.config, "workeroutput", None)
    if output is None:
        return
    soak = sys.modules.get("tests.chaos.soak")
    output["dagnats_soaks"] = [report.lines() for report in getattr(soak, "REPORTS", ())]
    output["dagnats_cases"] = [[where, row, n] for (where, row), n in _matrix_cases().items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """A worker process of a parallel run ended: keep what it counted."""
    output = getattr(node, "workeroutput", None) or {}
    _WORKERS_SOAKS.extend(output.get("dagnats_soaks", ()))
    for where, row, n in output.get("dagnats_cases", ()):
        _WORKERS_CASES[where, row] += n


def _matrix_cases() -> Counter[tuple[str, str]]:
    matrix = sys.modules.get("tests.matrix")
    return Counter(getattr(matrix, "CASES", None) or {})


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The chaos soaks' reports, then the crash-point matrix's cases by seam
    and mode, on one server and on the cluster (``tests/matrix.py`` counts them)."""
    _soak_summary(terminalreporter)
    for lines in _WORKERS_SOAKS:
        terminalreporter.section("chaos soak")
        for line in lines:
            terminalreporter.write_line(line)
    cases = _matrix_cases() + _WORKERS_CASES
    if not cases:
        return
    places = sorted({where for where, _ in cases}, reverse=True)
    rows = sorted({row for _, row in cases})
    width = max(30, *(len(row) + 2 for row in rows))
    terminalreporter.section("crash-point matrix: cases run")
    terminalreporter.write_line(f"{'seam/mode':<{width}}" + "".join(f"{p:>16}" for p in places))
    for row in rows:
        counts = "".join(f"{cases[p, row]:>16}" for p in places)
        terminalreporter.write_line(f"{row:<{width}}{counts}")
    totals = "".join(f"{sum(n for (p, _), n in cases.items() if p == pl):>16}" for pl in places)
    terminalreporter.write_line(f"{'total':<{width}}{totals}")


def _soak_summary(terminalreporter: Any) -> None:
    """The chaos soaks' reports (``tests/chaos/soak.py`` keeps them)."""
    soak = sys.modules.get("tests.chaos.soak")
    for report in getattr(soak, "REPORTS", ()):
        terminalreporter.section("chaos soak")
        for line in report.lines():
            terminalreporter.write_line(line)
