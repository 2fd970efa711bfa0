"""Validation of every identifier that ends up in a NATS subject or key.

A subject token must never be empty, contain a dot, a wildcard (``*``, ``>``)
or white space. Everything from a request that lands in a subject passes
through one of these functions first.
"""

from __future__ import annotations

import re
import secrets

from dagnats.core.errors import InvalidArgument

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RUN_ID = re.compile(r"[0-9a-f]{32}")


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


def check_run_id(value: str, *, field: str = "run_id") -> str:
    """Return ``value`` if it is a run id (32 lowercase hex characters)."""
    if not isinstance(value, str) or not _RUN_ID.fullmatch(value):
        raise InvalidArgument(
            f"{field} must be 32 lowercase hex characters, got {value!r}", field=field
        )
    return value


def new_run_id() -> str:
    """A fresh random run id."""
    return secrets.token_hex(16)
