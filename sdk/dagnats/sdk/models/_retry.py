"""Retries of a model request: by time within a budget, honouring the
provider's ``retry-after``.

The provider SDKs' own retries are off (``max_retries=0``): they count tries,
and a count says nothing about how long a handler waits. Here a request that
failed with 408, 409, 429, a 5xx, a timeout or a broken connection is sent
again until ``RetryPolicy.budget`` seconds have passed since the first try:
after the provider's ``retry-after`` (or ``retry-after-ms``) when it says one,
else after a capped, jittered exponential backoff. A wait that would end past
the budget is not started: the call fails at once with ``ModelError``.

A streamed request is retried only until its first token: after that readers
have seen a preview the retry would repeat, so the failure ends the model call
(which records nothing) and the step's own retry policy takes over.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from dagnats.core.errors import DagnatsError, InvalidArgument
from dagnats.sdk._errors import PermanentError

log = logging.getLogger("dagnats.sdk.models")

T = TypeVar("T")

RETRIED_STATUS = frozenset({408, 409, 429})  # and every 5xx


class ModelError(DagnatsError):
    """A model request failed: retried for the policy's budget, or refused.

    Attributes:
        provider: ``openai`` or ``anthropic``.
        status: The HTTP status of the last answer; None for a timeout or a
            broken connection.
        tries: Requests sent.
    """

    code = "model_error"

    def __init__(self, message: str, *, provider: str, status: int | None, tries: int) -> None:
        super().__init__(message)
        self.provider = provider
        self.status = status
        self.tries = tries


class ModelRejected(ModelError, PermanentError):
    """The provider refused the request (400, 401, 403, 404, 422, ...):
    sending it again cannot help, so the step fails without a retry."""

    def __init__(self, message: str, *, provider: str, status: int | None, tries: int) -> None:
        super().__init__(message, provider=provider, status=status, tries=tries)
        self.reason = "model_rejected"


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How long a model request is retried.

    Attributes:
        budget: Seconds from the first try after which no retry starts.
        backoff: Scale of the jittered exponential backoff, in seconds.
        max_backoff: Longest backoff between two tries, in seconds.
    """

    budget: float = 60.0
    backoff: float = 0.5
    max_backoff: float = 10.0

    def __post_init__(self) -> None:
        for name in ("budget", "backoff", "max_backoff"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{name} must be >= 0 seconds, got {value!r}", field=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """A provider error as the retry rule sees it."""

    status: int | None  # None: a timeout or a broken connection
    message: str
    headers: Mapping[str, str]

    @property
    def retriable(self) -> bool:
        return self.status is None or self.status in RETRIED_STATUS or self.status >= 500


def retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds the provider asks to wait: ``retry-after-ms``, else
    ``retry-after`` (seconds, or an HTTP date); None when it asks nothing."""
    lowered = {k.lower(): v for k, v in headers.items()}
    if (ms := _seconds(lowered.get("retry-after-ms"))) is not None:
        return ms / 1000
    value = lowered.get("retry-after")
    if value is None:
        return None
    if (seconds := _seconds(value)) is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    *,
    provider: str,
    policy: RetryPolicy,
    classify: Callable[[BaseException], Failure | None],
    streamed: Callable[[], bool] = lambda: False,
) -> T:
    """``await attempt()``, sent again by the rules above.

    Raises:
        ModelRejected: the provider refused the request.
        ModelError: a retriable failure outlasted the budget, came after the
            first streamed token, or asked to wait past the budget.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.budget
    backoff = wait_random_exponential(multiplier=policy.backoff, max=policy.max_backoff)

    def retriable(err: BaseException) -> bool:
        failure = classify(err)
        return failure is not None and failure.retriable and not streamed()

    def wait(state: RetryCallState) -> float:
        failure = _failure_of(state, classify)
        asked = retry_after(failure.headers) if failure is not None else None
        return asked if asked is not None else backoff(state)

    def log_retry(state: RetryCallState) -> None:
        failure = _failure_of(state, classify)
        log.info(
            "%s request try %d failed (%s); retrying in %.2fs",
            provider,
            state.attempt_number,
            failure.message if failure else "?",
            state.upcoming_sleep,
        )

    tries = 0
    try:
        async for tried in AsyncRetrying(
            retry=retry_if_exception(retriable),
            wait=wait,
            stop=lambda state: loop.time() + state.upcoming_sleep > deadline,
            before_sleep=log_retry,
            reraise=True,
        ):
            with tried:
                tries += 1
                return await attempt()
    except Exception as err:
        failure = classify(err)
        if failure is None:
            raise
        raise _error(failure, provider=provider, tries=tries, streamed=streamed()) from err
    raise AssertionError("unreachable: the retry loop returns or raises")


def _failure_of(
    state: RetryCallState, classify: Callable[[BaseException], Failure | None]
) -> Failure | None:
    err = state.outcome.exception() if state.outcome is not None else None
    return classify(err) if err is not None else None


def _error(failure: Failure, *, provider: str, tries: int, streamed: bool) -> ModelError:
    status = f"HTTP {failure.status}" if failure.status is not None else "no answer"
    what = f"{provider} model request failed ({status}): {failure.message}"
    if not failure.retriable:
        return ModelRejected(what, provider=provider, status=failure.status, tries=tries)
    if streamed:
        why = "after its first streamed token, so it is not sent again"
    else:
        asked = retry_after(failure.headers)
        wait = f"; the provider asked to wait {asked:.1f}s" if asked is not None else ""
        why = f"{tries} tries, no retry within the retry budget{wait}"
    return ModelError(f"{what} ({why})", provider=provider, status=failure.status, tries=tries)


def classifier(sdk: Any) -> Callable[[BaseException], Failure | None]:
    """How errors of a provider package (``openai``, ``anthropic``: both raise
    ``APIStatusError`` with the response, ``APIConnectionError`` for timeouts
    and broken connections) read as failures; None for anything else."""

    def classify(err: BaseException) -> Failure | None:
        if isinstance(err, sdk.APIStatusError):
            headers = dict(err.response.headers)
            return Failure(status=err.status_code, message=_message(err), headers=headers)
        if isinstance(err, sdk.APIConnectionError | TimeoutError | ConnectionError):
            return Failure(status=None, message=f"{type(err).__name__}: {err}", headers={})
        if type(err).__module__.split(".")[0].startswith("httpx"):
            # A stream cut off mid-body surfaces as the HTTP library's own error.
            return Failure(status=None, message=f"{type(err).__name__}: {err}", headers={})
        return None

    return classify


def _message(err: Any) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
    return str(getattr(err, "message", err))
