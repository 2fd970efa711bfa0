"""Helpers shared by the tests.

:func:`wait_for` is the only way a test waits: it polls a condition against a
deadline, so a slow machine makes a test slower, never flaky, and a broken
condition fails with the last value seen instead of hanging.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, cast, overload

import grpc.aio

from dagnats.core import jetstream as jsx

T = TypeVar("T")


@overload
async def wait_for(
    predicate: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = ...,  # noqa: ASYNC109
    interval: float = ...,
    message: str = ...,
) -> T: ...


@overload
async def wait_for(
    predicate: Callable[[], T | None],
    *,
    timeout: float = ...,  # noqa: ASYNC109
    interval: float = ...,
    message: str = ...,
) -> T: ...


async def wait_for(
    predicate: Callable[[], Awaitable[T | None] | T | None],
    *,
    timeout: float = 10.0,  # noqa: ASYNC109 - a polling deadline, not a cancel scope
    interval: float = 0.02,
    message: str = "",
) -> T:
    """Poll ``predicate`` (sync or async) until it returns a truthy value.

    Args:
        predicate: called with no arguments; may return an awaitable.
        timeout: seconds before giving up.
        interval: seconds between polls.
        message: what was awaited, for the failure message.

    Returns:
        The first truthy value.

    Raises:
        AssertionError: the deadline passed; the message names the last value.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            what = message or getattr(predicate, "__qualname__", repr(predicate))
            raise AssertionError(f"{what}: not true within {timeout}s (last value: {value!r})")
        await asyncio.sleep(interval)


def holds(record: Any, kind: str) -> bool:
    """Whether a journal record holds an entry of ``kind`` (``model``,
    ``tool_result``, ...): as its own kind, or stored ahead of it (a leading entry)."""
    return bool(record.HasField(kind)) or (
        f"leading_{kind}" in record.DESCRIPTOR.fields_by_name
        and bool(record.HasField(f"leading_{kind}"))
    )


def body(record: Any, kind: str) -> Any:
    """The entry of ``kind`` a journal record holds (see :func:`holds`)."""
    return getattr(record, kind if record.HasField(kind) else f"leading_{kind}")


def claims(records: Iterable[Any], iteration: int | None = None) -> list[Any]:
    """The journal records that hold a claim: a claim record, or the first
    record of a dispatch handed over with the commit before it (the hand-over);
    those of ``iteration`` only, if given."""
    return [
        r for r in records if holds(r, "claim") and (iteration is None or r.iteration == iteration)
    ]


def claimed_after_redelivery(records: Iterable[Any], iteration: int) -> bool:
    """Whether a later delivery of the task claimed ``iteration``: a successor
    holds it, and its first holder is fenced."""
    return any(body(r, "claim").delivery > 1 for r in claims(records, iteration))


def trailing(err: grpc.aio.AioRpcError) -> dict[str, str]:
    """A failed call's trailing metadata as text by key (grpc.aio yields pairs)."""
    pairs = cast(Any, err.trailing_metadata() or ())
    return {str(k): str(v) for k, v in pairs}


async def created(create: Callable[[], Awaitable[T]], name: str) -> T:
    """``create()``, a stream or bucket, sent again while the cluster is
    forming or busy (no answer in time, no peer for placement while one is
    offline: ``jsx.cluster_forming``, as the services' own provisioning): a
    create with the same configuration is answered as the first was."""

    async def attempt() -> T | None:
        try:
            return await create()
        except Exception as err:
            if jsx.cluster_forming(err):
                return None
            raise

    return await wait_for(attempt, timeout=60, message=f"{name} created")
