"""A run's settings: the names and values its handlers read
(``TaskContext.settings``), such as which model to call.

One set of rules for every edge (gRPC, REST, the CLI): at most
``MAX_SETTINGS`` of them, each name one token (``ids.check_token``: 1-64 of
``A-Z a-z 0-9 _ -``), each value at most ``MAX_VALUE_BYTES`` of UTF-8 with
no control character. Every task of the run carries them, so they stay small.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_token

MAX_SETTINGS = 32
"""The most settings one run carries."""

MAX_VALUE_BYTES = 1024
"""The longest value of a setting, in bytes of UTF-8."""


def check_settings(settings: Mapping[str, str], *, field: str = "settings") -> dict[str, str]:
    """Return ``settings`` if every name and value keeps the rules above.

    Raises:
        InvalidArgument: naming ``field`` (and the setting) otherwise.
    """
    if len(settings) > MAX_SETTINGS:
        raise InvalidArgument(
            f"{field} holds {len(settings)} settings, at most {MAX_SETTINGS}", field=field
        )
    for name, value in settings.items():
        check_token(name, field=f"{field} name")
        if not isinstance(value, str):
            raise InvalidArgument(f"{field}[{name}] must be text", field=f"{field}.{name}")
        if len(value.encode()) > MAX_VALUE_BYTES:
            raise InvalidArgument(
                f"{field}[{name}] is longer than {MAX_VALUE_BYTES} bytes", field=f"{field}.{name}"
            )
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise InvalidArgument(
                f"{field}[{name}] holds a control character", field=f"{field}.{name}"
            )
    return dict(settings)


def parse_assignments(items: Iterable[str], *, field: str = "--set") -> dict[str, str]:
    """The settings ``name=value`` items name (a later name wins), checked.

    Raises:
        InvalidArgument: an item without ``=``, or a setting the rules refuse.
    """
    found: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"{field} takes name=value, got {item[:80]!r}", field=field)
        found[name] = value
    return check_settings(found, field=field)


def merged(base: Mapping[str, str], changes: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``changes`` set on top; an empty value removes a name."""
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v}
