"""Durations, read the same way wherever the product takes one: workflow
documents, the HTTP API's query parameters and the bridge's JSON bodies.

A duration is a number of seconds (a JSON or YAML number, or digits in a
string, as a query parameter carries them) or a string of one or more
``<number><unit>`` parts with the units ``ms``, ``s``, ``m``, ``h`` and ``d``,
such as ``"500ms"``, ``"30s"`` or ``"1h30m"``. Booleans are not numbers.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import TypeGuard

from dagnats.core.errors import InvalidArgument

# google.protobuf.Duration holds at most 10,000 years; a larger value could not be stored.
MAX_SECONDS = 315_576_000_000
EXAMPLES = "'500ms', '30s', '5m', '1h30m' or '2d'"
# The same grammar for a JSON schema.
PATTERN = r"^(\d+(\.\d+)?|(\d+(\.\d+)?(ms|s|m|h|d))+)$"

_SECONDS_TEXT = re.compile(r"\d+(?:\.\d+)?")
_UNITS_TEXT = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}


def parse_duration(value: object, *, field: str, maximum: float = MAX_SECONDS) -> float:
    """Seconds from ``value``, a duration in the grammar above.

    Args:
        value: the value as the caller sent it.
        field: path of the field, used in the error.
        maximum: the largest duration accepted, in seconds.

    Returns:
        The duration in seconds, from 0 to ``maximum``.

    Raises:
        InvalidArgument: naming ``field`` for anything else, or a negative value.
    """
    seconds: int | float | Decimal
    if isinstance(value, str) and _SECONDS_TEXT.fullmatch(value):
        seconds = Decimal(value)
    elif isinstance(value, str) and _UNITS_TEXT.fullmatch(value):
        seconds = sum(
            (Decimal(n) * _UNIT_SECONDS[unit] for n, unit in _PART.findall(value)), Decimal(0)
        )
    elif _is_number(value):
        seconds = value
    else:
        raise InvalidArgument(
            f"{field} must be seconds as a number or a string like {EXAMPLES}, got {value!r}",
            field=field,
        )
    if seconds < 0:
        raise InvalidArgument(f"{field} must not be negative, got {value!r}", field=field)
    if seconds > maximum:
        raise InvalidArgument(
            f"{field} must be at most {_spoken(maximum)}, got {value!r}", field=field
        )
    return float(seconds)


def _is_number(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not (isinstance(value, float) and math.isnan(value))


def _spoken(seconds: float) -> str:
    if seconds == MAX_SECONDS:
        return "10000 years"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
