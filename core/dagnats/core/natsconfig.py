"""The nats-server configuration files ``NatsServer`` writes, secured or open.

Open (the default, for loopback): one global account, anonymous clients,
JetStream for everyone. Secured (a ``Security``): the shape of
docs/adr/0020-nats-accounts-and-tls.md --

* the services' account ``DAGNATS`` is the only one with JetStream; its users
  are the services. Isolation is per account: a user of another account
  cannot reach its streams, buckets or subjects at all, whereas permissions
  inside one account do not cover the whole JetStream API;
* any other users live in ``APPS``, an account without JetStream;
* no ``no_auth_user``: a connection without a credential is refused;
* client TLS (optionally mTLS, ``verify``) and, in a cluster, route TLS,
  which nats-server always verifies in both directions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "APPS_ACCOUNT",
    "SERVICES_ACCOUNT",
    "ClusterConfig",
    "NatsUser",
    "Security",
    "ServerConfig",
    "TLSFiles",
]

MAX_PAYLOAD = 8 * 1024 * 1024
SERVICES_ACCOUNT = "DAGNATS"
APPS_ACCOUNT = "APPS"

# A JSON string is a valid quoted string in the NATS config syntax.
_q = json.dumps


@dataclass(frozen=True, slots=True, kw_only=True)
class TLSFiles:
    """A ``tls {}`` block: this side's certificate and key, and the CA that
    signed the other side's; ``verify`` requires the other side's certificate."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    verify: bool = False

    def render(self, indent: str) -> list[str]:
        lines = [f"cert_file: {_q(str(self.cert_file))}", f"key_file: {_q(str(self.key_file))}"]
        if self.ca_file is not None:
            lines.append(f"ca_file: {_q(str(self.ca_file))}")
        if self.verify:
            lines.append("verify: true")
        lines.append("timeout: 5")
        return [f"{indent}tls {{", *(f"{indent}  {line}" for line in lines), f"{indent}}}"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsUser:
    """One user of an account: a name and password, or an nkey (public key)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    nkey: str | None = None

    def __post_init__(self) -> None:
        if (self.nkey is None) == (self.user is None) or (self.user is None) != (
            self.password is None
        ):
            raise ValueError("a NATS user has a user and a password, or an nkey")

    def render(self) -> str:
        if self.nkey is not None:
            return f"{{nkey: {_q(self.nkey)}}}"
        return f"{{user: {_q(self.user)}, password: {_q(self.password)}}}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Security:
    """Accounts and TLS for a secured server (see the module docstring)."""

    services: tuple[NatsUser, ...]
    others: tuple[NatsUser, ...] = ()
    tls: TLSFiles | None = None
    route_tls: TLSFiles | None = None

    def render(self) -> list[str]:
        lines = self.tls.render("") if self.tls is not None else []
        lines += [
            "accounts {",
            f"  {SERVICES_ACCOUNT} {{",
            "    jetstream: enabled",
            "    users: [",
            *(f"      {u.render()}" for u in self.services),
            "    ]",
            "  }",
        ]
        if self.others:
            lines += [f"  {APPS_ACCOUNT} {{", "    users: ["]
            lines += [*(f"      {u.render()}" for u in self.others), "    ]", "  }"]
        return [*lines, "}"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """The ``cluster {}`` block: this server's route port and every member's route URL."""

    name: str
    port: int
    routes: tuple[str, ...]
    host: str = "127.0.0.1"

    def render(self, tls: TLSFiles | None) -> list[str]:
        lines = [
            "cluster {",
            f"  name: {_q(self.name)}",
            f"  listen: {_q(f'{self.host}:{self.port}')}",
        ]
        if tls is not None:
            lines += tls.render("  ")
        return [*lines, "  routes: [", *(f"    {_q(r)}" for r in self.routes), "  ]", "}"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything written into one server's config file."""

    store_dir: Path
    port: int
    monitor_port: int
    host: str = "127.0.0.1"
    sync_always: bool = True
    server_name: str | None = None
    cluster: ClusterConfig | None = None
    security: Security | None = None
    log_file: Path | None = None

    @property
    def config_file(self) -> Path:
        return self.store_dir / "nats-server.conf"

    def render(self) -> str:
        """The nats-server configuration text."""
        lines = [] if self.server_name is None else [f"server_name: {_q(self.server_name)}"]
        lines += [
            f"listen: {_q(f'{self.host}:{self.port}')}",
            f"http: {_q(f'{self.host}:{self.monitor_port}')}",
            f"max_payload: {MAX_PAYLOAD}",
            "jetstream {",
            f"  store_dir: {_q(str(self.store_dir))}",
        ]
        if self.sync_always:
            lines.append("  sync_interval: always")
        lines.append("}")
        if self.security is not None:
            lines += self.security.render()
        if self.cluster is not None:
            route_tls = self.security.route_tls if self.security is not None else None
            lines += self.cluster.render(route_tls)
        return "\n".join(lines) + "\n"
