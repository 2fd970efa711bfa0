"""A step's live preview: chunks a holder streams, on core NATS.

A preview is not a record (the spec's PutStream): chunks go to the readers of
``dagnats.stream.<run>.<step>`` with no stream behind them, so they cost no
fsync and a reader that was not listening never sees them. The markers tie
the preview to the journal: ``committed`` (the model record's sequence, sent
when RecordModel stored it), ``claim`` (a successor holds the step: every
open stream of another writer is abandoned) and ``abandoned`` (the call
failed). Run and step ids are validated tokens before they reach a subject,
so nothing from a request becomes a wildcard.
"""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client as NATS

from dagnats.core import errors
from dagnats.journal.v1 import journal_pb2 as pb

SUBJECT = "dagnats.stream"
MAX_CHUNK = 64 * 1024


def subject(run_id: str, step_id: str) -> str:
    """The subject of a step's preview (both ids already validated)."""
    return f"{SUBJECT}.{run_id}.{step_id}"


def stream_id(writer: str, position: int) -> str:
    """A stream's name: one writer's preview of one call position."""
    return f"{writer}.{position}"


def _head(token: pb.WriterToken, position: int) -> dict[str, Any]:
    return {
        "run": token.run_id,
        "step": token.step_id,
        "iteration": token.iteration,
        "attempt": token.attempt,
        "position": position,
        "writer": token.writer,
    }


def chunk_event(request: pb.PutStreamRequest) -> dict[str, Any]:
    """The event a chunk is published as; raises InvalidArgument for a bad one."""
    if request.seq < 1:
        raise errors.InvalidArgument("seq must be >= 1", field="seq")
    event = _head(request.token, request.position) | {"seq": request.seq}
    match request.WhichOneof("chunk"):
        case "text":
            if len(request.text.encode()) > MAX_CHUNK:
                raise errors.InvalidArgument(f"text is over {MAX_CHUNK} bytes", field="text")
            event |= {"type": "token", "text": request.text}
        case "json":
            if len(request.json) > MAX_CHUNK:
                raise errors.InvalidArgument(f"json is over {MAX_CHUNK} bytes", field="json")
            try:
                event |= {"type": "token", "json": json.loads(request.json)}
            except ValueError as err:
                raise errors.InvalidArgument(f"json must be JSON: {err}", field="json") from None
        case "abandon":
            event |= {"type": "abandoned", "reason": "failed"}
        case _:
            raise errors.InvalidArgument("a chunk needs text, json or abandon", field="chunk")
    if request.dropped:
        event["dropped"] = request.dropped
    return event


def committed_event(token: pb.WriterToken, position: int, record: pb.Record) -> dict[str, Any]:
    """The marker that ends a stream once its model record is stored."""
    return _head(token, position) | {
        "type": "committed",
        "record_seq": record.seq,
        "response": json.loads(record.model.response),
    }


def claim_event(token: pb.WriterToken) -> dict[str, Any]:
    """The marker a successor's claim sends: other writers' streams are abandoned."""
    return _head(token, -1) | {"type": "claim"}


async def publish(nc: NATS, event: dict[str, Any]) -> None:
    """Send one event; a preview is best-effort, so a lost one is not an error."""
    data = json.dumps(event, separators=(",", ":")).encode()
    await nc.publish(subject(event["run"], event["step"]), data)


WATCH_BUFFER = 1024  # events a slow WatchStream reader may fall behind


def event_id(event: dict[str, Any]) -> str:
    """An event's id: ``<writer>.<position>.<seq>`` for a chunk, a marker's
    type in place of the sequence (a claim names only its writer)."""
    if event["type"] == "claim":
        return f"{event['writer']}.claim"
    if event["type"] == "token":
        return f"{stream_id(event['writer'], event['position'])}.{event['seq']}"
    return f"{stream_id(event['writer'], event['position'])}.{event['type']}"
