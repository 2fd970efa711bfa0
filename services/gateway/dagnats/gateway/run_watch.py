"""A run's changes over HTTP: the long poll of ``GET /runs/{id}?wait=`` and the
server-sent events of ``GET /runs/{id}/events``.

Both read the engine's ``WatchRun`` through ``Client.watch_run``, which the
engine pushes on every change of the run; nothing here polls. Each request
holds one ``WatchRun`` stream; the engine serves every stream of a run from
one watch of it, however many clients follow that run.

The events: each ``run`` event carries the run's JSON (``run_dict``); after
the run's final state one ``end`` event (data: ``status``) closes the
stream, and a client should not reconnect after it. Events have no ids: a
client that reconnects gets the run as it is then, first, which is all it
needs. Keepalives and errors are ``dagnats.gateway.sse``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import sse
from dagnats.sdk import Client
from dagnats.sdk.views import enum_name, run_dict


async def wait_for_change(
    client: Client, run_id: str, wait: float, seen: pb.RunStatus.ValueType | None
) -> pb.Run:
    """The run once its status differs from ``seen`` (the status on arrival
    when None), or as it is when ``wait`` seconds have passed first, or at
    once when it has ended (its watch says nothing more).

    Raises:
        NotFound: no run has that id.
    """
    watch = client.watch_run(run_id)
    try:
        run = await anext(watch)
        seen = run.status if seen is None else seen
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                while run.status == seen:
                    later = await anext(watch, None)
                    if later is None:  # the run ended as it was
                        break
                    run = later
        return run
    finally:
        await watch.aclose()


async def first_state(client: Client, run_id: str) -> tuple[AsyncGenerator[pb.Run, None], pb.Run]:
    """A watch of the run and its first state, read before a response starts so
    that an unknown run is a 404, not an event.

    Raises:
        NotFound: no run has that id.
    """
    watch = client.watch_run(run_id)
    return watch, await sse.first(watch)


async def events(
    request: Request, watch: AsyncGenerator[pb.Run, None], first: pb.Run
) -> AsyncIterator[str]:
    """The SSE text of ``first`` and each later state, then ``end``; or an
    ``error`` event when the engine could not be reached for the client's
    ``retry_for``."""
    async for text in sse.relay(request, watch, first, _state):
        yield text


def _state(run: pb.Run) -> tuple[str, bool]:
    text = sse.event("run", run_dict(run))
    if run.status == pb.RUN_STATUS_RUNNING:
        return text, False
    return text + sse.event("end", {"status": enum_name(pb.RunStatus, run.status)}), True
