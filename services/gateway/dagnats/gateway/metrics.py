"""Prometheus metrics, health and readiness.

Each application has its own registry, so that several gateways in one
process (as in tests) do not share counters. Requests are counted by route
template (``/runs/{run_id}``), never by raw path, so ids do not explode the
label space.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dagnats.core.errors import DagnatsError
from dagnats.gateway.backend import BackendDep
from dagnats.gateway.errors import error_response


class Metrics:
    """The gateway's metrics in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dagnats_http_requests",
            "HTTP requests answered, by route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dagnats_http_request_seconds",
            "Time to the response's first byte, by route.",
            ["method", "route"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "dagnats_http_journal_streams",
            "Journal event streams open now.",
            registry=self.registry,
        )


class MetricsMiddleware:
    """Counts every HTTP request by its route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.metrics.latency.labels(scope["method"], _route(scope)).observe(
                    time.perf_counter() - started
                )
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(scope["method"], _route(scope), str(status)).inc()


def _route(scope: Scope) -> str:
    route: Any = scope.get("route")
    return str(getattr(route, "path", "unmatched"))


router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness: the gateway process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: the engine answers",
    responses={503: {"description": "the engine cannot be reached"}},
)
async def readyz(b: BackendDep) -> Response:
    try:
        await b.client.list_workflows()
    except DagnatsError as err:
        return error_response(503, "unavailable", f"engine not ready: {err.message}")
    return JSONResponse({"status": "ready"})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
