"""How long a service may keep trying on behalf of the request it is serving.

A servicer enters :func:`serving` with the gRPC deadline of the call (the
client's timeout); the JetStream adapters ask :func:`budget` how long they may
retry a transient error, so a request is answered, with ``Unavailable`` at
worst, before its caller gives up on it. Code that serves no request (the
engine's loops, the NATS endpoints, a Session stream's calls, which carry no
deadline of their own) gets the adapter's own budget.

Kept apart from ``jetstream`` so that ``grpcutil``, which the SDK imports too,
can set it without importing nats-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterator

# Seconds kept back from a request's deadline to send the answer.
ANSWER_MARGIN = 0.25

_until: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "dagnats_request_deadline", default=None
)


@contextlib.contextmanager
def serving(time_remaining: float | None) -> Iterator[None]:
    """Within this block the request must be answered in ``time_remaining``
    seconds (None: it has no deadline)."""
    until = None
    if time_remaining is not None:
        until = asyncio.get_running_loop().time() + time_remaining - ANSWER_MARGIN
    token = _until.set(until)
    try:
        yield
    finally:
        _until.reset(token)


def budget(longest: float) -> float:
    """Seconds left to retry: ``longest``, or less when the request being
    served must be answered sooner. Never negative."""
    until = _until.get()
    if until is None:
        return longest
    return max(0.0, min(longest, until - asyncio.get_running_loop().time()))
