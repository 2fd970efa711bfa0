"""A secured nats-server for tests: the services' account, users and TLS, with
certificates ``trustme`` makes on the spot.

``DAGNATS_TEST_NATS_AUTH=1`` runs the suite's servers this way: ``conftest``
makes one set of certificates per session and puts the services' settings
(``DAGNATS_NATS_*``) into the environment, where every ``jetstream.connect``
of the test process and every engine process it starts reads them, and the
fixtures (and the crash matrix's and the soak's own servers) start with
:func:`suite_security`.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import trustme

from dagnats.core.natsauth import NatsSettings
from dagnats.core.natsconfig import NatsUser, Security, TLSFiles
from dagnats.core.settings import env_bool

AUTH_FLAG = "DAGNATS_TEST_NATS_AUTH"
SERVICES_USER = "dagnats"
GUEST_USER = "guest"


@dataclass(frozen=True, slots=True, kw_only=True)
class Certs:
    """Certificate files in one directory: a client CA signing the server's and
    the services' certificates, and a separate CA for the routes."""

    dir: Path
    password: str
    guest_password: str

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def file(self, name: str) -> Path:
        return self.dir / name

    def security(self, *, verify: bool = True, guests: bool = False) -> Security:
        """The server side: the services' user (and, with ``guests``, a user in
        an account without JetStream), client TLS (mTLS with ``verify``) and
        route TLS."""
        others = (NatsUser(user=GUEST_USER, password=self.guest_password),) if guests else ()
        return Security(
            services=(NatsUser(user=SERVICES_USER, password=self.password),),
            others=others,
            tls=TLSFiles(
                cert_file=self.file("server.pem"),
                key_file=self.file("server.key"),
                ca_file=self.ca,
                verify=verify,
            ),
            route_tls=TLSFiles(
                cert_file=self.file("route.pem"),
                key_file=self.file("route.key"),
                ca_file=self.file("route-ca.pem"),
            ),
        )

    def env(self) -> dict[str, str]:
        """The services' ``DAGNATS_NATS_*`` settings: user, password, mTLS."""
        return {
            "DAGNATS_NATS_USER": SERVICES_USER,
            "DAGNATS_NATS_PASSWORD": self.password,
            "DAGNATS_NATS_CA": str(self.ca),
            "DAGNATS_NATS_CERT": str(self.file("client.pem")),
            "DAGNATS_NATS_KEY": str(self.file("client.key")),
        }

    def settings(self, **changes: str) -> NatsSettings:
        """:meth:`env` as settings, with ``changes`` applied (an empty value unsets)."""
        return NatsSettings.from_env({**self.env(), **changes})


def make_certs(directory: Path) -> Certs:
    """Write a CA, server, client and route certificates (for 127.0.0.1 and
    localhost) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, route_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    route_ca.cert_pem.write_to_path(str(directory / "route-ca.pem"))
    issued = {
        "server": ca.issue_cert("127.0.0.1", "localhost"),
        "client": ca.issue_cert("dagnats-services"),
        "route": route_ca.issue_cert("127.0.0.1", "localhost"),
    }
    for name, leaf in issued.items():
        leaf.cert_chain_pems[0].write_to_path(str(directory / f"{name}.pem"))
        leaf.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    return Certs(
        dir=directory, password=secrets.token_urlsafe(16), guest_password=secrets.token_urlsafe(16)
    )


_suite: Certs | None = None


def suite_auth() -> bool:
    """Whether ``DAGNATS_TEST_NATS_AUTH`` asks for secured servers."""
    return env_bool(AUTH_FLAG, False)


def install_suite_certs(directory: Path) -> Certs:
    """Make the session's certificates and put the services' settings into the
    environment (see the module docstring)."""
    global _suite
    _suite = make_certs(directory)
    os.environ.update(_suite.env())
    return _suite


def suite_security() -> Security | None:
    """The security of every server the suite starts: None unless
    ``DAGNATS_TEST_NATS_AUTH`` is on."""
    return None if _suite is None else _suite.security()
