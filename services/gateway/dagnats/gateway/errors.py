"""Every error the gateway answers is JSON ``{"code": ..., "message": ...}``.

One table maps the domain errors of the services to HTTP statuses; a request
that fails validation is a 400 naming the field; anything unexpected is a 500
with no detail (it is logged), never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dagnats.core import errors

log = logging.getLogger("dagnats.gateway")

# Domain error -> HTTP status, looked up through the class hierarchy.
STATUS_OF: dict[type[errors.DagnatsError], int] = {
    errors.InvalidArgument: 400,
    errors.RecordTooLarge: 413,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.ReplayMismatch: 409,
    errors.BudgetExceeded: 409,
    errors.Unavailable: 503,
    errors.DeadlineExceeded: 504,
    # The engine refused the gateway's own credential (DAGNATS_GATEWAY_*_TOKEN):
    # not the caller's fault, so not a 401.
    errors.Unauthenticated: 502,
    errors.PermissionDenied: 403,
}

# What a 503 (a backend the gateway could not reach within its retry budget)
# tells a client to wait before it tries again.
RETRY_AFTER_SECONDS = 1

# Codes for the statuses the gateway answers itself.
_CODE_OF_STATUS = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_argument",
}


class ApiError(Exception):
    """An answer with a status and code of the gateway's own (not from a service)."""

    def __init__(self, status: int, code: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


def error_response(
    status: int, code: str, message: str, *, field: str | None = None, headers: Any = None
) -> JSONResponse:
    """The one shape of an error body."""
    body: dict[str, Any] = {"code": code, "message": message}
    if field:
        body["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


def status_of(err: errors.DagnatsError) -> int:
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return 500


def install_error_handlers(app: FastAPI) -> None:
    """Make every failure a JSON error."""

    async def on_domain_error(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, errors.DagnatsError)
        status = status_of(err)
        if status == 500:
            log.error("%s %s failed: %s", request.method, request.url.path, err)
            return error_response(500, "internal", "internal error")
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else None
        return error_response(status, err.code, err.message, field=err.field, headers=headers)

    async def on_api_error(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, ApiError)
        return error_response(err.status, err.code, err.message, field=err.field)

    async def on_validation_error(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, RequestValidationError)
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":  # the body as a whole, not a field "0"
            why = first.get("ctx", {}).get("error", "it does not parse")
            return error_response(
                400, "invalid_argument", f"the body is not JSON: {why}", field="body"
            )
        field = _field_name(first.get("loc", ()))
        message = str(first.get("msg", "invalid request"))
        return error_response(
            400, "invalid_argument", f"{field}: {message}" if field else message, field=field
        )

    async def on_http_error(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, HTTPException)
        code = _CODE_OF_STATUS.get(err.status_code, "error")
        return error_response(
            err.status_code, code, str(err.detail), headers=getattr(err, "headers", None)
        )

    async def on_unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal", "internal error")

    app.add_exception_handler(errors.DagnatsError, on_domain_error)
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def _field_name(loc: Any) -> str | None:
    # ("body", "request_id") -> "request_id"; ("query", "limit") -> "limit";
    # ("body",) for a body that is not JSON at all -> "body".
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    if parts:
        return ".".join(parts)
    return str(loc[0]) if loc else None
