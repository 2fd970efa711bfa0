"""JSON in and out of the ``bytes`` fields of the contracts.

Every payload a contract carries (a run's input and output, a step's state, a
model response, a tool's input and output) is JSON in bytes, and empty bytes
mean null. The SDK encodes and decodes here, the services check here, and the
gateway encodes what it takes over HTTP here, so all agree on what counts.

Invariants: everything encoded is strict JSON (no NaN or Infinity, which
workers in other languages could not read); a value that is not JSON is an
``InvalidArgument`` naming its field, raised before anything is sent or stored.
"""

from __future__ import annotations

import json
from typing import Any

from dagnats.core.errors import InvalidArgument


def encode(value: Any, *, field: str) -> bytes:
    """JSON-encode ``value``.

    Raises:
        InvalidArgument: naming ``field`` when ``value`` is not JSON-serialisable.
    """
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as err:
        raise InvalidArgument(f"{field} is not JSON-serialisable: {err}", field=field) from err


def decode(data: bytes, *, field: str) -> Any:
    """JSON-decode ``data``; empty bytes are None.

    Raises:
        InvalidArgument: naming ``field`` when ``data`` is not JSON.
    """
    if not data:
        return None
    try:
        return json.loads(data)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidArgument(f"{field} is not valid JSON: {err}", field=field) from err


def check_json(
    raw: bytes, *, field: str, limit: int | None = None, allow_empty: bool = True
) -> bytes:
    """``raw`` itself, once it is known to be JSON of at most ``limit`` bytes.

    Args:
        raw: the field's bytes.
        field: its name, for the error.
        limit: the largest size accepted; None for no limit.
        allow_empty: whether empty bytes (null) are accepted.

    Raises:
        InvalidArgument: naming ``field``: too large, empty where a value is
            required, or not JSON.
    """
    if limit is not None and len(raw) > limit:
        raise InvalidArgument(f"{field} is {len(raw)} bytes; the limit is {limit}", field=field)
    if not raw and allow_empty:
        return raw
    try:
        json.loads(raw)
    except ValueError as err:
        raise InvalidArgument(f"{field} is not valid JSON: {err}", field=field) from None
    return raw
