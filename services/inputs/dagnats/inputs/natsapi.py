"""The inputs operations as NATS request-reply endpoints.

Subjects (queue group ``dagnats-inputs``, so one replica answers each request):

==========================  ==================  ===================
subject                     request             reply
==========================  ==================  ===================
``api.inputs.submit``       ``SubmitRequest``   ``SubmitResponse``
``api.inputs.get``          ``GetRequest``      ``GetResponse``
``api.inputs.withdraw``     ``WithdrawRequest`` ``WithdrawResponse``
==========================  ==================  ===================

Bodies are the serialized ``dagnats.inputs.v1`` messages. A failed request is
answered with the header ``Dagnats-Error: <code>`` and a JSON body
``{"code": ..., "message": ..., "field": ...}``; ``code`` is the domain error's
code (``invalid_argument``, ``not_found``, ``conflict``, ``unavailable``,
``internal``) and ``field`` is the offending request field or null. A reply
without that header is a success. A ``get`` with a ``wait`` answers after up to
that long, so the requester's timeout must be longer.

Each request runs in its own task: a waiting ``get`` does not hold up others.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dagnats.core import errors
from dagnats.core.subjects import INPUTS_GET, INPUTS_SUBMIT, INPUTS_WITHDRAW
from dagnats.inputs.service import Inputs
from dagnats.inputs.v1 import inputs_pb2 as pb

log = logging.getLogger(__name__)

QUEUE = "dagnats-inputs"
SUBMIT, GET, WITHDRAW = INPUTS_SUBMIT, INPUTS_GET, INPUTS_WITHDRAW
ERROR_HEADER = "Dagnats-Error"

Req = TypeVar("Req", bound=Message)


def error_body(err: errors.DagnatsError) -> bytes:
    """The JSON body of an error reply."""
    return json.dumps({"code": err.code, "message": err.message, "field": err.field}).encode()


async def serve_nats_api(nc: NATS, logic: Inputs) -> list[Subscription]:
    """Subscribe the endpoints; ``nc.drain()`` (or unsubscribing) ends them.

    Returns:
        The subscriptions, one per subject.
    """
    running: set[asyncio.Task[None]] = set()
    endpoints: list[tuple[str, Callable[[Msg], Coroutine[Any, Any, None]]]] = [
        (SUBMIT, _endpoint(nc, pb.SubmitRequest, logic.submit)),
        (GET, _endpoint(nc, pb.GetRequest, logic.get)),
        (WITHDRAW, _endpoint(nc, pb.WithdrawRequest, logic.withdraw)),
    ]
    subs = []
    for subject, handle in endpoints:
        subs.append(await nc.subscribe(subject, queue=QUEUE, cb=_spawner(handle, running)))
    return subs


def _spawner(
    handle: Callable[[Msg], Coroutine[Any, Any, None]], running: set[asyncio.Task[None]]
) -> Callable[[Msg], Awaitable[None]]:
    # nats-py runs one callback of a subscription at a time; a task per
    # request keeps a 60-second get from delaying the next request.
    async def spawn(msg: Msg) -> None:
        task = asyncio.create_task(handle(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    return spawn


def _endpoint(
    nc: NATS, request_type: type[Req], call: Callable[[Req], Awaitable[Message]]
) -> Callable[[Msg], Coroutine[Any, Any, None]]:
    async def handle(msg: Msg) -> None:
        if not msg.reply:
            log.warning("%s: request without a reply subject, ignored", msg.subject)
            return
        headers: dict[str, str] | None = None
        try:
            body = (await call(_parse(request_type, msg.data))).SerializeToString()
        except errors.DagnatsError as err:
            body, headers = error_body(err), {ERROR_HEADER: err.code}
        except Exception as err:
            log.exception("%s failed", msg.subject)
            internal = errors.DagnatsError(f"internal error: {type(err).__name__}")
            body, headers = error_body(internal), {ERROR_HEADER: internal.code}
        try:
            await nc.publish(msg.reply, body, headers=headers)
        except Exception as err:  # the connection is closing: the requester times out
            log.warning("%s: could not reply: %r", msg.subject, err)

    return handle


def _parse(request_type: type[Req], data: bytes) -> Req:
    try:
        return request_type.FromString(data)
    except DecodeError:
        name = request_type.DESCRIPTOR.full_name
        raise errors.InvalidArgument(f"the body is not a {name}", field="request") from None


__all__ = ["ERROR_HEADER", "GET", "QUEUE", "SUBMIT", "WITHDRAW", "error_body", "serve_nats_api"]
