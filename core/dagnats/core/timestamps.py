"""Seconds as the contracts carry them: ``Timestamp`` for a moment,
``Duration`` for a span.

The rules and the SDK count in float seconds (since the epoch, for a moment);
the contracts in protobuf's well-known types. Every conversion is here, at
nanosecond precision, so no service or client rounds a different way.
"""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp


def timestamp(seconds: float) -> Timestamp:
    """The moment ``seconds`` after the epoch."""
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


def seconds(ts: Timestamp, present: bool = True) -> float | None:
    """Seconds since the epoch of ``ts``; None when the field is not ``present``."""
    return ts.ToNanoseconds() / 1e9 if present else None


def duration(seconds: float) -> Duration:
    """A span of ``seconds``."""
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def duration_seconds(d: Duration) -> float:
    """The seconds of ``d``."""
    return d.ToNanoseconds() / 1e9
