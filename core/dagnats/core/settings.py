"""Reading ``DAGNATS_*`` settings from the environment, checked at the edge.

A value that does not parse, or is out of range, is an ``InvalidArgument``
naming the variable, so a service refuses to start with a clear message
instead of a traceback or a silent default. Every setting is listed in
``dagnats.core.catalogue``, which the settings reference is generated from.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from pathlib import Path

from dagnats.core.errors import InvalidArgument

_FALSE = frozenset({"0", "false", "no", "off", ""})

# The services a server process runs (``dagnats serve``), each alone or all
# together, and the port each takes by default (all three: the engine's).
SERVICES = ("engine", "journal", "inputs")
DEFAULT_PORTS = {"engine": 7233, "journal": 7234, "inputs": 7235}


def env_seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds from ``name``; ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(
            f"{name} must be a positive number of seconds, got {raw!r}", field=name
        )
    return value


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    """An integer of at least ``minimum`` from ``name``; ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {raw!r}", field=name)
    return value


def env_bool(name: str, default: bool) -> bool:
    """``0``, ``false``, ``no``, ``off`` or empty are false; anything else is true."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in _FALSE


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port`` as a client dials it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def env_file(name: str, env: Mapping[str, str] | None = None) -> Path | None:
    """A readable file named by ``name``; None when unset (set but empty counts
    as unset)."""
    raw = (os.environ if env is None else env).get(name)
    if not raw:
        return None
    path = Path(raw)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise InvalidArgument(f"{name}: {raw} is not a readable file", field=name)
    return path
