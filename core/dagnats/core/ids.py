"""Validation of every identifier and cursor a request carries.

One set of rules for every edge: the gRPC services, the NATS endpoints, the
HTTP gateway and the CLI call these functions, so an id or a number that one
edge accepts is accepted by all of them, and one that is refused is refused
with the same message and field everywhere.

* A subject token (step ids, task types, workflow names) must never be empty,
  contain a dot, a wildcard (``*``, ``>``) or white space.
* A run id is 32 lowercase hex characters.
* A request id (an input's idempotency key) may be any text that can be
  addressed again afterwards: it is encoded before it lands in a key, but it
  is also one segment of an HTTP path, so it cannot hold ``/`` and cannot be
  ``.`` or ``..`` (clients resolve those segments before sending).
* A journal cursor is a JetStream sequence: 0 up to ``MAX_SEQ``.
* A lease is the ack subject of a task message of the ``TASKS`` stream, as
  ``PollTasks`` handed it out.
"""

from __future__ import annotations

import re
import secrets

from dagnats.core.errors import InvalidArgument

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RUN_ID = re.compile(r"[0-9a-f]{32}")
# $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>, optionally
# with <domain>.<account hash> after ACK and a trailing random token.
_LEASE = re.compile(
    r"\$JS\.ACK\.(?:[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.)?TASKS\.tasks-[A-Za-z0-9_-]{1,64}"
    r"(?:@[A-Za-z0-9_-]{1,64})?"
    r"(?:\.[0-9]+){5}(?:\.[A-Za-z0-9_-]+)?"
)

MAX_REQUEST_ID = 256
"""The longest request id, in characters."""

MAX_SEQ = 2**64 - 1
"""The largest JetStream sequence (an unsigned 64-bit number)."""

MAX_WORKER_ID = 256
"""The longest worker id, in characters: it names a worker in claims and logs."""


def check_token(value: str, *, field: str) -> str:
    """Return ``value`` if it is one NATS token of at most 64 safe characters.

    Raises:
        InvalidArgument: naming ``field`` otherwise.
    """
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidArgument(
            f"{field} must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-', got {value!r}",
            field=field,
        )
    return value


def check_build_id(value: str, *, field: str = "build_id") -> str:
    """Return ``value`` if it is a worker build id: empty (an unversioned
    worker) or one token of at most 64 safe characters, since it names a
    lane of task subjects and its consumer."""
    return check_token(value, field=field) if value else value


def check_worker_id(value: str, *, field: str = "worker_id") -> str:
    """Return ``value`` if it is at most ``MAX_WORKER_ID`` characters (empty:
    the worker gave none). It is only recorded, never part of a subject."""
    if len(value) > MAX_WORKER_ID:
        raise InvalidArgument(f"{field} is longer than {MAX_WORKER_ID} characters", field=field)
    return value


def check_run_id(value: str, *, field: str = "run_id") -> str:
    """Return ``value`` if it is a run id (32 lowercase hex characters)."""
    if not isinstance(value, str) or not _RUN_ID.fullmatch(value):
        raise InvalidArgument(
            f"{field} must be 32 lowercase hex characters, got {value!r}", field=field
        )
    return value


def check_request_id(value: str, *, field: str = "request_id") -> str:
    """Return ``value`` if it is 1-256 characters of valid Unicode that a
    client can address again: no ``/``, and not ``.`` or ``..``.

    Raises:
        InvalidArgument: naming ``field`` otherwise.
    """
    if not 1 <= len(value) <= MAX_REQUEST_ID:
        raise InvalidArgument(
            f"{field} must be 1-{MAX_REQUEST_ID} characters, got {len(value)}", field=field
        )
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"{field} is not valid Unicode", field=field) from None
    if "/" in value or value in (".", ".."):
        raise InvalidArgument(
            f"{field} cannot contain '/' or be '.' or '..' (it is a segment of a URL path), "
            f"got {value!r}",
            field=field,
        )
    return value


def check_seq(value: int, *, field: str) -> int:
    """Return ``value`` if it is a JetStream sequence, 0 to ``MAX_SEQ``.

    Raises:
        InvalidArgument: naming ``field`` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise InvalidArgument(
            f"{field} must be a sequence number from 0 to {MAX_SEQ}, got {value!r}", field=field
        )
    return value


def parse_seq(text: str, *, field: str) -> int:
    """The sequence number written in ``text`` (decimal digits only).

    Raises:
        InvalidArgument: naming ``field`` when ``text`` is not a sequence.
    """
    digits = text.strip()
    if not digits.isascii() or not digits.isdigit() or len(digits) > len(str(MAX_SEQ)):
        raise InvalidArgument(
            f"{field} must be a sequence number from 0 to {MAX_SEQ}, got {text[:40]!r}",
            field=field,
        )
    return check_seq(int(digits), field=field)


def check_lease(value: str, *, field: str = "lease") -> str:
    """Return ``value`` if it is a task lease from ``PollTasks``.

    Raises:
        InvalidArgument: naming ``field`` otherwise.
    """
    if not _LEASE.fullmatch(value):
        raise InvalidArgument(f"{field} is not a task lease from PollTasks", field=field)
    return value


def new_run_id() -> str:
    """A fresh random run id."""
    return secrets.token_hex(16)
