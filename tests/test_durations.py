"""One duration grammar for workflow documents, the HTTP API and the bridge (pure)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dagnats.core.durations import parse_duration
from dagnats.core.errors import InvalidArgument


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (45, 45.0),
        (2.5, 2.5),
        ("30", 30.0),
        ("0.25", 0.25),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("1.5s", 1.5),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("2d", 172800.0),
        ("1m30s250ms", 90.25),
        ("0s", 0.0),
    ],
)
def test_duration_parsing(value: Any, seconds: float) -> None:
    assert parse_duration(value, field="timeout") == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "timeout must be seconds as a number or a string like"),
        ("5 m", "timeout must be seconds as a number or a string like"),
        (" 30s", "timeout must be seconds as a number or a string like"),
        ("1w", "timeout must be seconds as a number or a string like"),
        ("-1s", "timeout must be seconds as a number or a string like"),
        ("-1", "timeout must be seconds as a number or a string like"),
        ("1h-30m", "timeout must be seconds as a number or a string like"),
        ("30s5", "timeout must be seconds as a number or a string like"),
        ("s", "timeout must be seconds as a number or a string like"),
        ("soon", "timeout must be seconds as a number or a string like"),
        (True, "timeout must be seconds as a number or a string like"),
        (None, "timeout must be seconds as a number or a string like"),
        ([1], "timeout must be seconds as a number or a string like"),
        (math.nan, "timeout must be seconds as a number or a string like"),
        (-1, "timeout must not be negative, got -1"),
        (-0.5, "timeout must not be negative"),
        (math.inf, "timeout must be at most 10000 years"),
        (10**20, "timeout must be at most 10000 years"),
        ("4000000d", "timeout must be at most 10000 years"),
    ],
)
def test_invalid_duration_is_rejected_naming_the_field(value: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_duration(value, field="timeout")

    assert info.value.field == "timeout"
    assert info.value.message.startswith(message)


@pytest.mark.parametrize(
    ("value", "maximum", "message"),
    [
        ("6m", 300.0, "wait must be at most 5m, got '6m'"),
        ("301", 300.0, "wait must be at most 5m, got '301'"),
        (90.5, 90.0, "wait must be at most 90s, got 90.5"),
    ],
)
def test_a_maximum_is_named_in_its_error(value: Any, maximum: float, message: str) -> None:
    assert parse_duration("300", field="wait", maximum=300.0) == 300.0
    with pytest.raises(InvalidArgument) as info:
        parse_duration(value, field="wait", maximum=maximum)
    assert info.value.field == "wait" and info.value.message == message
