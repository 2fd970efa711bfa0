"""Bearer tokens: one for the API (run control, inputs, the journal), one for
the worker bridge. A part with no token configured is open; the gateway then
only binds to loopback (see ``server.start_gateway``)."""

from __future__ import annotations

import hmac

from fastapi import Request

from dagnats.gateway.errors import ApiError


def check_bearer(request: Request, token: str | None) -> None:
    """Pass when ``token`` is None or the request carries it.

    Raises:
        ApiError: 401 ``unauthenticated`` for a missing or wrong token.
    """
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise ApiError(401, "unauthenticated", "a valid bearer token is required")


def api_auth(request: Request) -> None:
    """FastAPI dependency of every API route."""
    check_bearer(request, request.app.state.config.api_token)


def bridge_auth(request: Request) -> None:
    """FastAPI dependency of every bridge route."""
    check_bearer(request, request.app.state.config.bridge_token)
