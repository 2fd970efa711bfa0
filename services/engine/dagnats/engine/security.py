"""TLS and authentication on the engine's gRPC port.

The rules (which method needs which role, which credential carries which
role) are in ``dagnats.engine.access``; this module reads the settings,
builds the server's TLS credentials, and checks every call with an
interceptor that hands the call's credentials to those rules:

- a bearer token in the ``authorization`` metadata (``Bearer <token>``);
- under mTLS, the client certificate's subject common name and subject
  alternative names, mapped to roles by ``DAGNATS_GRPC_CERT_ROLES``.

A refused call ends with ``UNAUTHENTICATED`` or ``PERMISSION_DENIED`` and the
error trailers of ``grpcutil``. Tokens are never logged. A tokens file is
read again whenever it changes, so a token is revoked by removing its line;
the TLS files are read again when they change, so a certificate is rotated
without a restart.
"""

from __future__ import annotations

import inspect
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from dagnats.core import errors
from dagnats.core.credentials import bearer_token
from dagnats.core.grpcutil import abort_with
from dagnats.engine.access import (
    HEALTH_PREFIX,
    Decision,
    IdentityMap,
    Role,
    TokenTable,
    decide,
    method_name,
    parse_identities,
    parse_tokens,
    redacted_for,
    tokens_of,
)
from dagnats.inputs.v1 import inputs_pb2 as inputs_pb

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the runtime classes are not generic
    _Interceptor = grpc.aio.ServerInterceptor
    _Handler = grpc.RpcMethodHandler

Context = grpc.aio.ServicerContext[Any, Any]

_ROLE_TOKEN_VARS = {
    Role.WORKER: "DAGNATS_GRPC_WORKER_TOKENS",
    Role.CLIENT: "DAGNATS_GRPC_CLIENT_TOKENS",
    Role.ADMIN: "DAGNATS_GRPC_ADMIN_TOKENS",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSecurity:
    """TLS and credentials of one gRPC server.

    Attributes:
        tls_cert: PEM certificate chain of the server (``DAGNATS_GRPC_TLS_CERT``).
        tls_key: PEM private key of the server (``DAGNATS_GRPC_TLS_KEY``).
        client_ca: PEM CA bundle; when set, every client must present a
            certificate it signed (mTLS, ``DAGNATS_GRPC_CLIENT_CA``).
        tokens: Bearer tokens valid for the server's lifetime
            (``DAGNATS_GRPC_WORKER_TOKENS`` and the client and admin ones,
            comma-separated).
        tokens_file: Lines ``<role> <token>``, read again when the file
            changes (``DAGNATS_GRPC_TOKENS_FILE``).
        identities: Client-certificate names and their roles
            (``DAGNATS_GRPC_CERT_ROLES``: ``name=role,...``).
    """

    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    tokens: TokenTable = field(default_factory=TokenTable)
    tokens_file: Path | None = None
    identities: IdentityMap = field(default_factory=IdentityMap)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def authenticated(self) -> bool:
        """Whether calls need a credential at all."""
        by_cert = self.client_ca is not None and bool(self.identities.roles)
        return bool(self.tokens) or self.tokens_file is not None or by_cert

    @classmethod
    def from_env(cls) -> ServerSecurity:
        """The settings from ``DAGNATS_GRPC_*`` (empty values are unset).

        Raises:
            InvalidArgument: a certificate without its key (or the reverse), a
                client CA without TLS, or a malformed ``DAGNATS_GRPC_CERT_ROLES``.
        """
        tokens = TokenTable()
        for role, var in _ROLE_TOKEN_VARS.items():
            values = os.environ.get(var, "").split(",")
            tokens = tokens.merged(tokens_of(role, values, source=var))
        roles = os.environ.get("DAGNATS_GRPC_CERT_ROLES", "")
        security = cls(
            tls_cert=_path("DAGNATS_GRPC_TLS_CERT"),
            tls_key=_path("DAGNATS_GRPC_TLS_KEY"),
            client_ca=_path("DAGNATS_GRPC_CLIENT_CA"),
            tokens=tokens,
            tokens_file=_path("DAGNATS_GRPC_TOKENS_FILE"),
            identities=parse_identities(roles, source="DAGNATS_GRPC_CERT_ROLES"),
        )
        security.check()
        return security

    def check(self) -> None:
        """Raise ``InvalidArgument`` for settings that do not fit together."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise errors.InvalidArgument(
                "DAGNATS_GRPC_TLS_CERT and DAGNATS_GRPC_TLS_KEY go together: set both",
                field="DAGNATS_GRPC_TLS_KEY" if self.tls_key is None else "DAGNATS_GRPC_TLS_CERT",
            )
        if self.client_ca is not None and self.tls_cert is None:
            raise errors.InvalidArgument(
                "DAGNATS_GRPC_CLIENT_CA needs TLS: set DAGNATS_GRPC_TLS_CERT and _KEY",
                field="DAGNATS_GRPC_CLIENT_CA",
            )
        if self.identities.roles and self.client_ca is None:
            raise errors.InvalidArgument(
                "DAGNATS_GRPC_CERT_ROLES needs client certificates: set DAGNATS_GRPC_CLIENT_CA",
                field="DAGNATS_GRPC_CERT_ROLES",
            )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for ``add_secure_port``; None without TLS. The files
        are read now, and again when they change (``CertificateFiles``).

        Raises:
            InvalidArgument: a file that cannot be read or a certificate that
                does not match its key, naming it.
        """
        if self.tls_cert is None or self.tls_key is None:
            return None
        files = CertificateFiles(self.tls_cert, self.tls_key, self.client_ca)
        return grpc.dynamic_ssl_server_credentials(
            files.initial,
            files.fetch,  # type: ignore[arg-type]  # None means "no change" to gRPC
            require_client_authentication=self.client_ca is not None,
        )

    def admission(self, method: str) -> Callable[[str], errors.DagnatsError | None]:
        """The check of a bearer token that arrives without gRPC (a session
        socket's hello) for a call of ``method``: None admits it, else
        the refusal. An empty token is none; there is no client certificate."""
        if not self.authenticated:
            return lambda token: None
        tokens = TokenSource.open(self.tokens, self.tokens_file)
        return lambda token: refusal(method, token or None, tokens, None)[0]

    def interceptor(self) -> grpc.aio.ServerInterceptor[Any, Any] | None:
        """The interceptor that checks every call; None when calls need no credential."""
        if not self.authenticated:
            return None
        return AuthInterceptor(TokenSource.open(self.tokens, self.tokens_file), self.identities)


class TokenSource:
    """The valid tokens: fixed ones and a file's, read again when it changes
    (its inode, size or modification time).

    A file that has become unreadable or malformed refuses its tokens (and
    logs why, never a token) until it is fixed: failing open would turn a bad
    edit into a way in. Replace the file by renaming a new one over it, so no
    call reads half a file.
    """

    def __init__(self, fixed: TokenTable, path: Path | None) -> None:
        self._fixed = fixed
        self._path = path
        self._seen: tuple[int, int, int] | None = None
        self._table = fixed
        self._broken = False

    @classmethod
    def open(cls, fixed: TokenTable, path: Path | None) -> TokenSource:
        """A source whose file is read now.

        Raises:
            InvalidArgument: the file cannot be read or does not parse.
        """
        source = cls(fixed, path)
        if path is not None:
            text = _read(path, "DAGNATS_GRPC_TOKENS_FILE").decode("utf-8", "replace")
            parse_tokens(text, source=str(path))
            source.current()
        return source

    def current(self) -> TokenTable:
        """The tokens valid now."""
        if self._path is None:
            return self._fixed
        try:
            st = self._path.stat()
        except OSError as err:
            self._seen = None
            return self._refuse(err)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._seen:
            return self._table
        self._seen = stamp
        try:
            table = parse_tokens(self._path.read_text(), source=str(self._path))
        except (OSError, UnicodeDecodeError, errors.InvalidArgument) as err:
            return self._refuse(err)
        self._table, self._broken = self._fixed.merged(table), False
        log.info("read %d tokens from %s", len(table), self._path)
        return self._table

    def _refuse(self, err: Exception) -> TokenTable:
        if not self._broken:
            log.error("tokens file %s refused until fixed: %s", self._path, _why(err))
        self._table, self._broken = self._fixed, True
        return self._table


class AuthInterceptor(_Interceptor):
    """Checks the credential of every call but health checking's."""

    def __init__(self, tokens: TokenSource, identities: IdentityMap) -> None:
        self._tokens = tokens
        self._identities = identities

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        token = _bearer(handler_call_details.invocation_metadata)

        async def check(context: Context) -> Answer:
            refusal, roles = self._refusal(method, token, context)
            if refusal is not None:
                await abort_with(context, refusal)
            redact = _REDACTIONS.get(method)
            return redact if redact is not None and redacted_for(method, roles) else _as_is

        return _guarded(handler, check)

    def _refusal(
        self, method: str, token: str | None, context: Context
    ) -> tuple[errors.DagnatsError | None, frozenset[Role]]:
        by_cert = (
            self._identities.roles_of(_peer_names(context)) if self._identities.roles else None
        )
        return refusal(method, token, self._tokens, by_cert)


def refusal(
    method: str, token: str | None, tokens: TokenSource, by_cert: Iterable[Role] | None
) -> tuple[errors.DagnatsError | None, frozenset[Role]]:
    """Whether a call of ``method`` with ``token`` (None: no token) and the
    roles its client certificate gives (None: none) is refused, and the roles
    it holds."""
    roles: set[Role] = set()
    if token is not None:
        by_token = tokens.current().roles_of(token)
        if by_token is None:  # a wrong or revoked token is refused, certificate or not
            return errors.Unauthenticated("the bearer token is not valid"), frozenset()
        roles |= by_token
    roles |= set(by_cert or ())
    held = frozenset(roles)
    decision = decide(method, held or None)
    if decision is Decision.UNAUTHENTICATED:
        return errors.Unauthenticated(
            f"{method_name(method)} needs a credential: a bearer token "
            "(authorization: Bearer ...) or a client certificate with a role"
        ), held
    if decision is Decision.PERMISSION_DENIED:
        names = ", ".join(sorted(roles))
        return errors.PermissionDenied(
            f"{method_name(method)} is not allowed for the role {names}"
        ), held
    return None, held


# What a call's answer becomes for its caller: itself, or without what only a
# client may read (``access.redacted_for``).
Answer = Callable[[Any], Any]
Check = Callable[[Context], Awaitable[Answer]]


def _as_is(response: Any) -> Any:
    return response


def _without_content(response: inputs_pb.ListResponse) -> inputs_pb.ListResponse:
    for item in response.inputs:
        item.ClearField("content")
    return response


_REDACTIONS: dict[str, Answer] = {"/dagnats.inputs.v1.InputsService/List": _without_content}


def _guarded(handler: _Handler, check: Check) -> _Handler:
    """``handler`` with ``check`` awaited before its behaviour, for each of
    the four kinds of call. The services' behaviours are all async."""
    serde = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, check), **serde)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, check), **serde)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, check), **serde)
    return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, check), **serde)


def _wrap(behaviour: Any, check: Check) -> Any:
    if inspect.isasyncgenfunction(behaviour):

        async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
            await check(context)
            async for response in behaviour(request, context):
                yield response

        return streaming
    if not inspect.iscoroutinefunction(behaviour):
        # A sync behaviour would run in grpc's thread pool; none of ours is one.
        raise TypeError(f"{behaviour!r} is not async: it cannot be guarded")

    async def call(request: Any, context: Context) -> Any:
        answer = await check(context)
        return answer(await behaviour(request, context))

    return call


def _bearer(metadata: Any) -> str | None:
    """The call's bearer token exactly as sent; ``""`` for a credential that
    is not a valid one (another scheme, a control character anywhere, a value
    that is not UTF-8); None without an ``authorization`` entry."""
    for key, value in metadata or ():
        if key == "authorization":
            return bearer_token(value) if isinstance(value, str) else ""
    return None


def _peer_names(context: Context) -> list[str]:
    auth = context.auth_context()
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


class CertificateFiles:
    """The server's certificate chain, key and client CA, read again when one
    of the files changes, so a certificate is rotated without a restart.

    gRPC asks ``fetch`` before each new connection's handshake; connections
    open keep the certificate they started with. A change is taken only once
    the chain and key match and the CA parses, so a rotation caught half
    written is taken on a later connection, and a broken one is logged and
    the current certificate kept.
    """

    def __init__(self, cert: Path, key: Path, ca: Path | None) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self._stamp = self._stamps()
        self.initial = self._configuration()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration if the files changed and are sound, else None."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        try:
            configuration = self._configuration()
        except errors.InvalidArgument as err:
            log.warning("TLS files changed but cannot be used; keeping the current: %s", err)
            self._stamp = stamp  # warned once per change
            return None
        if self._stamps() != stamp:
            return None  # still being written: taken on a later connection
        self._stamp = stamp
        log.info("TLS certificate read again from %s", self.cert)
        return configuration

    def _stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        return tuple(_stamp(p) for p in (self.cert, self.key, self.ca) if p is not None)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        key = _read(self.key, "DAGNATS_GRPC_TLS_KEY")
        chain = _read(self.cert, "DAGNATS_GRPC_TLS_CERT")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as err:
            why = getattr(err, "reason", None) or err.strerror or type(err).__name__
            raise errors.InvalidArgument(
                f"DAGNATS_GRPC_TLS_CERT and _KEY: {self.cert} and {self.key} are not a "
                f"certificate and its key ({why})",
                field="DAGNATS_GRPC_TLS_CERT",
            ) from None
        ca = None if self.ca is None else _read(self.ca, "DAGNATS_GRPC_CLIENT_CA")
        if ca is not None:
            try:
                ssl.create_default_context().load_verify_locations(cadata=ca.decode())
            except (ssl.SSLError, ValueError, UnicodeDecodeError):
                raise errors.InvalidArgument(
                    f"DAGNATS_GRPC_CLIENT_CA: {self.ca} holds no PEM certificate",
                    field="DAGNATS_GRPC_CLIENT_CA",
                ) from None
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _path(var: str) -> Path | None:
    value = os.environ.get(var, "").strip()
    return Path(value) if value else None


def _read(path: Path, var: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise errors.InvalidArgument(
            f"{var}: cannot read {path}: {err.strerror}", field=var
        ) from None


def _why(err: Exception) -> str:
    if isinstance(err, OSError):
        return err.strerror or type(err).__name__
    if isinstance(err, errors.InvalidArgument):
        return err.message
    return "it is not UTF-8 text"
