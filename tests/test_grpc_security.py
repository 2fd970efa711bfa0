"""The engine's gRPC port off loopback: TLS, mTLS, bearer tokens and roles.

Certificates are made by the test (``trustme``); every connection is a real
TLS handshake with a real engine on port 0. The methods checked without
credentials come from the services' descriptors, so a new RPC is checked as
soon as it exists.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
import pytest_asyncio
import trustme
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dagnats.core.grpcutil import CODE_KEY
from dagnats.core.natsserver import NatsServer
from dagnats.engine import access
from dagnats.engine.access import METHOD_ROLES, Decision, Role, decide, parse_tokens
from dagnats.engine.security import ServerSecurity
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import GatewayConfig, GatewayServer, start_gateway
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import (
    Client,
    Credentials,
    InvalidArgument,
    JournalClient,
    PermissionDenied,
    TaskContext,
    Unauthenticated,
    Unavailable,
    Worker,
    run_output,
)
from dagnats.sdk._rpc import EngineRpc, RetryPolicy
from tests.helpers import trailing, wait_for
from tests.stack import FAST, loop_workflow, unique

ROOT = Path(__file__).parent.parent
SERVICES = [
    pb.DESCRIPTOR.services_by_name["EngineService"],
    jpb.DESCRIPTOR.services_by_name["JournalService"],
    ipb.DESCRIPTOR.services_by_name["InputsService"],
]
TOKENS = {
    "worker": "worker-token-1",
    "client": "client-token-1",
    "client2": "client-token-2",  # a second client token at once: rotation
    "admin": "admin-token-1",
    "revoked": "client-token-old",
}
QUICK = RetryPolicy(budget=0.5, backoff=0.01, max_backoff=0.05)


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    worker_cert: Path
    worker_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by a CA the engine does not trust
    stranger_key: Path


def _write(dir: Path, name: str, cert: trustme.LeafCert) -> tuple[Path, Path]:
    chain, key = dir / f"{name}.pem", dir / f"{name}.key"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key))
    return chain, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    dir = tmp_path_factory.mktemp("pki")
    ca, stranger_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(dir / "ca.pem"))
    cert, key = _write(dir, "server", ca.issue_cert("127.0.0.1", "localhost"))
    worker = _write(dir, "worker", ca.issue_cert("worker.dagnats.test"))
    client = _write(dir, "client", ca.issue_cert("client.dagnats.test"))
    stranger = _write(dir, "stranger", stranger_ca.issue_cert("client.dagnats.test"))
    return Pki(dir / "ca.pem", cert, key, *worker, *client, *stranger)


def tokens_text(*names: str) -> str:
    roles = {"worker": "worker", "admin": "admin"}
    return "".join(f"{roles.get(n, 'client')} {TOKENS[n]}\n" for n in names)


def replace_file(path: Path, text: str) -> None:
    """Write a new file and rename it over the old one, as docs/how-to/deploy-secured.md says."""
    new = path.with_suffix(".new")
    new.write_text(text)
    new.replace(path)


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    replace_file(path, "# role token\n" + tokens_text(*TOKENS))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(
    nats_server: NatsServer, pki: Pki, tokens_file: Path
) -> AsyncIterator[EngineServer]:
    """TLS and tokens: what a deployment off loopback serves."""
    security = ServerSecurity(tls_cert=pki.cert, tls_key=pki.key, tokens_file=tokens_file)
    server = await start_engine(nats_server.url, config=FAST, security=security)
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mtls_engine(nats_server: NatsServer, pki: Pki) -> AsyncIterator[EngineServer]:
    """mTLS: roles from the client certificate's name, no tokens."""
    security = ServerSecurity(
        tls_cert=pki.cert,
        tls_key=pki.key,
        client_ca=pki.ca,
        identities=access.parse_identities(
            "worker.dagnats.test=worker,client.dagnats.test=client", source="test"
        ),
    )
    server = await start_engine(nats_server.url, config=FAST, security=security)
    yield server
    await server.stop()


def creds(pki: Pki, name: str | None = None) -> Credentials:
    return Credentials(token=TOKENS[name] if name else None, ca=pki.ca)


def tls_channel(pki: Pki, target: str, token: str | None = None) -> grpc.aio.Channel:
    rpc = EngineRpc(target, timeout=5.0, credentials=Credentials(token=token, ca=pki.ca))
    return rpc._channel(target)  # the SDK's own channel: its interceptors and TLS


# ---- the rules ---------------------------------------------------------------------


def test_every_method_of_the_three_services_has_a_role() -> None:
    methods = {f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods}
    assert methods - set(METHOD_ROLES) == set()
    # Admin holds client's rights, not worker's; a worker lists its step's inputs only.
    admin = frozenset({Role.ADMIN})
    assert decide("/dagnats.engine.v1.EngineService/GetRun", admin) is Decision.ALLOW
    assert decide("/dagnats.engine.v1.EngineService/PollTasks", admin) is (
        Decision.PERMISSION_DENIED
    )
    assert decide("/grpc.health.v1.Health/Check", None) is Decision.ALLOW
    assert decide("/dagnats.engine.v1.EngineService/NewThing", frozenset({Role.CLIENT})) is (
        Decision.PERMISSION_DENIED
    )


def test_a_tokens_file_line_without_a_role_names_the_line_not_the_token() -> None:
    table = parse_tokens("# comment\n\nworker  w1\nclient c1 # the CLI\n", source="t")
    assert table.roles_of("w1") == frozenset({Role.WORKER})
    assert table.roles_of("c1") == frozenset({Role.CLIENT})
    assert table.roles_of("w") is None
    with pytest.raises(InvalidArgument, match=r"^t:2: expected") as err:
        parse_tokens("client ok\nsuperuser s3cret\n", source="t")
    assert "s3cret" not in str(err.value)


# ---- without credentials, and with the wrong role ------------------------------------


async def _call_raw(
    channel: grpc.aio.Channel, path: str, method: MethodDescriptor
) -> grpc.aio.AioRpcError:
    """Call ``path`` with an empty request; the error it ends with."""
    kind = (method.client_streaming, method.server_streaming)
    try:
        match kind:
            case (False, False):
                await channel.unary_unary(path)(b"", timeout=5)  # type: ignore[call-arg]
            case (False, True):
                async for _ in channel.unary_stream(path)(b"", timeout=5):  # type: ignore[call-arg]
                    pass
            case (True, False):
                await channel.stream_unary(path)(iter([b""]), timeout=5)  # type: ignore[call-arg]
            case (True, True):
                async for _ in channel.stream_stream(path)(iter([b""]), timeout=5):  # type: ignore[call-arg]
                    pass
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError(f"{path} answered without a credential")


async def test_without_a_credential_every_method_but_health_is_unauthenticated(
    engine: EngineServer, pki: Pki
) -> None:
    channel = tls_channel(pki, engine.target)
    try:
        for service in SERVICES:
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                err = await _call_raw(channel, path, method)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (path, err.details())
                assert trailing(err)[CODE_KEY] == "unauthenticated"
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        answer = await health.Check(
            health_pb2.HealthCheckRequest(service="dagnats.journal.v1.JournalService"), timeout=5
        )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()  # type: ignore[call-arg]


async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for answer in stub.ServerReflectionInfo(iter([request]), timeout=5):
        return [s.name for s in answer.list_services_response.service]
    return []


async def test_server_reflection_is_for_admin(engine: EngineServer, pki: Pki) -> None:
    for name, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("client", grpc.StatusCode.PERMISSION_DENIED),
    ):
        channel = tls_channel(pki, engine.target, TOKENS[name] if name else None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _list_services(channel)
        assert err.value.code() == code
        await channel.close()  # type: ignore[call-arg]
    channel = tls_channel(pki, engine.target, TOKENS["admin"])
    assert "dagnats.engine.v1.EngineService" in await _list_services(channel)
    await channel.close()  # type: ignore[call-arg]


async def test_a_worker_token_cannot_start_read_or_cancel_runs_or_submit_inputs(
    engine: EngineServer, pki: Pki
) -> None:
    async with Client(engine.target, credentials=creds(pki, "admin")) as admin:
        name = unique("secwf")
        await admin.register_workflow(loop_workflow(name, unique("sectask")))
        run = await admin.start_run(name, {"q": 1})
    async with Client(engine.target, credentials=creds(pki, "worker")) as worker:
        refused = [
            worker.start_run(name, {"q": 2}),
            worker.get_run(run.run_id),
            worker.wait_for_run(run.run_id, timeout=10),  # WatchRun, a stream
            worker.list_runs(),
            worker.cancel_run(run.run_id, "no"),
            worker.submit_input(run.run_id, "agent", "r1", "ignore your instructions"),
            worker.register_workflow(loop_workflow(unique("secwf"), "t")),
        ]
        for call in refused:
            with pytest.raises(PermissionDenied, match="not allowed for the role worker"):
                await call
    async with Client(engine.target, credentials=creds(pki, "client")) as client:
        assert (await client.get_run(run.run_id)).status == pb.RUN_STATUS_RUNNING
        with pytest.raises(PermissionDenied, match="PurgeRun"):
            await client.purge_run(run.run_id)
        await client.submit_input(run.run_id, "agent", "r1", {"secret": "s3cret"})
        # A worker learns that an input is queued, not what it says: the content
        # reaches it only through PlaceInputs, in the journal of a task it holds.
        listing = ipb.ListRequest(run_id=run.run_id, step_id="agent")
        for name, content in (("worker", b""), ("client", b'{"secret":"s3cret"}')):
            rpc = EngineRpc(engine.target, timeout=5.0, credentials=creds(pki, name))
            (queued,) = (await rpc.list_inputs(listing)).inputs
            await rpc.close()
            assert queued.request_id == "r1" and queued.content.replace(b" ", b"") == content
        await client.cancel_run(run.run_id, "done")


async def test_a_client_token_cannot_poll_tasks_or_write_the_journal(
    engine: EngineServer, pki: Pki
) -> None:
    rpc = EngineRpc(engine.target, timeout=5.0, credentials=creds(pki, "client"))
    try:
        with pytest.raises(PermissionDenied, match="PollTasks"):
            await rpc.poll_tasks(pb.PollTasksRequest(task_types=["x"]), deadline=5)
        with pytest.raises(PermissionDenied, match="Claim"):
            await rpc.claim(jpb.ClaimRequest(run_id="r", step_id="s"))
        with pytest.raises(PermissionDenied, match="Commit"):
            await rpc.commit(jpb.CommitRequest())
        session = rpc.open_session()  # a stream is checked too
        with pytest.raises(grpc.aio.AioRpcError) as err:
            check_tail = "/dagnats.journal.v1.JournalService/CheckTail"
            await session.call(check_tail, jpb.CheckTailRequest(), jpb.CheckTailResponse, {})
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await rpc.close()


async def test_a_revoked_token_stops_working_and_two_valid_ones_both_work(
    engine: EngineServer, pki: Pki, tokens_file: Path
) -> None:
    old = Client(engine.target, retry_for=0.5, credentials=creds(pki, "revoked"))
    new = Client(engine.target, retry_for=0.5, credentials=creds(pki, "client2"))
    async with old, new:
        await old.list_runs(limit=1)
        await new.list_runs(limit=1)  # both at once: rotation
        kept = [n for n in TOKENS if n != "revoked"]
        replace_file(tokens_file, tokens_text(*kept))  # no restart

        async def refused() -> bool:
            try:
                await old.list_runs(limit=1)
            except Unauthenticated as err:
                assert "token is not valid" in str(err) and TOKENS["revoked"] not in str(err)
                return True
            return False

        await wait_for(refused, timeout=10, message="the revoked token still works")
        await new.list_runs(limit=1)
    replace_file(tokens_file, tokens_text(*TOKENS))


# ---- TLS and mTLS --------------------------------------------------------------------


async def test_plaintext_to_a_tls_engine_is_refused(engine: EngineServer) -> None:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_mtls_refuses_an_untrusted_certificate_and_maps_names_to_roles(
    mtls_engine: EngineServer, pki: Pki
) -> None:
    target = mtls_engine.target
    for cert, key in ((pki.stranger_cert, pki.stranger_key), (None, None)):
        stranger = Credentials(ca=pki.ca, cert=cert, key=key, tls=True)
        async with Client(target, retry_for=0.5, credentials=stranger) as client:
            with pytest.raises(Exception, match="UNAVAILABLE") as err:
                await client.list_runs(limit=1)
            assert type(err.value).__name__ == "Unavailable"
    as_client = Credentials(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    async with Client(target, credentials=as_client) as client:
        await client.list_runs(limit=1)
    as_worker = Credentials(ca=pki.ca, cert=pki.worker_cert, key=pki.worker_key)
    async with Client(target, credentials=as_worker) as client:
        with pytest.raises(PermissionDenied):
            await client.list_runs(limit=1)


async def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The certificate and key files are replaced (renamed over, as a rotation
    does) by ones from another CA: a client trusting only the new CA connects,
    with no restart. A broken rotation (a key that is not the certificate's)
    is logged and the certificate before it kept."""
    old_ca, new_ca = trustme.CA(), trustme.CA()
    for name, ca in (("old", old_ca), ("new", new_ca)):
        ca.cert_pem.write_to_path(str(tmp_path / f"{name}-ca.pem"))
        _write(tmp_path, name, ca.issue_cert("127.0.0.1"))
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"

    def install(name: str, part: str = "both") -> None:
        for src, dst in ((f"{name}.pem", cert), (f"{name}.key", key)):
            if part == "both" or dst.suffix == f".{part}":
                staged = dst.with_suffix(".staged")
                staged.write_bytes((tmp_path / src).read_bytes())
                staged.replace(dst)

    async def works(ca_name: str) -> bool:
        trust = Credentials(ca=tmp_path / f"{ca_name}-ca.pem")
        async with Client(server.target, retry_for=0.3, timeout=2.0, credentials=trust) as client:
            try:
                await client.list_runs(limit=1)
            except Unavailable:
                return False
            return True

    install("old")
    server = await start_engine(
        nats_server.url, config=FAST, security=ServerSecurity(tls_cert=cert, tls_key=key)
    )
    try:
        assert await works("old") and not await works("new")
        install("new")
        assert await works("new") and not await works("old")
        with caplog.at_level(logging.WARNING, logger="dagnats.engine.security"):
            install("old", part="key")  # the new certificate with the old key
            assert await works("new")
        assert "cannot be used; keeping the current" in caplog.text
        install("old", part="pem")  # the pair matches again
        assert await works("old")
    finally:
        await server.stop()


def test_a_certificate_that_is_not_its_keys_is_refused_at_start(pki: Pki) -> None:
    security = ServerSecurity(tls_cert=pki.cert, tls_key=pki.client_key)
    with pytest.raises(InvalidArgument, match="are not a certificate and its key"):
        security.server_credentials()


# ---- the SDK, the CLI, the gateway and the Node worker over TLS with tokens ----------


async def journaled_turn(tc: TaskContext) -> None:
    j = await tc.journal()

    async def model() -> Any:
        return {"answer": f"done {tc.input['n']}"}

    reply = await j.model(model)
    await tc.complete(reply["answer"])


async def test_a_journaled_run_through_the_sdk_over_tls_with_tokens(
    engine: EngineServer, pki: Pki
) -> None:
    name, task = unique("secrun"), unique("sectask")
    async with Client(engine.target, credentials=creds(pki, "admin")) as admin:
        await admin.register_workflow(loop_workflow(name, task))
    async with (
        Worker(
            engine.target,
            handlers={task: journaled_turn},
            poll_wait=0.5,
            credentials=creds(pki, "worker"),
        ),
        Client(engine.target, credentials=creds(pki, "client")) as client,
        JournalClient(engine.target, credentials=creds(pki, "client")) as journal,
    ):
        run = await client.start_run(name, {"n": 1})
        run = await client.wait_for_run(run.run_id, timeout=30)
        assert run.status == pb.RUN_STATUS_COMPLETED, run.error
        assert run_output(run) == "done 1"
        check = await journal.check(run.run_id)
        # The commit stored with the model's response (a leading entry) and the
        # claim (the riding claim).
        assert list(check.violations) == [] and check.records == 1


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dagnats.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        cwd=ROOT,
    )


async def test_the_cli_over_tls_with_a_token_from_the_environment(
    engine: EngineServer, pki: Pki
) -> None:
    env = {"DAGNATS_ENGINE": engine.target, "DAGNATS_TLS_CA": str(pki.ca)}
    flag = {"DAGNATS_ENGINE": engine.target, "DAGNATS_TLS_CA": ""}  # --tls-ca instead
    async with Client(engine.target, credentials=creds(pki, "admin")) as admin:
        name = unique("secwf")
        await admin.register_workflow(loop_workflow(name, unique("sectask")))
        run = await admin.start_run(name, {"q": 1})
        done = await asyncio.to_thread(
            cli,
            *("--tls-ca", str(pki.ca), "run", "list", "--json"),
            env={**flag, "DAGNATS_TOKEN": TOKENS["client"]},
        )
        assert done.returncode == 0, done.stderr
        assert run.run_id in {r["run_id"] for r in json.loads(done.stdout)}
        for token, what in (("", "needs a credential"), (TOKENS["worker"], "role worker")):
            done = await asyncio.to_thread(cli, "run", "list", env={**env, "DAGNATS_TOKEN": token})
            assert done.returncode == 1
            assert done.stderr.startswith("error: ") and what in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
        await admin.cancel_run(run.run_id)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(engine: EngineServer, pki: Pki) -> AsyncIterator[GatewayServer]:
    """A gateway with HTTP tokens of its own, holding a client and a worker
    token towards the TLS engine."""
    config = GatewayConfig(
        engine_target=engine.target,
        port=0,
        api_token="http-api",
        bridge_token="http-bridge",
        client_credentials=creds(pki, "client"),
        worker_credentials=creds(pki, "worker"),
    )
    server = await start_gateway(config)
    yield server
    await server.stop()


API = {"authorization": "Bearer http-api"}


async def test_the_gateway_holds_its_own_credentials_for_the_engine(
    engine: EngineServer, pki: Pki, gateway: GatewayServer
) -> None:
    name = unique("secwf")
    async with Client(engine.target, credentials=creds(pki, "admin")) as admin:
        await admin.register_workflow(loop_workflow(name, unique("sectask")))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        started = await http.post("/runs", json={"workflow": name}, headers=API)
        assert started.status_code == 201, started.text
        run_id = started.json()["run_id"]
        step = f"/runs/{run_id}/steps/agent/inputs"
        sent = {"request_id": "r1", "content": {"say": "hi"}}
        assert (await http.post(step, json=sent, headers=API)).status_code == 201
        (listed,) = (await http.get(step, headers=API)).json()["inputs"]
        assert listed["content"] == {"say": "hi"}  # the client's view, not a worker's
        assert (await http.get("/runs", headers=API)).status_code == 200
        cancel = await http.post(f"/runs/{run_id}/cancel", json={}, headers=API)
        assert cancel.status_code == 200, cancel.text
        # The client role may not register workflows: the gateway says so.
        answer = await http.post(
            "/workflows", json=loop_workflow(unique("secwf"), "t"), headers=API
        )
        assert answer.status_code == 403
        assert answer.json()["code"] == "permission_denied"
        document = (await http.get("/openapi.json", headers=API)).json()
    schemes = document["components"]["securitySchemes"]
    assert schemes["api_token"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schemes["api_token"]["description"],
    }
    assert schemes["bridge_token"]["scheme"] == "bearer"
    assert document["paths"]["/runs"]["get"]["security"] == [{"api_token": []}]
    assert document["paths"]["/bridge/poll"]["post"]["security"] == [{"bridge_token": []}]


async def test_the_gateway_serves_https_with_its_certificate(
    engine: EngineServer, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAGNATS_API_TOKEN", "http-api")
    monkeypatch.setenv("DAGNATS_BRIDGE_TOKEN", "http-bridge")
    monkeypatch.setenv("DAGNATS_GATEWAY_TLS_CERT", str(pki.cert))
    monkeypatch.setenv("DAGNATS_GATEWAY_CLIENT_TOKEN", TOKENS["client"])
    monkeypatch.setenv("DAGNATS_TLS_CA", str(pki.ca))
    with pytest.raises(InvalidArgument, match="go together") as half:
        GatewayConfig.from_env(engine.target, host="127.0.0.1", port=0)
    assert half.value.field == "DAGNATS_GATEWAY_TLS_KEY"
    monkeypatch.setenv("DAGNATS_GATEWAY_TLS_KEY", str(pki.cert))  # not a key
    with pytest.raises(InvalidArgument, match="cannot serve TLS"):
        await start_gateway(GatewayConfig.from_env(engine.target, host="127.0.0.1", port=0))
    monkeypatch.setenv("DAGNATS_GATEWAY_TLS_KEY", str(pki.key))
    server = await start_gateway(GatewayConfig.from_env(engine.target, host="127.0.0.1", port=0))
    try:
        assert server.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        async with httpx.AsyncClient(base_url=server.url, verify=trusted) as http:
            assert (await http.get("/runs", headers=API)).status_code == 200
        plain = server.url.replace("https://", "http://")
        async with httpx.AsyncClient(base_url=plain) as http:
            with pytest.raises(httpx.HTTPError):
                await http.get("/runs", headers=API)
        async with httpx.AsyncClient(base_url=server.url) as http:  # the system's CAs
            with pytest.raises(httpx.ConnectError):
                await http.get("/healthz")
    finally:
        await server.stop()


async def test_a_journaled_run_through_the_gateway_and_its_worker_bridge(
    engine: EngineServer, pki: Pki, gateway: GatewayServer, tmp_path: Path
) -> None:
    """The HTTP worker example on the bridge: the gateway's worker token
    polls, claims and commits; its client token starts the run over REST."""
    from tests.test_http_worker import ANSWER, ORDER, http_worker

    name, task = unique("secbridge"), unique("secbridgetask")
    async with Client(engine.target, credentials=creds(pki, "admin")) as admin:
        await admin.register_workflow(loop_workflow(name, task, max_iterations=5))
    async with (
        http_worker(gateway, task, tmp_path / "worker.log", DAGNATS_BRIDGE_TOKEN="http-bridge"),
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as http,
        Client(engine.target, credentials=creds(pki, "client")) as client,
    ):
        started = await http.post("/runs", json={"workflow": name, "input": ORDER}, headers=API)
        assert started.status_code == 201, started.text
        run = await client.wait_for_run(started.json()["run_id"], timeout=30)
    assert run.status == pb.RUN_STATUS_COMPLETED, (run.error, (tmp_path / "worker.log").read_text())
    assert run_output(run) == ANSWER
    async with JournalClient(engine.target, credentials=creds(pki, "client")) as journal:
        assert list((await journal.check(run.run_id)).violations) == []


async def test_the_node_worker_over_tls_with_a_worker_token(
    engine: EngineServer, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_node_worker import ANSWER, EXAMPLE, INPUT, NodeWorkers, lines

    node = _node()
    monkeypatch.setenv("DAGNATS_TOKEN", TOKENS["worker"])
    monkeypatch.setenv("DAGNATS_TLS_CA", str(pki.ca))
    started: list[subprocess.Popen[bytes]] = []
    name, task = unique("nodesec"), unique("nodesectask")
    try:
        async with Client(engine.target, credentials=creds(pki, "admin")) as client:
            await client.register_workflow(loop_workflow(name, task))
            workers = NodeWorkers(node, engine.target, task, tmp_path, started)
            proc = workers.spawn("worker")
            run = await client.start_run(name, INPUT)

            async def ended() -> pb.Run | None:
                workers.alive(proc)
                got = await client.get_run(run.run_id)
                return None if got.status == pb.RUN_STATUS_RUNNING else got

            done = await wait_for(ended, timeout=30, interval=0.05, message="no end")
            assert done.status == pb.RUN_STATUS_COMPLETED, f"{done.error}\n{workers.logs()}"
            assert run_output(done) == ANSWER
            assert lines(workers.starts) == [f"charge_card {run.run_id}.agent.0.1"]
        async with JournalClient(engine.target, credentials=creds(pki, "client")) as journal:
            assert list((await journal.check(run.run_id)).violations) == []
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert EXAMPLE.is_dir()


def _node() -> str:
    import shutil

    path = shutil.which("node")
    if path is None:
        pytest.fail("node is not on PATH: the Node.js worker example needs Node.js 20 or later")
    return path


# ---- refusing to be open -------------------------------------------------------------


def test_serve_refuses_an_open_port_and_names_the_missing_settings(pki: Pki) -> None:
    base = {"DAGNATS_NATS_URL": "nats://127.0.0.1:1"}  # refused before NATS is dialled
    for var in list(os.environ):
        if var.startswith("DAGNATS_GRPC_"):
            base[var] = ""
    done = cli("serve", "engine", "--host", "0.0.0.0", "--port", "0", env=base)
    assert done.returncode == 1
    assert done.stderr.startswith("error: refusing to serve gRPC on 0.0.0.0 without ")
    assert "DAGNATS_GRPC_TLS_CERT" in done.stderr and "DAGNATS_GRPC_TOKENS_FILE" in done.stderr
    tls = {**base, "DAGNATS_GRPC_TLS_CERT": str(pki.cert), "DAGNATS_GRPC_TLS_KEY": str(pki.key)}
    done = cli("serve", "engine", "--host", "0.0.0.0", "--port", "0", env=tls)
    assert done.returncode == 1
    assert "DAGNATS_GRPC_TOKENS_FILE" in done.stderr and "DAGNATS_GRPC_TLS_CERT" not in done.stderr
    assert "Traceback" not in done.stderr
