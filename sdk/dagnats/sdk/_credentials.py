"""How a client or worker proves who it is to the engine, and checks the engine.

A ``Credentials`` names a bearer token (sent as ``authorization: Bearer ...``
metadata on every call, streams included) and TLS files: the CA that signed
the engine's certificate and, for mTLS, the client's own certificate and key.
Files are read when the connection is made ready, so a missing one is an
``InvalidArgument`` naming it, before any call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
import grpc.aio

from dagnats.core.credentials import check_bearer_token
from dagnats.core.errors import InvalidArgument
from dagnats.core.grpcutil import with_metadata
from dagnats.core.settings import env_bool

if TYPE_CHECKING:
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnary = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _StreamStream = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:  # the runtime classes are not generic
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor
    _StreamUnary = grpc.aio.StreamUnaryClientInterceptor
    _StreamStream = grpc.aio.StreamStreamClientInterceptor

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Credentials:
    """A bearer token and TLS settings for the engine's gRPC port.

    ``Credentials.from_env()`` reads them from the environment; ``Worker``,
    ``Client`` and ``JournalClient`` do so when given none.

    Attributes:
        token: Bearer token sent with every call (``DAGNATS_TOKEN``).
        ca: PEM file of the CA that signed the engine's certificate; connects
            with TLS (``DAGNATS_TLS_CA``).
        cert: PEM client certificate, for an engine that requires mTLS
            (``DAGNATS_TLS_CERT``).
        key: PEM private key of ``cert`` (``DAGNATS_TLS_KEY``).
        tls: Connect with TLS even without ``ca``, trusting the system's
            roots (``DAGNATS_TLS=1``).
    """

    token: str | None = field(default=None, repr=False)
    ca: PathLike | None = None
    cert: PathLike | None = None
    key: PathLike | None = None
    tls: bool = False

    @classmethod
    def from_env(cls) -> Credentials:
        """``DAGNATS_TOKEN``, ``DAGNATS_TLS_CA``, ``DAGNATS_TLS_CERT``,
        ``DAGNATS_TLS_KEY`` and ``DAGNATS_TLS``; empty values are unset."""
        return cls(
            token=os.environ.get("DAGNATS_TOKEN") or None,
            ca=os.environ.get("DAGNATS_TLS_CA") or None,
            cert=os.environ.get("DAGNATS_TLS_CERT") or None,
            key=os.environ.get("DAGNATS_TLS_KEY") or None,
            tls=env_bool("DAGNATS_TLS", False),
        )

    @property
    def secure(self) -> bool:
        """Whether the connection uses TLS."""
        return self.tls or self.ca is not None or self.cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a secure channel; None for plaintext.

        Raises:
            InvalidArgument: a certificate without its key (or the reverse), or
                a file that cannot be read, naming it.
        """
        if (self.cert is None) != (self.key is None):
            missing = "key" if self.key is None else "cert"
            raise InvalidArgument(
                "a client certificate needs its key, and a key its certificate "
                "(cert/DAGNATS_TLS_CERT and key/DAGNATS_TLS_KEY)",
                field=missing,
            )
        if not self.secure:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "ca"),
            private_key=_read(self.key, "key"),
            certificate_chain=_read(self.cert, "cert"),
        )

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Interceptors that put the token on every kind of call; none without one.

        Raises:
            InvalidArgument: a token with a space, a control character (a
                newline read with it) or a character that is not ASCII: the
                engine compares tokens exactly and would refuse it.
        """
        if not self.token:
            return []
        check_bearer_token(self.token, source="token (DAGNATS_TOKEN)")
        header = ("authorization", f"Bearer {self.token}")
        # One object per kind: grpc.aio files an interceptor under the first
        # kind it implements only (see dagnats.core.tracing).
        return [
            cast("grpc.aio.ClientInterceptor", kind(header))
            for kind in (_TokenUnaryUnary, _TokenUnaryStream, _TokenStreamUnary, _TokenStreamStream)
        ]


def _read(path: PathLike | None, name: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise InvalidArgument(
            f"cannot read the TLS {name} {path}: {err.strerror}", field=name
        ) from None


class _Token:
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return with_metadata(details, [self._header])


Continuation = Callable[[grpc.aio.ClientCallDetails, Any], Any]


class _TokenUnaryUnary(_Token, _UnaryUnary):
    async def intercept_unary_unary(
        self, continuation: Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(details), request)


class _TokenUnaryStream(_Token, _UnaryStream):
    async def intercept_unary_stream(
        self, continuation: Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(details), request)


class _TokenStreamUnary(_Token, _StreamUnary):
    async def intercept_stream_unary(
        self, continuation: Continuation, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


class _TokenStreamStream(_Token, _StreamStream):
    async def intercept_stream_stream(
        self, continuation: Continuation, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)
