"""How the gateway is configured: flags and ``DAGNATS_*`` environment variables."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dagnats.core.credentials import check_bearer_token
from dagnats.core.errors import InvalidArgument
from dagnats.core.settings import env_file, env_seconds
from dagnats.sdk import Credentials

# Defaults a user can rely on; each is documented in the settings reference
# (generated from dagnats.core.catalogue) and docs/how-to/http-api.md.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
# The largest request body accepted, in bytes: an input's content is capped
# lower by the inputs service, a workflow document is small.
DEFAULT_MAX_BODY = 1 << 20
# How long one request rides out an unreachable engine (a restart, an
# election) before it answers 503: shorter than an HTTP client's patience,
# longer than a restart.
DEFAULT_RETRY_FOR = 10.0
# How long an idle kept-alive connection stays open. Longer than the time
# clients keep an idle connection for reuse (httpx 5 s, Node's fetch 4 s,
# aiohttp 15 s, Go 90 s, curl 118 s), so the client gives a connection up
# before the gateway closes it: a request sent as the gateway closes would be
# lost.
DEFAULT_KEEP_ALIVE = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """Settings of one gateway.

    Attributes:
        engine_target: gRPC address of the engine (which also serves the
            journal and inputs services, unless they have addresses of their own).
        journal_target: gRPC address of the journal service when it runs
            apart from the engine (``dagnats serve journal``); None: the engine's.
        inputs_target: gRPC address of the inputs service, likewise.
        host: Address to bind. Without ``api_token`` it must be a loopback address.
        port: Port to bind; 0 picks a free one.
        api_token: Bearer token for run control, inputs and the journal; None
            leaves the API open (loopback only).
        bridge_token: Bearer token for the worker bridge; None leaves it open
            (loopback only).
        max_body_bytes: Largest request body accepted.
        rpc_timeout: Deadline of one backend call, in seconds.
        retry_for: Seconds a request keeps retrying a backend it cannot reach
            before it answers 503 (``DAGNATS_GATEWAY_RETRY_FOR``).
        keep_alive: Seconds an idle kept-alive connection stays open
            (``DAGNATS_GATEWAY_KEEP_ALIVE``): longer than clients keep one.
        client_credentials: How the REST API reaches the engine: a token with
            the client role (admin, to register workflows and purge runs
            through it) and TLS files. The worker bridge reads journals with
            it too (``/bridge/read``: reading is a client's call).
        worker_credentials: How the worker bridge reaches the engine: a token
            with the worker role and TLS files.
        tls_cert: PEM certificate chain the gateway serves HTTPS with
            (``DAGNATS_GATEWAY_TLS_CERT``); None serves plain HTTP.
        tls_key: Its private key (``DAGNATS_GATEWAY_TLS_KEY``).
    """

    engine_target: str
    journal_target: str | None = None
    inputs_target: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_token: str | None = None
    bridge_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    rpc_timeout: float = 10.0
    retry_for: float = DEFAULT_RETRY_FOR
    keep_alive: float = DEFAULT_KEEP_ALIVE
    client_credentials: Credentials = field(default_factory=Credentials)
    worker_credentials: Credentials = field(default_factory=Credentials)
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = (
                "DAGNATS_GATEWAY_TLS_KEY" if self.tls_key is None else "DAGNATS_GATEWAY_TLS_CERT"
            )
            raise InvalidArgument(
                "DAGNATS_GATEWAY_TLS_CERT and DAGNATS_GATEWAY_TLS_KEY go together: set both",
                field=missing,
            )
        if not (math.isfinite(self.keep_alive) and self.keep_alive > 0):
            raise InvalidArgument(
                f"keep_alive must be a positive number of seconds, got {self.keep_alive}",
                field="keep_alive",
            )

    @classmethod
    def from_env(
        cls,
        engine_target: str,
        *,
        host: str,
        port: int,
        journal_target: str | None = None,
        inputs_target: str | None = None,
    ) -> GatewayConfig:
        """Tokens from ``DAGNATS_API_TOKEN`` and ``DAGNATS_BRIDGE_TOKEN`` (empty is
        unset), the retry budget from ``DAGNATS_GATEWAY_RETRY_FOR``, the idle
        connections' life from ``DAGNATS_GATEWAY_KEEP_ALIVE``; towards the
        engine, TLS from ``DAGNATS_TLS_*`` and the tokens
        ``DAGNATS_GATEWAY_CLIENT_TOKEN`` (REST API) and
        ``DAGNATS_GATEWAY_WORKER_TOKEN`` (worker bridge); HTTPS from
        ``DAGNATS_GATEWAY_TLS_CERT`` and ``DAGNATS_GATEWAY_TLS_KEY``."""
        tls = Credentials.from_env()

        def with_token(var: str) -> Credentials:
            token = _token(var)
            return Credentials(token=token, ca=tls.ca, cert=tls.cert, key=tls.key, tls=tls.tls)

        return cls(
            engine_target=engine_target,
            journal_target=journal_target,
            inputs_target=inputs_target,
            host=host,
            port=port,
            api_token=_token("DAGNATS_API_TOKEN"),
            bridge_token=_token("DAGNATS_BRIDGE_TOKEN"),
            retry_for=env_seconds("DAGNATS_GATEWAY_RETRY_FOR", DEFAULT_RETRY_FOR),
            keep_alive=env_seconds("DAGNATS_GATEWAY_KEEP_ALIVE", DEFAULT_KEEP_ALIVE),
            client_credentials=with_token("DAGNATS_GATEWAY_CLIENT_TOKEN"),
            worker_credentials=with_token("DAGNATS_GATEWAY_WORKER_TOKEN"),
            tls_cert=env_file("DAGNATS_GATEWAY_TLS_CERT"),
            tls_key=env_file("DAGNATS_GATEWAY_TLS_KEY"),
        )

    @property
    def open_endpoints(self) -> list[str]:
        """Which parts of the API take requests without a token."""
        parts = []
        if self.api_token is None:
            parts.append("the API")
        if self.bridge_token is None:
            parts.append("the worker bridge")
        return parts


def _token(var: str) -> str | None:
    """A bearer token from ``var``; None when unset or empty.

    Raises:
        InvalidArgument: it is not a token (a newline left in it), naming ``var``.
    """
    token = os.environ.get(var) or None
    return None if token is None else check_bearer_token(token, source=var)
