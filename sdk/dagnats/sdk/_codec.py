"""JSON in and out of the ``bytes`` fields of the engine contract.

Invariants: everything the SDK sends is strict JSON (no NaN or Infinity, which
workers in other languages could not read), and an encoding failure is an
``InvalidArgument`` raised before any RPC is made. Empty bytes decode to None,
as the contract says "empty means null".
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
