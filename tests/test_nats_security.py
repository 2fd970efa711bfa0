"""NATS with accounts and TLS: the services' account is the only one with
JetStream, nobody connects without a credential, and the services run a
journaled run over mTLS with their user; bad settings stop a service at
start-up with a message naming the setting, never the secret."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import nkeys  # type: ignore[import-untyped]
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from dagnats.core import jetstream as jsx
from dagnats.core.errors import InvalidArgument
from dagnats.core.natsauth import NatsSettings
from dagnats.core.natsconfig import SERVICES_ACCOUNT, NatsUser
from dagnats.core.natsserver import NatsServer
from dagnats.core.subjects import commit_event_subject
from dagnats.engine.server import EngineServer, start_engine
from dagnats.sdk import Client, JournalClient, Worker
from dagnats.sdk.testing import ScriptedModel
from examples.agent_turn.handler import make_agent_turn
from tests.helpers import wait_for
from tests.secured import GUEST_USER, Certs, make_certs
from tests.stack import FAST, loop_workflow, steps_by_id, unique

SCRIPT: list[dict[str, Any]] = [
    {"done": False, "tool": "search", "input": {"q": "weather"}},
    {"done": False, "tool": "send_email", "input": {"to": "ops"}},
    {"done": True, "answer": "sunny, ops told"},
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def seed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An nkey user seed, as ``nk -gen user`` writes it."""
    path = tmp_path_factory.mktemp("nkey") / "user.nk"
    path.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def secured(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, seed_file: Path
) -> AsyncIterator[NatsServer]:
    """mTLS, the services' account (a password user and an nkey user) and a
    guest in an account without JetStream."""
    public = nkeys.from_seed(bytearray(seed_file.read_bytes())).public_key.decode()
    security = certs.security(guests=True)
    security = dataclasses.replace(security, services=(*security.services, NatsUser(nkey=public)))
    server = await NatsServer.start(tmp_path_factory.mktemp("secured"), security=security)
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(secured: NatsServer, certs: Certs) -> AsyncIterator[EngineServer]:
    server = await start_engine(secured.url, config=FAST, nats_settings=certs.settings())
    yield server
    await server.stop()


async def answered(client: Client, run_id: str) -> bool:
    step = steps_by_id(await client.get_run(run_id))["agent"]
    return step.waiting_for_input and step.output == b'"sunny, ops told"'


def client_tls(certs: Certs, *, mutual: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if mutual:
        context.load_cert_chain(str(certs.file("client.pem")), str(certs.file("client.key")))
    return context


async def raw_connect(server: NatsServer, **options: Any) -> NATS:
    """One try, no reconnects: what a stranger on the network gets."""
    return await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def connz(server: NatsServer) -> list[dict[str, Any]]:
    from dagnats.core.natsserver import _get_json

    doc = await _get_json(f"{server.monitor_url}/connz?auth=true")
    conns: list[dict[str, Any]] = doc.get("connections", [])
    return conns


# Who gets in.


async def test_a_connection_without_credentials_is_refused(
    secured: NatsServer, certs: Certs
) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await raw_connect(secured, tls=client_tls(certs))


async def test_plaintext_and_an_untrusted_server_are_refused(
    secured: NatsServer, certs: Certs, tmp_path: Path
) -> None:
    password = {"user": "dagnats", "password": certs.password}
    # Without a CA that signed the server's certificate, the handshake fails:
    # this client does not trust the server (the system's CAs do not sign it).
    with pytest.raises(ssl.SSLCertVerificationError):
        await raw_connect(secured, **password)
    # With the CA but without a client certificate, the server refuses (mTLS).
    with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):
        nc = await raw_connect(secured, tls=client_tls(certs, mutual=False), **password)
        await nc.flush(timeout=2)  # TLS 1.3: the server's alert arrives after the handshake


async def test_a_guest_account_cannot_reach_jetstream(secured: NatsServer, certs: Certs) -> None:
    services = await raw_connect(
        secured, tls=client_tls(certs), user="dagnats", password=certs.password
    )
    guest = await raw_connect(
        secured, tls=client_tls(certs), user=GUEST_USER, password=certs.guest_password
    )
    try:
        await jsx.provision(services.jetstream())
        names = await services.jetstream().streams_info()
        assert jsx.JOURNAL in {s.config.name for s in names}  # there is something to hide
        js = guest.jetstream()
        with pytest.raises(nats.js.errors.APIError) as listed:
            await js.streams_info()
        assert listed.value.err_code == 10039  # JetStream not enabled for account
        with pytest.raises(nats.js.errors.APIError):
            await js.key_value(jsx.KV_INPUTS)
        raw = await guest.request(
            f"$JS.API.STREAM.MSG.GET.{jsx.JOURNAL}", json.dumps({"seq": 1}).encode(), timeout=2
        )
        assert json.loads(raw.data)["error"]["err_code"] == 10039
    finally:
        await guest.close()
        await services.close()


async def test_only_the_services_account_reaches_the_engines_held_events(
    engine: EngineServer, secured: NatsServer, certs: Certs
) -> None:
    # The journal service sends a kept task's commit event to the engines on one
    # constant subject; a guest's publish there reaches no engine.
    services = await raw_connect(
        secured, tls=client_tls(certs), user="dagnats", password=certs.password
    )
    guest = await raw_connect(
        secured, tls=client_tls(certs), user=GUEST_USER, password=certs.guest_password
    )
    try:
        seen: list[bytes] = []

        async def observe(msg: Any) -> None:
            seen.append(msg.data)

        subject = commit_event_subject("run")
        await services.subscribe(subject, cb=observe)
        await services.flush()
        with pytest.raises(nats.errors.NoRespondersError):
            await guest.request(subject, b"from a guest", timeout=2)
        dropped = engine.engine.counters["direct_dropped"]

        async def an_engine_dropped_it() -> bool:
            # Sent again until heard: a new engine subscribes to the subject
            # once it owns the run's partition, which may come after its start.
            await services.publish(subject, b"no event")
            await services.flush()
            return engine.engine.counters["direct_dropped"] > dropped

        await wait_for(an_engine_dropped_it, timeout=10, interval=0.2)
        # The guest's never reached the services' account.
        assert seen and set(seen) == {b"no event"}
    finally:
        await guest.close()
        await services.close()


# The services with credentials.


async def test_the_services_run_a_journaled_run_over_mtls(
    engine: EngineServer, secured: NatsServer
) -> None:
    name, task = unique("secured"), unique("secured-task")
    model = ScriptedModel(SCRIPT)
    starts: list[str] = []

    async def tool(tool_name: str, input: Any, key: str) -> Any:
        starts.append(tool_name)
        return {"tool": tool_name}

    async with Client(engine.target) as client:
        await client.register_workflow(loop_workflow(name, task))
        async with Worker(engine.target, handlers={task: make_agent_turn(model, tool)}):
            run = await client.start_run(name, "weather, then tell ops")
            # The answered step stays open for follow-ups, holding no worker.
            await wait_for(lambda: answered(client, run.run_id), timeout=40)
        await client.cancel_run(run.run_id)
    async with JournalClient(engine.target) as journal:
        records = [r async for r in journal.read(run.run_id, "agent")]
        check = await journal.check(run.run_id)

    assert starts == ["search", "send_email"]
    assert len(records) >= 6, records  # model and tool records of three iterations
    assert list(check.violations) == [], check.violations
    [conn] = [c for c in await connz(secured) if c.get("name") == "dagnats-engine"]
    assert conn["account"] == SERVICES_ACCOUNT and conn["authorized_user"] == "dagnats"
    assert conn["tls_version"].startswith("1."), conn


async def test_an_nkey_seed_file_is_a_credential(
    secured: NatsServer, certs: Certs, seed_file: Path
) -> None:
    settings = certs.settings(
        DAGNATS_NATS_USER="", DAGNATS_NATS_PASSWORD="", DAGNATS_NATS_NKEY=str(seed_file)
    )
    nc = await jsx.connect(secured.url, name="nkey-user", settings=settings)
    try:
        info = await nc.jetstream().account_info()
        assert info.streams >= 1
    finally:
        await nc.close()


# Bad settings stop a service with the setting's name.


async def test_a_wrong_password_stops_the_engine_naming_the_setting(
    secured: NatsServer, certs: Certs
) -> None:
    settings = certs.settings(DAGNATS_NATS_PASSWORD="not-the-password")
    with pytest.raises(InvalidArgument) as refused:
        await asyncio.wait_for(start_engine(secured.url, nats_settings=settings), 20)
    assert refused.value.field == "DAGNATS_NATS_USER"
    assert "DAGNATS_NATS_USER/DAGNATS_NATS_PASSWORD" in str(refused.value)
    assert "not-the-password" not in str(refused.value)


async def test_no_credential_and_an_untrusted_ca_name_their_settings(
    secured: NatsServer, certs: Certs, tmp_path: Path
) -> None:
    anonymous = certs.settings(DAGNATS_NATS_USER="", DAGNATS_NATS_PASSWORD="")
    with pytest.raises(InvalidArgument, match="requires a credential") as missing:
        await asyncio.wait_for(jsx.connect(secured.url, name="x", settings=anonymous), 20)
    assert missing.value.field == "DAGNATS_NATS_USER"

    other = make_certs(tmp_path / "other")
    untrusted = certs.settings(DAGNATS_NATS_CA=str(other.ca))
    with pytest.raises(InvalidArgument, match="TLS handshake") as bad_ca:
        await asyncio.wait_for(jsx.connect(secured.url, name="x", settings=untrusted), 20)
    assert bad_ca.value.field == "DAGNATS_NATS_CA"


async def test_dagnats_serve_with_a_wrong_password_says_which_setting(
    secured: NatsServer, certs: Certs, tmp_path: Path
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("wrong-password-123\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGNATS_NATS_")}
    flags = ["--nats-user", "dagnats", "--nats-password-file", str(password_file)]
    flags += ["--nats-ca", str(certs.ca), "--nats-cert", str(certs.file("client.pem"))]
    flags += ["--nats-key", str(certs.file("client.key"))]
    command = [sys.executable, "-m", "dagnats.cli.main", "serve", "engine", "--port", "0"]
    result = await asyncio.to_thread(
        subprocess.run,
        [*command, "--nats", secured.url, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: nats-server at ") and "refused the credential" in line
    assert "DAGNATS_NATS_USER/DAGNATS_NATS_PASSWORD_FILE" in line
    assert "wrong-password-123" not in line


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"DAGNATS_NATS_USER": "u"}, "DAGNATS_NATS_PASSWORD or DAGNATS_NATS_PASSWORD_FILE"),
        ({"DAGNATS_NATS_PASSWORD": "p"}, "DAGNATS_NATS_USER"),
        ({"DAGNATS_NATS_USER": "u", "DAGNATS_NATS_PASSWORD": "p", "DAGNATS_NATS_TOKEN": "t"}, ""),
        ({"DAGNATS_NATS_CA": "/nonexistent/ca.pem"}, "DAGNATS_NATS_CA"),
        ({"DAGNATS_NATS_CREDS": "/nonexistent/x.creds"}, "DAGNATS_NATS_CREDS"),
        ({"DAGNATS_NATS_PASSWORD_FILE": "/nonexistent/pw"}, "DAGNATS_NATS_PASSWORD_FILE"),
    ],
    ids=["user-alone", "password-alone", "two-credentials", "no-ca", "no-creds", "no-pw-file"],
)
def test_settings_are_checked_before_any_connection(env: dict[str, str], setting: str) -> None:
    with pytest.raises(InvalidArgument) as bad:
        NatsSettings.from_env(env)
    assert setting in str(bad.value)
    for value in env.values():
        if not value.startswith("/"):  # paths are named; secrets are not
            assert f"{value!r}" not in str(bad.value) and f" {value} " not in str(bad.value)


def test_files_that_are_not_what_their_setting_says(certs: Certs, tmp_path: Path) -> None:
    not_a_seed = tmp_path / "seed"
    not_a_seed.write_text("SECRET-NOT-A-SEED\n")
    with pytest.raises(InvalidArgument, match="holds no nkey user seed") as seed:
        NatsSettings.from_env({"DAGNATS_NATS_NKEY": str(not_a_seed)})
    assert seed.value.field == "DAGNATS_NATS_NKEY" and "SECRET" not in str(seed.value)
    with pytest.raises(InvalidArgument, match="not a NATS creds file"):
        NatsSettings.from_env({"DAGNATS_NATS_CREDS": str(not_a_seed)})
    with pytest.raises(InvalidArgument, match="DAGNATS_NATS_KEY is not set"):
        NatsSettings.from_env({"DAGNATS_NATS_CERT": str(certs.file("client.pem"))})
    with pytest.raises(InvalidArgument, match="do not load") as mismatched:
        NatsSettings.from_env(
            {
                "DAGNATS_NATS_CERT": str(certs.file("client.pem")),
                "DAGNATS_NATS_KEY": str(certs.file("server.key")),
            }
        )
    assert mismatched.value.field == "DAGNATS_NATS_CERT"


def test_secrets_stay_out_of_repr(certs: Certs) -> None:
    settings = certs.settings()
    assert certs.password not in repr(settings)
    assert "token-xyz" not in repr(NatsSettings.from_env({"DAGNATS_NATS_TOKEN": "token-xyz"}))
    assert NatsSettings.from_env({"DAGNATS_NATS_TOKEN": "t"}).connect_options() == {"token": "t"}
