"""The services' own counters for Prometheus, on an HTTP port of their own.

The gateway's ``/metrics`` counts the HTTP requests of its process. What the
engine counts (dead letters, refused reports, guesses missed, ...) and what
the local socket carried live in the services' process, so that process
serves them: ``dagnats serve ... --metrics-port N`` (``DAGNATS_METRICS_PORT``)
and ``dagnats dev``. The port answers ``GET /metrics`` in Prometheus' text
format, on the host the services' gRPC port binds, without a token (as the
gateway's ``/metrics``): the counters name events, never a run or its data.

A scrape runs on the HTTP server's thread. It reads the counters as they are
at that instant: a copy of the engine's counter dict, which the GIL makes
whole, and the socket's integers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dagnats.core import errors
from dagnats.core.settings import host_port

if TYPE_CHECKING:
    from dagnats.engine.server import ServiceServer
    from dagnats.journal.meter import UsageMeter


class ServicesCollector(Collector):
    """The counters of one services' server, read at each scrape."""

    def __init__(self, server: ServiceServer) -> None:
        self._server = server

    def describe(self) -> Iterator[Metric]:
        """The families a scrape yields: the names ``/metrics?name[]=...`` selects by."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        engine = getattr(self._server, "engine", None)
        if engine is not None:
            events = CounterMetricFamily(
                "dagnats_engine_events",
                "Events the engine counted since it started, by event "
                "(docs/how-to/operate.md says what each means).",
                labels=["event"],
            )
            for name, count in sorted(dict(engine.counters).items()):
                events.add_metric([name], count)
            yield events
        journal = self._server.journal
        if journal is not None:
            yield from usage_metrics(journal.meter)
        sockets = self._server.local_socket
        if sockets is not None:
            for what, count in (
                ("connections", sockets.accepted),
                ("polls", sockets.polled),
                ("watches", sockets.watched),
            ):
                yield CounterMetricFamily(
                    f"dagnats_local_socket_{what}",
                    f"The local socket's {what} since it started.",
                    value=count,
                )
            yield GaugeMetricFamily(
                "dagnats_local_socket_open",
                "Connections open on the local socket now.",
                value=len(sockets.connections),
            )


def usage_metrics(meter: UsageMeter) -> Iterator[Metric]:
    """What the model calls this journal service stored spent, by workflow
    and model: calls, tokens by kind, and cost in millionths of the price
    table's currency."""
    calls = CounterMetricFamily(
        "dagnats_model_calls",
        "Model calls whose usage the journal recorded, fenced ones included.",
        labels=["workflow", "model"],
    )
    for (workflow, model), count in sorted(meter.calls.items()):
        calls.add_metric([workflow, model], count)
    yield calls
    tokens = CounterMetricFamily(
        "dagnats_model_tokens",
        "Tokens of those calls, by kind: input (cached included), output, cached.",
        labels=["workflow", "model", "kind"],
    )
    for (workflow, model, kind), count in sorted(meter.tokens.items()):
        tokens.add_metric([workflow, model, kind], count)
    yield tokens
    cost = CounterMetricFamily(
        "dagnats_model_cost_micros",
        "Cost of those calls priced by DAGNATS_PRICES, in millionths of its currency.",
        labels=["workflow", "model"],
    )
    for (workflow, model), count in sorted(meter.cost_micros.items()):
        cost.add_metric([workflow, model], count)
    yield cost


@dataclass(slots=True)
class MetricsEndpoint:
    """A serving metrics port; :meth:`stop` closes it."""

    url: str
    _httpd: WSGIServer
    _thread: threading.Thread

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_metrics(server: ServiceServer, host: str, port: int) -> MetricsEndpoint:
    """Serve ``server``'s counters at ``http://host:port/metrics`` (port 0: a
    free one, in the returned URL).

    Raises:
        Unavailable: the port cannot be bound (in use, say).
    """
    registry = CollectorRegistry()
    registry.register(ServicesCollector(server))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise errors.Unavailable(
            f"cannot serve metrics on {host_port(host, port)}: {err.strerror}"
        ) from None
    bound = httpd.server_address[1]
    return MetricsEndpoint(f"http://{host_port(host, bound)}/metrics", httpd, thread)
