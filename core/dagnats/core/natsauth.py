"""How the services prove who they are to nats-server: credentials and TLS.

Read once at start-up from ``DAGNATS_NATS_*`` settings (the environment, or
``dagnats serve``'s flags, which set the same names) and checked there: a
missing file, a half-given pair, two credentials at once or a file that is not
what its setting says is an ``InvalidArgument`` naming the setting. Messages
name settings and paths, never a secret.

Invariants:

* At most one credential: a user and password, a token, an nkey seed file or
  a creds file (a user JWT with its seed).
* TLS is on when a CA, a client certificate or a ``tls://`` URL is given; the
  certificate and its key come together (mTLS), and both load before any
  connection is tried.
* Secrets never appear in ``repr`` or in an error message.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagnats.core.errors import InvalidArgument
from dagnats.core.settings import env_file

__all__ = ["FLAGS", "NatsSettings", "is_refusal"]

USER = "DAGNATS_NATS_USER"
PASSWORD = "DAGNATS_NATS_PASSWORD"
PASSWORD_FILE = "DAGNATS_NATS_PASSWORD_FILE"
TOKEN = "DAGNATS_NATS_TOKEN"
TOKEN_FILE = "DAGNATS_NATS_TOKEN_FILE"
NKEY = "DAGNATS_NATS_NKEY"
CREDS = "DAGNATS_NATS_CREDS"
CA = "DAGNATS_NATS_CA"
CERT = "DAGNATS_NATS_CERT"
KEY = "DAGNATS_NATS_KEY"

# The ``dagnats serve`` flag of each setting that may be given as a flag. A
# password or token is only ever read from the environment or a file, never
# from a command line other users of the machine can see.
FLAGS: dict[str, tuple[str, str]] = {
    USER: ("--nats-user", "NATS user (with a password)"),
    PASSWORD_FILE: ("--nats-password-file", "file holding the NATS user's password"),
    TOKEN_FILE: ("--nats-token-file", "file holding a NATS token"),
    NKEY: ("--nats-nkey", "file holding an nkey user seed"),
    CREDS: ("--nats-creds", "NATS creds file (user JWT and seed)"),
    CA: ("--nats-ca", "CA that signed nats-server's certificate (turns TLS on)"),
    CERT: ("--nats-cert", "client certificate for mTLS to nats-server"),
    KEY: ("--nats-key", "key of the client certificate"),
}

_SEED_PREFIX = "SU"  # an nkey user seed
_CREDS_MARKERS = ("-----BEGIN NATS USER JWT-----", "-----BEGIN USER NKEY SEED-----")


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsSettings:
    """Credentials and TLS for connecting to nats-server; all empty connects
    anonymously and in plaintext, as ``dagnats dev`` does on loopback.

    ``credential`` names the setting(s) the credential came from, so an error
    about it can say which setting to fix.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_file: Path | None = None
    creds_file: Path | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    credential: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NatsSettings:
        """Read and check the ``DAGNATS_NATS_*`` settings.

        Args:
            env: where the settings are; ``os.environ`` by default.

        Raises:
            InvalidArgument: a setting is malformed, half of a pair is missing,
                a file cannot be read or is not what the setting says, or two
                credentials are given; ``field`` names the setting.
        """
        env = os.environ if env is None else env
        user = env.get(USER) or None
        password = _secret(env, PASSWORD, PASSWORD_FILE)
        token = _secret(env, TOKEN, TOKEN_FILE)
        nkey_file = _file(env, NKEY)
        creds_file = _file(env, CREDS)
        if (user is None) != (password is None):
            missing = f"{PASSWORD} or {PASSWORD_FILE}" if password is None else USER
            raise InvalidArgument(f"{missing} is not set; a NATS user needs both", field=missing)
        pair = f"{USER}/{PASSWORD_FILE if env.get(PASSWORD_FILE) else PASSWORD}"
        given = [
            name
            for name, value in (
                (pair, user),
                (TOKEN, token),
                (NKEY, nkey_file),
                (CREDS, creds_file),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise InvalidArgument(
                f"{' and '.join(given)} are all set; give one NATS credential", field=given[1]
            )
        if nkey_file is not None:
            _check_seed(nkey_file)
        if creds_file is not None:
            _check_creds(creds_file)
        settings = cls(
            user=user,
            password=password,
            token=token,
            nkey_file=nkey_file,
            creds_file=creds_file,
            ca_file=_file(env, CA),
            cert_file=_file(env, CERT),
            key_file=_file(env, KEY),
            credential=given[0] if given else None,
        )
        settings.tls_context()  # a certificate that does not load stops us here
        return settings

    @property
    def tls(self) -> bool:
        """Whether these settings ask for TLS."""
        return any(f is not None for f in (self.ca_file, self.cert_file, self.key_file))

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context: the server verified against the CA (or the
        system's), and this side's certificate for mTLS; None without TLS.

        Raises:
            InvalidArgument: a certificate, key or CA does not load, or a
                certificate is given without its key or a key without it.
        """
        if not self.tls:
            return None
        if (self.cert_file is None) != (self.key_file is None):
            missing = CERT if self.cert_file is None else KEY
            raise InvalidArgument(
                f"{missing} is not set; a client certificate needs both {CERT} and {KEY}",
                field=missing,
            )
        try:
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        except (ssl.SSLError, OSError) as err:
            raise InvalidArgument(
                f"{CA}: {self.ca_file} holds no usable CA ({err})", field=CA
            ) from None
        if self.cert_file is not None and self.key_file is not None:
            try:
                context.load_cert_chain(str(self.cert_file), str(self.key_file))
            except (ssl.SSLError, OSError) as err:
                raise InvalidArgument(
                    f"{CERT}/{KEY}: {self.cert_file} and {self.key_file} do not load as "
                    f"a certificate and its key ({err})",
                    field=CERT,
                ) from None
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` that carry these settings."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options.update(user=self.user, password=self.password)
        if self.token is not None:
            options["token"] = self.token
        if self.nkey_file is not None:
            options["nkeys_seed"] = str(self.nkey_file)
        if self.creds_file is not None:
            options["user_credentials"] = str(self.creds_file)
        if (context := self.tls_context()) is not None:
            options["tls"] = context
        return options

    def refused(self, url: str, err: BaseException) -> InvalidArgument:
        """The error for a server that turned these settings down (see
        :func:`is_refusal`): which setting to look at, no secret."""
        if not _is_auth(err):
            field = CA if isinstance(err, ssl.SSLCertVerificationError) else CERT
            return InvalidArgument(
                f"the TLS handshake with nats-server at {url} failed ({err}); check {CA} "
                f"(the CA that signed the server's certificate), and {CERT} and {KEY} when "
                "the server asks for a client certificate",
                field=field,
            )
        if self.credential is None:
            return InvalidArgument(
                f"nats-server at {url} requires a credential ({err}); set {USER} and "
                f"{PASSWORD_FILE}, {NKEY} or {CREDS}",
                field=USER,
            )
        return InvalidArgument(
            f"nats-server at {url} refused the credential of {self.credential} ({err})",
            field=self.credential.split("/")[0],
        )


def is_refusal(err: BaseException) -> bool:
    """Whether the server turned a connection down for its credential or its
    TLS: trying again with the same settings cannot succeed."""
    return isinstance(err, ssl.SSLError) or _is_auth(err)


def _is_auth(err: BaseException) -> bool:
    # nats-py raises the server's -ERR as a plain Error carrying its text.
    # Imported here: the CLI reads these settings without loading nats.
    import nats.errors

    return isinstance(err, nats.errors.AuthorizationError) or (
        "authorization violation" in str(err).lower()
    )


def _file(env: Mapping[str, str], name: str) -> Path | None:
    return env_file(name, env)


def _secret(env: Mapping[str, str], name: str, file_name: str) -> str | None:
    """A secret given as ``name`` itself or in the file ``file_name`` names."""
    inline, path = env.get(name) or None, _file(env, file_name)
    if inline is not None and path is not None:
        raise InvalidArgument(f"{name} and {file_name} are both set; give one", field=file_name)
    if path is None:
        return inline
    value = path.read_text().strip()
    if not value:
        raise InvalidArgument(f"{file_name}: {path} is empty", field=file_name)
    return value


def _check_seed(path: Path) -> None:
    if not path.read_text().strip().startswith(_SEED_PREFIX):
        raise InvalidArgument(
            f"{NKEY}: {path} holds no nkey user seed (one line starting with "
            f"{_SEED_PREFIX!r}, as `nsc` or `nk -gen user` write it)",
            field=NKEY,
        )


def _check_creds(path: Path) -> None:
    text = path.read_text()
    if not all(marker in text for marker in _CREDS_MARKERS):
        raise InvalidArgument(
            f"{CREDS}: {path} is not a NATS creds file (a user JWT and its nkey seed)",
            field=CREDS,
        )
