"""docker-compose.yml is the secured deployment: read as a user would check it
(there is no Docker here), and its nats-server config run for real as a
3-node cluster on loopback, with certificates deploy/make-certs.sh makes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import nats
import nats.errors
import pytest
import pytest_asyncio
import yaml

from dagnats.core import jetstream as jsx
from dagnats.core.natsauth import NatsSettings
from dagnats.core.natsserver import free_port, server_binary
from tests.helpers import wait_for

ROOT = Path(__file__).parent.parent
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
NODES = [name for name, s in SERVICES.items() if str(s.get("image", "")).startswith("nats:")]
NATS_CLIENT_SETTINGS = ("DAGNATS_NATS_NKEY", "DAGNATS_NATS_CA", "DAGNATS_NATS_CERT")
GRPC_SETTINGS = ("DAGNATS_GRPC_TLS_CERT", "DAGNATS_GRPC_TLS_KEY", "DAGNATS_GRPC_TOKENS_FILE")


def command(service: dict[str, Any]) -> str:
    cmd = service.get("command", "")
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path → host path (or named volume) of each mount and secret."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        found[target] = source
    for secret in service.get("secrets", []):
        found[f"/run/secrets/{secret}"] = COMPOSE["secrets"][secret]["file"]
    return found


def host_path(service: dict[str, Any], path: str) -> str | None:
    """Where the file a container sees at ``path`` comes from: a mount of it
    or of a directory above it, or a secret; None when nothing provides it."""
    for target, source in mounts(service).items():
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source + path[len(target) :]
    return None


def config_text() -> str:
    return "\n".join(line.split("#", 1)[0] for line in NATS_CONF.read_text().splitlines())


def blocks(text: str) -> dict[str, str]:
    """The ``name { ... }`` blocks at the top level of ``text``: name → body."""
    found: dict[str, str] = {}
    depth, start, name = 0, 0, ""
    for match in re.finditer(r"(\w+)?\s*:?\s*\{|\}", text):
        if match.group(0) == "}":
            depth -= 1
            if depth == 0:
                found[name] = text[start : match.start()]
        else:
            if depth == 0:
                name, start = match.group(1) or "", match.end()
            depth += 1
    return found


def top_level(text: str) -> str:
    """``text`` with every block removed."""
    while (cut := re.sub(r"\{[^{}]*\}", "", text)) != text:
        text = cut
    return text


# The compose file and the config it mounts, read.


def test_nats_nodes_run_the_mounted_config_and_publish_no_port() -> None:
    assert len(NODES) == 3
    for name in NODES:
        node = SERVICES[name]
        assert command(node) == "-c /etc/nats/nats.conf", name
        assert mounts(node)["/etc/nats/nats.conf"] == "./deploy/nats/nats.conf"
        assert mounts(node)["/data"] == name  # its own named volume
        assert "ports" not in node, f"{name} publishes NATS outside the compose network"
        assert node["environment"]["NATS_SERVER_NAME"] == name


def test_the_nats_config_requires_tls_credentials_and_keeps_jetstream_to_the_services() -> None:
    text = config_text()
    top = blocks(text)
    assert set(top) == {"jetstream", "tls", "accounts", "cluster"}
    assert "no_auth_user" not in text and "authorization" not in text and "token" not in text
    # No monitoring, websocket or leafnode port beside the client and route ports.
    assert not re.search(r"^\s*(http|https|websocket|leafnodes)\b", top_level(text), re.M)
    assert re.search(r"verify:\s*true", top["tls"]), "clients need a certificate (mTLS)"
    accounts = blocks(top["accounts"])
    assert set(accounts) == {"DAGNATS"}, "one account: the services'"
    services = accounts["DAGNATS"]
    assert re.search(r"^\s*jetstream:\s*enabled", top_level(services), re.M)
    users = re.findall(r"\{([^{}]*)\}", services)
    assert users and all("nkey:" in u and "password" not in u for u in users), users
    cluster = blocks(top["cluster"])
    assert "route-ca.pem" in cluster["tls"] and "/certs/ca.pem" not in cluster["tls"]


REPLICAS = ["dagnats-1", "dagnats-2", "dagnats-3"]


def test_the_services_run_as_three_replicas_of_serve_all() -> None:
    served = {
        n: command(s).split()[2] for n, s in SERVICES.items() if "dagnats serve" in command(s)
    }
    assert served == {**dict.fromkeys(REPLICAS, "all"), "gateway": "gateway"}
    # Each replica serves the engine, the journal and the inputs service on
    # one port: the gateway (and a worker) is given that one address, the
    # alias every replica answers to, and spreads its calls over them.
    gateway = command(SERVICES["gateway"])
    assert "--engine dns:///dagnats:7233" in gateway
    assert SERVICES["gateway"]["environment"]["DAGNATS_GRPC_BALANCE"] == "1"
    assert "--journal" not in gateway and "--inputs" not in gateway
    published = set()
    for replica in REPLICAS:
        service = SERVICES[replica]
        assert "--port 7233" in command(service)
        assert "--metrics-port 9464" in command(service)
        assert service["networks"]["default"]["aliases"] == ["dagnats"]
        published.add(service["ports"][0].split(":")[0])
    assert len(published) == len(REPLICAS), "each replica on a host port of its own"
    assert set(SERVICES["gateway"]["depends_on"]) == set(REPLICAS)


def test_each_replica_has_a_name_and_they_agree_on_the_partitions() -> None:
    env = [SERVICES[r]["environment"] for r in REPLICAS]
    assert [e["DAGNATS_REPLICA_ID"] for e in env] == REPLICAS
    partitions = {e["DAGNATS_PARTITIONS"] for e in env}
    assert len(partitions) == 1, "P is fixed: every replica must say the same"
    (p,) = partitions
    assert 1 <= int(p) <= 64
    assert int(p) % len(REPLICAS) == 0, "the replicas own equal shares"


def test_every_service_that_reaches_nats_has_credentials_and_tls() -> None:
    engines = [n for n, s in SERVICES.items() if "--nats" in command(s)]
    assert engines == REPLICAS
    for name, service in SERVICES.items():
        env = service.get("environment", {})
        if name in engines:
            assert all(env.get(s) for s in NATS_CLIENT_SETTINGS), (name, env)
            assert env.get("DAGNATS_NATS_KEY"), name
            for setting in (*NATS_CLIENT_SETTINGS, "DAGNATS_NATS_KEY"):
                assert host_path(service, env[setting]), f"{name}: {setting} is not mounted"
            assert all(u.startswith("nats://nats-") for u in _nats_urls(service))
        elif name not in NODES:
            assert not any(k.startswith("DAGNATS_NATS_") for k in env), name
            assert "nats://" not in command(service), f"{name} should not need NATS"


def test_the_grpc_and_gateway_ports_are_not_open() -> None:
    for name, service in SERVICES.items():
        if re.search(r"serve (engine|journal|inputs|all)\b", command(service)):
            env = service["environment"]
            for setting in GRPC_SETTINGS:
                assert host_path(service, env[setting]), f"{name}: {setting} is not mounted"
        if "serve gateway" in command(service):
            env = service["environment"]
            assert host_path(service, env["DAGNATS_TLS_CA"]), "the engine's CA is not mounted"
            for setting in ("DAGNATS_GATEWAY_TLS_CERT", "DAGNATS_GATEWAY_TLS_KEY"):
                assert host_path(service, env[setting]), f"{name}: {setting} is not mounted"
            tokens = ("DAGNATS_API_TOKEN", "DAGNATS_BRIDGE_TOKEN")
            for token in (*tokens, "DAGNATS_GATEWAY_CLIENT_TOKEN", "DAGNATS_GATEWAY_WORKER_TOKEN"):
                assert re.fullmatch(rf"\$\{{{token}:\?.+\}}", env[token]), f"{token} required"


def _nats_urls(service: dict[str, Any]) -> list[str]:
    match = re.search(r"--nats\s+(\S+)", command(service))
    assert match is not None
    return match.group(1).split(",")


# The config, run.


def test_make_certs_writes_every_file_the_compose_file_mounts(deploy: tuple[Path, str]) -> None:
    here, _ = deploy
    for name, service in SERVICES.items():
        files = [
            v
            for k, v in service.get("environment", {}).items()
            if k.endswith(("_CA", "_CERT", "_KEY", "_NKEY"))
        ]
        files += re.findall(r'"(/certs/[^"]+)"', NATS_CONF.read_text()) if name in NODES else []
        for file in files:
            source = host_path(service, file)
            assert source is not None and source.startswith("./deploy/"), (name, file)
            assert (here / source.removeprefix("./deploy/")).is_file(), (name, file, source)


def test_the_services_certificate_names_every_replica_the_gateway_may_dial(
    deploy: tuple[Path, str],
) -> None:
    here, _ = deploy
    cert = here / "certs" / "services" / "engine.pem"
    shown = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(cert)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = set(re.findall(r"DNS:([\w.-]+)", shown))
    replicas = {n for n, s in SERVICES.items() if re.search(r"serve (engine|all)\b", command(s))}
    assert replicas and replicas <= names, (replicas, names)
    assert "dagnats" in names, "the alias the gateway dials"
    dialled = re.search(r"--engine dns:///([\w.-]+):", command(SERVICES["gateway"]))
    assert dialled is not None and dialled.group(1) in names


def test_make_certs_writes_keys_and_the_seed_for_their_owner_only(
    deploy: tuple[Path, str],
) -> None:
    """Keys and the nkey seed 0600, the CAs' and the secrets' folders 0700;
    only certificates are readable by others. The compose containers run as
    root (no `user:`, and neither image sets one), so they read them all."""
    here, _ = deploy
    modes = {
        str(p.relative_to(here)): p.stat().st_mode & 0o777
        for p in here.rglob("*")
        if p.name != "make-certs.sh"
    }
    secret = [n for n in modes if n.endswith(".key") or n.startswith(("secrets/", "certs/ca/"))]
    assert len([n for n in secret if n.endswith(".key")]) == 7, sorted(modes)
    assert "secrets/nats-user.nk" in secret
    for name in secret:
        assert modes[name] == 0o600, (name, oct(modes[name]))
    assert modes["certs/ca"] == modes["secrets"] == 0o700
    readable = {n for n, mode in modes.items() if mode & 0o077}
    assert all(n.endswith(".pem") or (here / n).is_dir() for n in readable), sorted(readable)
    for service in SERVICES.values():
        assert "user" not in service, "a container user other than root needs keys 0640"


def test_make_certs_without_nkeys_writes_nothing_and_says_what_it_needs(
    tmp_path: Path,
) -> None:
    shutil.copy(ROOT / "deploy" / "make-certs.sh", tmp_path / "make-certs.sh")
    # A Python without site-packages: it has no nkeys.
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    result = subprocess.run(
        ["bash", str(tmp_path / "make-certs.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": str(bare)},
        timeout=60,
    )
    assert result.returncode == 1
    assert "needs Python with the nkeys package" in result.stderr, result.stderr
    assert "make setup" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare-python", "make-certs.sh"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Nodes:
    urls: list[str]
    routes: list[int]
    logs: list[Path]


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """deploy/make-certs.sh run in a copy of deploy/: its directory and the
    nkey public key it printed."""
    here = tmp_path_factory.mktemp("deploy")
    shutil.copy(ROOT / "deploy" / "make-certs.sh", here / "make-certs.sh")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(here / "make-certs.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    name, _, public = line.partition("=")
    assert name == "DAGNATS_NATS_NKEY_PUBLIC" and public.startswith("U")
    return here, public


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(
    deploy: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Nodes]:
    """The compose nodes on loopback: the same config with local paths and
    ports."""
    here, public = deploy
    base = tmp_path_factory.mktemp("compose-nats")
    ports = {n: (free_port(), free_port()) for n in NODES}
    text = NATS_CONF.read_text()
    procs = []
    try:
        for name in NODES:
            conf = text
            for old, new in [
                ('"/certs/', f'"{here}/certs/nats/'),
                ('"/data"', json.dumps(str(base / name))),
                ('"0.0.0.0:4222"', f'"127.0.0.1:{ports[name][0]}"'),
                ('"0.0.0.0:6222"', f'"127.0.0.1:{ports[name][1]}"'),
                *((f'"nats://{n}:6222"', f'"nats://127.0.0.1:{ports[n][1]}"') for n in NODES),
            ]:
                assert old in conf, f"the test's rendering no longer matches: {old}"
                conf = conf.replace(old, new)
            path = base / f"{name}.conf"
            path.write_text(conf)
            env = {**os.environ, "NATS_SERVER_NAME": name, "DAGNATS_NATS_NKEY_PUBLIC": public}
            with (base / f"{name}.log").open("wb") as log:
                procs.append(await spawn_server(path, log, env))
        yield Nodes(
            urls=[f"nats://127.0.0.1:{ports[n][0]}" for n in NODES],
            routes=[ports[n][1] for n in NODES],
            logs=[base / f"{n}.log" for n in NODES],
        )
    finally:
        await asyncio.gather(*(stop(proc) for proc in procs))


async def spawn_server(
    config: Path, log: IO[bytes], env: dict[str, str]
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        server_binary(), "-c", str(config), stdout=log, stderr=log, env=env
    )


async def stop(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def services_settings(here: Path) -> NatsSettings:
    certs = here / "certs" / "services"
    return NatsSettings.from_env(
        {
            "DAGNATS_NATS_NKEY": str(here / "secrets" / "nats-user.nk"),
            "DAGNATS_NATS_CA": str(certs / "ca.pem"),
            "DAGNATS_NATS_CERT": str(certs / "services.pem"),
            "DAGNATS_NATS_KEY": str(certs / "services.key"),
        }
    )


async def test_the_compose_cluster_refuses_anonymous_and_serves_the_services(
    cluster: Nodes, deploy: tuple[Path, str]
) -> None:
    urls = cluster.urls
    here, _ = deploy
    settings = services_settings(here)
    tls = settings.tls_context()
    assert tls is not None

    async def refused_without_a_credential() -> bool:
        try:
            nc = await nats.connect(urls[0], tls=tls, allow_reconnect=False, connect_timeout=1)
        except nats.errors.Error as err:
            return "Authorization Violation" in str(err)
        except OSError:
            return False  # not listening yet
        await nc.close()
        raise AssertionError("an anonymous connection got in")

    await wait_for(refused_without_a_credential, timeout=20, message="anonymous refused")
    with pytest.raises(ssl.SSLError):  # a client that does not trust the deployment's CA
        await nats.connect(urls[1], allow_reconnect=False, connect_timeout=2)

    nc = await jsx.connect(",".join(urls), name="compose-services", settings=settings)
    try:
        # R3 streams need the routes (their own mTLS) between all three nodes.
        await jsx.provision(nc.jetstream(), jsx.Topology(replicas=3), deadline=30)
        info = await nc.jetstream().stream_info(jsx.JOURNAL)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    finally:
        await nc.close()


async def test_a_route_without_the_route_ca_cannot_join(
    cluster: Nodes, deploy: tuple[Path, str], tmp_path: Path
) -> None:
    """A server holding a certificate of the deployment's client CA (what a
    service holds) is not accepted as a route."""
    here, public = deploy
    certs = here / "certs"
    port, route = free_port(), free_port()
    routes = [f'"nats://127.0.0.1:{p}"' for p in cluster.routes]
    conf = f"""
server_name: intruder
listen: "127.0.0.1:{port}"
jetstream {{ store_dir: {json.dumps(str(tmp_path / "store"))} }}
accounts {{ DAGNATS {{ jetstream: enabled, users: [ {{nkey: {json.dumps(public)}}} ] }} }}
cluster {{
  name: "dagnats"
  listen: "127.0.0.1:{route}"
  tls {{
    cert_file: {json.dumps(str(certs / "services" / "services.pem"))}
    key_file: {json.dumps(str(certs / "services" / "services.key"))}
    ca_file: {json.dumps(str(certs / "nats" / "route-ca.pem"))}
  }}
  routes: [ {", ".join(routes)} ]
}}
"""
    path = tmp_path / "intruder.conf"
    path.write_text(conf)
    log_path = tmp_path / "intruder.log"
    with log_path.open("wb") as log:
        proc = await spawn_server(path, log, dict(os.environ))
    try:
        # It trusts the routes' CA (public knowledge); the nodes do not trust
        # its certificate, so it never sends one they would accept.
        refusal = "TLS route handshake error: tls: client didn't provide a certificate"
        await wait_for(
            lambda: all(refusal in log.read_text() for log in cluster.logs),
            timeout=20,
            message="every node refused the intruder's route",
        )
        nc = await jsx.connect(
            ",".join(cluster.urls), name="compose-check", settings=services_settings(here)
        )
        try:
            await jsx.provision(nc.jetstream(), jsx.Topology(replicas=3), deadline=30)
            info = await nc.jetstream().stream_info(jsx.HISTORY)
            assert info.cluster is not None
            peers = {info.cluster.leader, *(r.name for r in info.cluster.replicas or [])}
            assert peers == set(NODES)
        finally:
            await nc.close()
    finally:
        await stop(proc)
