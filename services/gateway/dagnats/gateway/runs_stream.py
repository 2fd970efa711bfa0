"""A live list of runs as server-sent events: ``GET /runs/events``.

Each request holds one ``WatchRuns`` stream (``Client.watch_runs``); the
engine serves them all from one watch of the runs bucket, and coalesces a
slow reader's changes per run, so a reader that falls behind gets the latest
state of each run it shows, never a backlog.

The events:

- ``runs`` (data: ``runs``, the list newest first): the whole list, first,
  and again after the engine's stream was opened anew; it replaces what the
  client holds;
- ``change`` (data: ``runs`` that changed or entered the list, ``removed``:
  ids that left it);
- ``error`` (data: ``code``, ``message``): the engine could not be reached;
  the stream ends.

Runs are ``run_dict`` without input and outputs (``null``): ``GET /runs/{id}``
has them. Events have no ids: a client that reconnects gets the list as it is
then, first, which is all it needs. Keepalives and errors are
``dagnats.gateway.sse``'s.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.gateway import sse
from dagnats.sdk import Client
from dagnats.sdk.views import run_dict

Feed = AsyncGenerator[pb.WatchRunsResponse, None]


async def first_list(
    client: Client, *, workflow: str, status: pb.RunStatus.ValueType | None, limit: int
) -> tuple[Feed, pb.WatchRunsResponse]:
    """The feed and its first message (the list), read before a response
    starts so that a refused filter is a 4xx, not an event."""
    feed = client.watch_runs(workflow=workflow, status=status, limit=limit)
    return feed, await sse.first(feed)


async def events(request: Request, feed: Feed, first: pb.WatchRunsResponse) -> AsyncIterator[str]:
    """The SSE text of ``first`` and each later message, until the client
    leaves; an ``error`` event when the engine could not be reached."""
    async for text in sse.relay(request, feed, first, _message):
        yield text


def _message(message: pb.WatchRunsResponse) -> tuple[str, bool]:
    runs = [run_dict(run) for run in message.runs]
    if message.snapshot:
        return sse.event("runs", {"runs": runs}), False
    return sse.event("change", {"runs": runs, "removed": list(message.removed)}), False
