"""``--handlers module:attr``: handlers run in the services' own process.

``dagnats serve all`` and ``dagnats dev`` can run a worker for the handlers
named by ``module:attr`` (a mapping of task type to handler) in their own
process (ADR 44). Its journal calls are answered by the journal servicer of
that process, in the handler's task, with the same checks, fences and errors
as over gRPC, and no gRPC between them; its engine calls (poll, heartbeat,
report) go to the process's own loopback port (``start_services(own_port=
True)``) with a worker token minted in the process, so it needs none of the
operator's certificates or tokens.

The handlers share the services' process, its memory and its event loop, so
they must be code trusted as much as the services: a handler that blocks the
loop stalls every journal call of the process (run CPU-bound work in a
thread). Workers in their own processes stay the default, and the only way
for code in other languages or code that must not share the process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagnats.cli.common import UsageError, load_handlers
from dagnats.engine.server import ServiceServer
from dagnats.sdk import Credentials, Handler, Worker

MAX_CONCURRENCY = 10_000
NEEDS_BOTH = "--handlers needs the engine and the journal in this process: dagnats serve all"


def handlers_from_flags(spec: str | None, concurrency: int) -> dict[str, Handler] | None:
    """``--handlers`` and ``--handler-concurrency`` checked before anything
    starts: the handlers, or None without ``--handlers``.

    Raises:
        UsageError: either flag is out of range (see :func:`load_handlers`).
    """
    if spec is None:
        return None
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise UsageError(f"--handler-concurrency must be 1..{MAX_CONCURRENCY}, got {concurrency}")
    return load_handlers(spec)


def in_process_worker(
    server: ServiceServer,
    handlers: Mapping[str, Handler],
    *,
    concurrency: int,
    **options: Any,
) -> Worker:
    """A worker of ``server``'s engine whose journal calls are answered by
    ``server``'s journal servicer in this process, and whose other calls go
    to the server's own port (``start_services(own_port=True)``); start it
    with ``async with`` or ``await worker.__aenter__()``, stop it before
    ``server``. ``options`` go to :class:`~dagnats.sdk.Worker`.

    Raises:
        UsageError: ``server`` does not serve both the engine and the journal,
            or needs credentials and was started without ``own_port``.
        InvalidArgument: a task type or the concurrency is out of range.
    """
    journal = server.journal
    if journal is None or "engine" not in server.services:
        raise UsageError(NEEDS_BOTH)
    if server.own is None:
        raise UsageError("a server that needs credentials runs handlers with own_port=True")
    return Worker(
        server.own.target,
        handlers=handlers,
        concurrency=concurrency,
        credentials=Credentials(token=server.own.token),
        journal_sessions=server.local_session,
        **options,
    )
