"""The one table between domain errors and gRPC status codes.

Servicers wrap their methods with :func:`domain_errors`, which turns a raised
:class:`~dagnats.core.errors.DagnatsError` (or ``Fenced``) into a status with
the error's code, field and typed fields in trailing metadata
(``dagnats-error-code``, ``dagnats-error-field``, ``dagnats-error-<name>``:
a fenced write's ``expected`` and ``actual`` sequences, its ``run-id`` and
``step-id``). The journal's Session stream answers a call with the same in a
``SessionError`` (:func:`wire_status`, :func:`wire_details`). Clients turn
either back into the very error the service raised, typed fields included,
with :func:`error_from_rpc` and :func:`error_from_status`, and nothing else
looks at status codes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

import grpc

from dagnats.core import deadline, errors

log = logging.getLogger(__name__)

# What a status carries: a domain error, a fenced write, or a cancelled run's.
WireError = errors.DagnatsError | errors.Fenced | errors.RunCancelled

# Domain error -> status code, both ways.
STATUS_OF: dict[type[WireError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.RecordTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.StateTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Fenced: grpc.StatusCode.ABORTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.ReplayMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.BudgetExceeded: grpc.StatusCode.FAILED_PRECONDITION,
    # Not UNAVAILABLE: clients retry that, and no retry creates a stream.
    errors.NotProvisioned: grpc.StatusCode.FAILED_PRECONDITION,
    errors.RunCancelled: grpc.StatusCode.FAILED_PRECONDITION,
}

# The error code carried in trailing metadata -> class, for the way back.
_CLASS_OF_CODE: dict[str, type[WireError]] = {c.code: c for c in STATUS_OF}
# Status codes that mean "the transport failed, try again". CANCELLED is one: a
# caller's own cancel raises asyncio.CancelledError, never a status, so a call
# that ends CANCELLED was cancelled by the server, which a stopping gRPC server
# does to the calls it accepted but had not begun. RESOURCE_EXHAUSTED is not
# one: a message over a size limit is as large on every try.
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# Domain errors a client may retry (with DEADLINE_EXCEEDED, only where repeating
# is safe); every other dagnats error code answers the request for good.
_RETRIABLE_ERRORS = frozenset({errors.Unavailable.code, errors.DeadlineExceeded.code})

CODE_KEY = "dagnats-error-code"
FIELD_KEY = "dagnats-error-field"
# Each typed field of an error rides in a trailer of its own, named after it.
DETAIL_PREFIX = "dagnats-error-"


def with_metadata(
    details: grpc.aio.ClientCallDetails, items: Iterable[tuple[str, str]]
) -> grpc.aio.ClientCallDetails:
    """``details`` of a client call with ``items`` set in its metadata (for
    client interceptors: trace context, a bearer token)."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in items:
        metadata[key] = value
    return grpc.aio.ClientCallDetails(
        method=details.method,
        timeout=details.timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


def status_of(err: WireError) -> grpc.StatusCode:
    """The status code for ``err``, found through its class hierarchy."""
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
Context = grpc.aio.ServicerContext[Any, Any]


def domain_errors(method: F) -> F:
    """Decorate an async servicer method so domain errors become statuses, and
    so does a NATS request that went unanswered (see ``transient_nats``)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Context) -> Any:
        try:
            with deadline.serving(context.time_remaining()):
                return await method(self, request, context)
        except (Exception, errors.Fenced, errors.RunCancelled) as err:
            if (domain := as_domain_error(err)) is None:
                raise
            await abort_with(context, domain)

    return wrapper  # type: ignore[return-value]


def as_domain_error(err: BaseException) -> WireError | None:
    """The domain error a client should see for ``err``, raised while serving a
    request: a domain error as it is; NATS that did not answer (a stream
    electing its leader, a server restarting) or any timeout as a retriable
    error (see ``transient_nats``); None for anything else, a server error.

    Used by unary methods (:func:`domain_errors`) and by the journal's Session
    stream, so both answer the same failure with the same status.
    """
    if isinstance(err, errors.DagnatsError | errors.Fenced | errors.RunCancelled):
        return err
    return transient_nats(err) if isinstance(err, Exception) else None


def transient_nats(err: Exception) -> errors.Unavailable | errors.DeadlineExceeded | None:
    """``err`` as the error a client should see when NATS did not answer in
    time; None for anything else, which stays a server error.

    A request that found no responder, or a stream electing its leader, was not
    applied: ``Unavailable``, which every caller retries. One that timed out
    (nats-py's timeout is a ``TimeoutError``, as is every asyncio timeout) may
    have been: ``DeadlineExceeded``, which callers retry only where repeating
    is safe.
    """
    if isinstance(err, TimeoutError):
        return errors.DeadlineExceeded("NATS did not answer in time; the outcome is unknown")
    # Imported here: servers call this, and the SDK, which imports this module
    # too, does not depend on nats-py.
    from dagnats.core.jetstream import is_transient

    if is_transient(err):
        return errors.Unavailable(f"NATS is unavailable ({type(err).__name__}); try again")
    return None


def retriable(status: grpc.StatusCode, code: str, *, idempotent: bool) -> bool:
    """Whether a call that failed with ``status`` (and the dagnats error ``code``
    in its trailers, empty when there is none) may be sent again: the transport
    failed, or the service said it could not reach its backend. A timeout is
    retriable only for a call that is safe to repeat, since the first try may
    have been applied."""
    if code and code not in _RETRIABLE_ERRORS:
        return False
    if status in TRANSIENT_CODES:
        return True
    return idempotent and status == grpc.StatusCode.DEADLINE_EXCEEDED


def error_code(err: grpc.aio.AioRpcError) -> str:
    """The dagnats error code in a failed call's trailers; empty when there is none."""
    pairs = cast(Iterable[tuple[str, Any]], err.trailing_metadata() or ())
    code = dict(pairs).get(CODE_KEY)
    return str(code) if code else ""


async def abort_with(context: Context, err: WireError) -> None:
    """End the call with the status of ``err``, its code, field and typed
    fields in trailing metadata."""
    status, message, _ = wire_status(err)
    context.set_trailing_metadata(trailers(err))
    await context.abort(status, message)


def trailers(err: WireError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries ``err``: its code, its field and
    each typed field (``dagnats-error-expected: 12``)."""
    _, _, field = wire_status(err)
    metadata: list[tuple[str, str]] = [(CODE_KEY, err.code)]
    if field:
        metadata.append((FIELD_KEY, field))
    for name, value in wire_details(err).items():
        metadata.append((DETAIL_PREFIX + name.replace("_", "-"), value))
    return tuple(metadata)


def wire_details(err: WireError) -> dict[str, str]:
    """The typed fields of ``err`` as the wire carries them: printable ASCII."""
    return {k: v.encode("unicode_escape").decode("ascii") for k, v in err.details().items()}


def wire_status(err: WireError) -> tuple[grpc.StatusCode, str, str]:
    """The status code, message and field that carry ``err`` to a client."""
    # Messages and fields may quote a request (an unknown field's name): the
    # status message must be valid UTF-8 and metadata values printable ASCII, or gRPC
    # fails to send the status at all and the caller waits out its deadline.
    field = err.field.encode("unicode_escape").decode("ascii") if err.field else ""
    return status_of(err), err.message.encode("utf-8", "backslashreplace").decode(), field


def error_from_rpc(err: grpc.aio.AioRpcError) -> WireError:
    """Turn a failed call back into the domain error the server raised."""
    # grpc.aio yields (key, value) pairs; the stubs describe the sync API's objects.
    pairs = cast(Iterable[tuple[str, Any]], err.trailing_metadata() or ())
    trailing = {str(k): str(v) for k, v in pairs}
    code, field = trailing.pop(CODE_KEY, ""), trailing.pop(FIELD_KEY, "")
    details = {
        k.removeprefix(DETAIL_PREFIX).replace("-", "_"): v
        for k, v in trailing.items()
        if k.startswith(DETAIL_PREFIX)
    }
    return error_from_status(err.code(), err.details() or "", code, field, details)


def error_from_status(
    status: grpc.StatusCode,
    message: str,
    code: str,
    field: str,
    details: Mapping[str, str] | None = None,
) -> WireError:
    """The domain error named by ``code`` (or, without one, by ``status``),
    with the typed fields ``details`` carried."""
    cls = _CLASS_OF_CODE.get(code) if code else None
    if cls is None:
        cls = _class_for_status(status)
    return cls.from_wire(message or status.name.lower(), field or None, details or {})


def status_code(value: int) -> grpc.StatusCode:
    """The status code whose number is ``value`` (UNKNOWN for none)."""
    return _STATUS_BY_NUMBER.get(value, grpc.StatusCode.UNKNOWN)


_STATUS_BY_NUMBER = {s.value[0]: s for s in grpc.StatusCode}


def _class_for_status(status: grpc.StatusCode) -> type[WireError]:
    for cls, code in STATUS_OF.items():
        if code == status and cls.__module__ == errors.__name__:
            return cls
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded
    return errors.DagnatsError
