"""Bearer tokens: one for the API (run control, inputs, the journal), one for
the worker bridge. A part with no token configured is open; the gateway then
only binds to loopback (see ``server.start_gateway``).

Both are declared as HTTP bearer schemes, so the OpenAPI document lists them
and marks every operation that needs one.

Towards the engine the gateway holds credentials of its own
(``GatewayConfig.client_credentials`` and ``worker_credentials``); a caller's
token is checked here and never forwarded.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from dagnats.core.credentials import bearer_token
from dagnats.gateway.errors import ApiError

_API = HTTPBearer(
    scheme_name="api_token",
    description="`DAGNATS_API_TOKEN`: run control, inputs, the journal and this document",
    auto_error=False,
)
_BRIDGE = HTTPBearer(
    scheme_name="bridge_token",
    description="`DAGNATS_BRIDGE_TOKEN`: the worker bridge",
    auto_error=False,
)


def check_bearer(request: Request, token: str | None) -> None:
    """Pass when ``token`` is None or the request's bearer token is exactly it.

    The token is read from the ``authorization`` header itself, as sent:
    the security scheme's parsing takes whitespace off it.

    Raises:
        ApiError: 401 ``unauthenticated`` for a missing or wrong token.
    """
    if token is None:
        return
    presented = bearer_token(request.headers.get("authorization", ""))
    if not hmac.compare_digest(presented.encode(), token.encode()):
        raise ApiError(401, "unauthenticated", "a valid bearer token is required")


# The schemes are dependencies so that the OpenAPI document declares them.
def api_auth(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_API)]
) -> None:
    """FastAPI dependency of every API route."""
    check_bearer(request, request.app.state.config.api_token)


def bridge_auth(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_BRIDGE)]
) -> None:
    """FastAPI dependency of every bridge route."""
    check_bearer(request, request.app.state.config.bridge_token)
