"""Credentials at the edges: a bearer token is compared exactly as sent, and no
log line of a serving process carries one.

gRPC's Python client checks metadata before it sends it, so the malformed
headers a hostile client can send go out from a raw HTTP/2 client (``h2``)
over plaintext on loopback, where the engine takes tokens without TLS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import pytest_asyncio

from dagnats.core.credentials import (
    GRPC_EXTENSION_LOGGER,
    CredentialFilter,
    bearer_token,
    redact,
)
from dagnats.core.errors import InvalidArgument
from dagnats.core.natsserver import NatsServer
from dagnats.engine.access import Role, parse_tokens, tokens_of
from dagnats.engine.security import ServerSecurity
from dagnats.engine.server import EngineServer, start_engine
from dagnats.gateway import GatewayConfig, start_gateway
from dagnats.sdk import Client, Credentials
from tests.stack import FAST

TOKEN = "client-token-7f3a9c"
LIST_RUNS = "/dagnats.engine.v1.EngineService/ListRuns"
# One method of each service, with the role a client token holds.
METHODS = {
    "engine": LIST_RUNS,
    "journal": "/dagnats.journal.v1.JournalService/Read",
    "inputs": "/dagnats.inputs.v1.InputsService/List",
}
OK, UNAUTHENTICATED = b"0", b"16"


def test_a_bearer_token_is_taken_as_sent_or_not_at_all() -> None:
    assert bearer_token("Bearer tok-1") == bearer_token("bearer  tok-1") == "tok-1"
    for value in ("Bearer tok-1\n", "Bearer tok-1 ", "Bearer tok\t1", "Bearer tök", "Basic tok-1"):
        assert bearer_token(value) == "", value
    assert bearer_token("Bearer ") == bearer_token("tok-1") == ""


def test_a_credential_in_a_message_is_redacted() -> None:
    assert redact("metadata (('authorization', 'Bearer tok-1\\n'),)") == (
        "metadata (('authorization', 'Bearer [redacted]'),)"
    )
    assert redact("b'Basic dXNlcjpwYXNz'") == "b'Basic [redacted]'"
    assert redact("nothing to hide") == "nothing to hide"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: NatsServer) -> AsyncIterator[EngineServer]:
    """An engine that takes calls with a client token only."""
    security = ServerSecurity(tokens=tokens_of(Role.CLIENT, [TOKEN]))
    server = await start_engine(nats_server.url, config=FAST, security=security)
    yield server
    await server.stop()


async def grpc_status(target: str, authorization: bytes, method: str = LIST_RUNS) -> bytes:
    """The ``grpc-status`` of one call of ``method`` with an empty request and
    ``authorization`` sent as it is, over a raw HTTP/2 connection."""
    host, _, port = target.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", method.encode()),
        (b":authority", target.encode()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"authorization", authorization),
    ]
    conn.send_headers(stream, headers)
    conn.send_data(stream, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty message
    writer.write(conn.data_to_send())
    try:
        answered: dict[bytes, bytes] = {}
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout=10)
            assert data, f"the connection closed before the call ended: {answered}"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answered.update(event.headers)
                if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return answered[b"grpc-status"]
            writer.write(conn.data_to_send())
    finally:
        writer.close()


@pytest.mark.parametrize("tail", [b"\n", b"\r\n", b"\t", b"\x00", b"\x01", b"\x7f", b" "])
async def test_a_token_with_a_control_character_is_refused(
    engine: EngineServer, tail: bytes
) -> None:
    token = TOKEN.encode()
    assert await grpc_status(engine.target, b"Bearer " + token) == OK
    assert await grpc_status(engine.target, b"Bearer " + token + tail) == UNAUTHENTICATED
    middle = token[:4] + tail + token[4:]
    assert await grpc_status(engine.target, b"Bearer " + middle) == UNAUTHENTICATED


async def test_a_token_with_a_byte_that_is_not_utf8_is_refused_and_not_logged(
    engine: EngineServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for client_side in ("hpack", "h2"):  # the test's own HTTP/2 client logs what it sends
        caplog.set_level(logging.WARNING, logger=client_side)
    answer = await grpc_status(engine.target, b"Bearer " + TOKEN.encode() + b"\xff")
    assert answer == UNAUTHENTICATED
    # grpc still says what it saw, without the value.
    assert any(r.name == GRPC_EXTENSION_LOGGER for r in caplog.records), caplog.text
    assert TOKEN not in caplog.text
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


@asynccontextmanager
async def serving(service: str, nats_url: str, log: Path) -> AsyncIterator[str]:
    """``dagnats serve <service>`` in its own process, taking the client
    token, its standard error (its log) written to ``log``; its address."""
    env = {**os.environ, "DAGNATS_GRPC_CLIENT_TOKENS": TOKEN}
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "dagnats.cli.main", "--verbose", "serve", service),
            *("--nats", nats_url, "--port", "0"),
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            env=env,
        )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "serving on" in line, f"dagnats serve {service} did not start: {log.read_text()}"
        yield line.split()[-1]
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


@pytest.mark.parametrize("service", ["all", "engine", "journal", "inputs"])
async def test_no_serving_process_logs_a_token_sent_with_a_bad_byte(
    nats_server: NatsServer, tmp_path: Path, service: str
) -> None:
    log = tmp_path / "serve.log"
    method = METHODS["engine" if service == "all" else service]
    async with serving(service, nats_server.url, log) as target:
        status = await grpc_status(target, b"Bearer " + TOKEN.encode() + b"\xff", method)
        assert status == UNAUTHENTICATED
        assert await grpc_status(target, b"Bearer " + TOKEN.encode() + b"\n", method) == (
            UNAUTHENTICATED
        )
    text = log.read_text(errors="replace")
    assert "Invalid encoding on a metadata value" in text, text
    assert TOKEN not in text


async def test_the_gateway_filters_grpc_logs_and_compares_its_tokens_exactly(
    engine: EngineServer,
) -> None:
    extension = logging.getLogger(GRPC_EXTENSION_LOGGER)
    extension.filters = [f for f in extension.filters if not isinstance(f, CredentialFilter)]
    config = GatewayConfig(
        engine_target=engine.target,
        port=0,
        api_token="api-token-1",
        client_credentials=Credentials(token=TOKEN),
    )
    gateway = await start_gateway(config)
    try:
        assert any(isinstance(f, CredentialFilter) for f in extension.filters)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            ok = await http.get("/runs", headers={"authorization": "Bearer api-token-1"})
            assert ok.status_code == 200, ok.text
            for sent in ("Bearer api-token-1\tx", "Bearer api-token-1,", "Bearer api-token-1 x"):
                refused = await http.get("/runs", headers={"authorization": sent})
                assert refused.status_code == 401, (sent, refused.text)
    finally:
        await gateway.stop()


def test_a_configured_token_with_a_control_character_is_refused_naming_where(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(InvalidArgument) as bad_line:
        parse_tokens("client good-token\nclient bad\x01token\n", source="tokens.txt")
    assert bad_line.value.field == "tokens.txt:2"
    assert "bad" not in bad_line.value.message
    monkeypatch.setenv("DAGNATS_GRPC_CLIENT_TOKENS", "client-token\n")
    with pytest.raises(InvalidArgument) as bad_variable:
        ServerSecurity.from_env()
    assert bad_variable.value.field == "DAGNATS_GRPC_CLIENT_TOKENS"
    monkeypatch.setenv("DAGNATS_API_TOKEN", "api-token\n")
    with pytest.raises(InvalidArgument) as bad_gateway:
        GatewayConfig.from_env("127.0.0.1:1", host="127.0.0.1", port=0)
    assert bad_gateway.value.field == "DAGNATS_API_TOKEN"


async def test_the_sdk_refuses_to_send_a_token_with_a_newline(engine: EngineServer) -> None:
    with pytest.raises(InvalidArgument) as refused:
        async with Client(engine.target, credentials=Credentials(token=TOKEN + "\n")) as client:
            await client.list_runs()
    assert "DAGNATS_TOKEN" in refused.value.message
    assert TOKEN not in str(refused.value)
