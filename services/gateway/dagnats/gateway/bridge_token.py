"""The bridge's task token: everything the gateway needs to act for an HTTP
worker, carried by the worker instead of kept by the gateway.

A token is URL-safe base64 (no padding) of a small JSON object: the task's
lease and identity (run, step, iteration, attempt), its delivery count, the
worker id, the restart limit, and -- once the journal is claimed -- the
journal's ``WriterToken`` (protobuf, base64), the next call position and what
a begun call is waiting for. Every journal action answers with the updated
token; the worker sends the latest one with its next call.

Invariants:

- The token is not a credential (the bridge's bearer token is) and is not
  signed. A stale token, or one copied from an earlier response, cannot act on
  a successor's task: every journal write is fenced on the writer's last seen
  sequence and the journal answers ``fenced`` (docs/adr/0005-http-bridge.md).
- Decoding never raises anything but ``InvalidArgument`` naming ``token``.
- The writer token, when present, names the same run, step and dispatch as
  the task.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_build_id, check_run_id, check_token
from dagnats.journal.v1 import journal_pb2 as jpb

VERSION = 1
_FIELD = "token"
_INT32 = 2**31 - 1
_UINT64 = 2**64 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BridgeToken:
    """One leased task as the bridge sees it.

    Attributes:
        lease: The engine's lease (heartbeat and report).
        run_id: The run.
        step_id: The step.
        iteration: Iteration of the dispatch.
        attempt: Attempt of the dispatch.
        delivery: Delivery count of the task message.
        worker_id: The worker, recorded in the claim.
        restart_limit: Deliveries in a row without progress that fail the step.
        build_id: The worker's build, stamped on its commits.
        writer: The journal writer once claimed.
        has_state: The claim found a committed state (carried to the next commit).
        position: Position of the next journaled call.
        model_position: Position of a begun model call awaiting its response.
        intent_seq: Intent of a begun tool call awaiting its result.
        state: A checkpoint saved since the claim (JSON), for the next commit.
        budget: The run's budget, from its task: every model call asks the
            journal to check it.
    """

    lease: str
    run_id: str
    step_id: str
    iteration: int
    attempt: int
    delivery: int = 1
    worker_id: str = ""
    restart_limit: int = 5
    build_id: str = ""
    writer: jpb.WriterToken | None = None
    has_state: bool = False
    position: int = 0
    model_position: int | None = None
    intent_seq: int = 0
    state: bytes | None = None
    budget: jpb.Budget | None = None

    def encode(self) -> str:
        """The token's text, as the worker sends it back."""
        data: dict[str, Any] = {
            "v": VERSION,
            "lease": self.lease,
            "run": self.run_id,
            "step": self.step_id,
            "it": self.iteration,
            "at": self.attempt,
            "dl": self.delivery,
            "wk": self.worker_id,
            "rl": self.restart_limit,
        }
        if self.budget is not None:
            data["bg"] = base64.b64encode(self.budget.SerializeToString()).decode()
        if self.build_id:
            data["bd"] = self.build_id
        if self.writer is not None:
            data["w"] = base64.b64encode(self.writer.SerializeToString()).decode()
            data["hs"] = self.has_state
            data["p"] = self.position
            if self.model_position is not None:
                data["mp"] = self.model_position
            if self.intent_seq:
                data["is"] = self.intent_seq
            if self.state is not None:
                data["st"] = self.state.decode()
        raw = json.dumps(data, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    @classmethod
    def decode(cls, text: str) -> BridgeToken:
        """The token a worker sent.

        Raises:
            InvalidArgument: naming ``token`` when it is not one the bridge issued.
        """
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            data = json.loads(raw)
        except (binascii.Error, ValueError) as err:
            raise _invalid(f"not base64url JSON ({err})") from None
        if not isinstance(data, dict) or data.get("v") != VERSION:
            raise _invalid("unknown version")
        token = cls(
            lease=_get(data, "lease", str),
            run_id=_get(data, "run", str),
            step_id=_get(data, "step", str),
            iteration=_get(data, "it", int),
            attempt=_get(data, "at", int),
            delivery=_get(data, "dl", int),
            worker_id=_get(data, "wk", str),
            restart_limit=_get(data, "rl", int),
            build_id=_get(data, "bd", str, ""),
            writer=_writer(data.get("w")),
            has_state=_get(data, "hs", bool, False),
            position=_get(data, "p", int, 0),
            model_position=_get(data, "mp", int, None),
            intent_seq=_get(data, "is", int, 0),
            state=_state(data.get("st")),
            budget=_budget(data.get("bg")),
        )
        return _checked(token)


def _get(data: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    if key not in data:
        if default is ...:
            raise _invalid(f"{key!r} is missing")
        return default
    value = data[key]
    # bool is an int in Python; neither may stand in for the other here.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _invalid(f"{key!r} must be {kind.__name__}")
    return value


def _writer(value: Any) -> jpb.WriterToken | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid("'w' must be a string")
    try:
        return jpb.WriterToken.FromString(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        raise _invalid("'w' is not a writer token") from None


def _budget(value: Any) -> jpb.Budget | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid("'bg' must be a string")
    try:
        return jpb.Budget.FromString(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        raise _invalid("'bg' is not a budget") from None


def _state(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid("'st' must be a string")
    return value.encode()


def _checked(token: BridgeToken) -> BridgeToken:
    check_run_id(token.run_id, field=_FIELD)
    check_token(token.step_id, field=_FIELD)
    if not (0 <= token.iteration <= _INT32 and 1 <= token.attempt <= _INT32):
        raise _invalid("it names no dispatch")
    numbers = (token.delivery, token.position, token.model_position or 0)
    if not (all(0 <= n <= _INT32 for n in numbers) and 0 <= token.intent_seq <= _UINT64):
        raise _invalid("a number is out of range")
    if not 1 <= token.restart_limit <= 1000:
        raise _invalid("restart_limit is out of range")
    check_build_id(token.build_id, field=_FIELD)
    try:  # JSON allows lone surrogates; the contract's strings are UTF-8
        token.lease.encode()
        token.worker_id.encode()
    except UnicodeEncodeError:
        raise _invalid("a string is not valid Unicode") from None
    writer = token.writer
    if writer is not None and (
        (writer.run_id, writer.step_id, writer.iteration, writer.attempt)
        != (token.run_id, token.step_id, token.iteration, token.attempt)
    ):
        raise _invalid("its writer belongs to another dispatch")
    return token


def _invalid(why: str) -> InvalidArgument:
    return InvalidArgument(f"token is not a bridge task token: {why}", field=_FIELD)
