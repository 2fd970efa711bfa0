"""The ASGI application: routers, error handlers, body limit, metrics.

Every body the gateway takes is JSON, so a body sent without a JSON content
type (``curl -d``, which says ``application/x-www-form-urlencoded``) is read as
JSON all the same. The OpenAPI document and its browser view need the API
token, like everything but health, readiness and metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dagnats.gateway import bridge, console, journal_stream, live_stream, metrics, rest
from dagnats.gateway.auth import api_auth
from dagnats.gateway.backend import Backend
from dagnats.gateway.config import GatewayConfig
from dagnats.gateway.errors import error_response, install_error_handlers

DESCRIPTION = """\
The dagnats HTTP API: workflows, runs, inputs that steer a running agent, and
the per-step journal as a JSON page or a live stream of server-sent events.
The worker bridge under `/bridge` lets a worker in any language poll tasks and
use the journal with the same fencing as the Python SDK.

Every error is JSON `{"code": ..., "message": ...}`; a validation error also
names the `field`. Send `Authorization: Bearer <token>` when the gateway is
configured with tokens; the API's token is needed for this document too.
"""

# The OpenAPI document and its browser view, behind the API token.
docs = APIRouter(dependencies=[Depends(api_auth)], include_in_schema=False)


@docs.get("/openapi.json")
async def openapi_document(request: Request) -> JSONResponse:
    document: dict[str, Any] = request.app.openapi()
    return JSONResponse(document)


@docs.get("/docs")
async def openapi_view(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="dagnats API")


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway for ``config``; its backend connects on startup."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.backend = Backend.connect(config)
        app.state.hubs = live_stream.Hubs()
        app.state.follows = journal_stream.Follows()
        try:
            yield
        finally:
            app.state.hubs.close()
            await app.state.backend.close()

    app = FastAPI(
        title="dagnats",
        version="1",
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_url=None,  # served by `docs`, behind the token
        docs_url=None,
        redoc_url=None,
    )
    app.state.config = config
    app.state.metrics = metrics.Metrics()
    install_error_handlers(app)
    app.include_router(metrics.router)
    app.include_router(docs)
    app.include_router(rest.router)
    app.include_router(bridge.router)
    app.include_router(console.router)
    # Added last is outermost: the body limit sees the request before anything
    # reads it, and the body is declared JSON before a route parses it.
    app.add_middleware(JsonBodies)
    app.add_middleware(metrics.MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


class JsonBodies:
    """Declares every request body JSON unless it says so already: the only
    kind of body the gateway takes. ``curl -d`` sends JSON labelled as a form."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _declares_json(scope["headers"]):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            # In place: the router writes the matched route into this scope,
            # and the metrics middleware outside reads it from there.
            scope["headers"] = [*headers, (b"content-type", b"application/json")]
        await self.app(scope, receive, send)


def _declares_json(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or kind.endswith(b"+json")
    return False


class BodyLimit:
    """Answers 413 to a request body larger than ``max_bytes``, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, "too_large", f"the request body is larger than {self.max_bytes} bytes"
        )
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass
