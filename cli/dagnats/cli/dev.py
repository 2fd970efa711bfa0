"""``dagnats dev``: the whole product on one machine.

Starts nats-server from the virtualenv (JetStream, ``sync_interval: always``,
data under ``.dagnats/``), creates the streams and buckets, starts the engine
(its counters for Prometheus on ``--metrics-port``), runs the demo agent
with a worker (and, with ``--handlers``, your handlers in this process:
``dagnats.cli.handlers``), prints what happened, and keeps serving until
Ctrl-C. Data survives restarts, so a second ``dagnats dev`` finds the
runs of the first.

Everything listens on loopback, in plaintext and without credentials, and the
processes it starts talk to each other that way: ``DAGNATS_TOKEN`` and
``DAGNATS_TLS_*`` in the environment are for ``dagnats serve``'s engines and
are not used here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import shlex
import socket
from pathlib import Path
from typing import IO

from dagnats.cli import demo
from dagnats.cli.common import (
    DEFAULT_DATA_DIR,
    DEV_FILE,
    UsageError,
    print_run,
    stop_on_signals,
)
from dagnats.cli.handlers import handlers_from_flags, in_process_worker
from dagnats.core.natsserver import free_port
from dagnats.engine import local_transport
from dagnats.engine.metrics import MetricsEndpoint, serve_metrics
from dagnats.gateway import GatewayConfig
from dagnats.sdk import Client, Credentials, Worker
from dagnats.sdk.models import ChatModel
from dagnats.sdk.testing import LocalStack

# The engine of `dagnats dev` needs none: loopback, plaintext, open.
NO_CREDENTIALS = Credentials()


def _local_socket(data: Path) -> Path | None:
    """Where the services' local socket is: in the data directory, unless
    its path is too long for a socket address (then the calls of workers and
    clients on this host go on gRPC only)."""
    path = local_transport.address(data / "local.sock")
    return None if path is None else Path(path)


def _port_or_free(port: int) -> int:
    """``port`` if a server could listen on it now, else a free one. The probe
    binds as the servers do (``SO_REUSEADDR``), so the connections a stopped
    ``dagnats dev`` left in TIME_WAIT do not move the next one to another port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return free_port()
    return port


async def run_dev(args: argparse.Namespace) -> int:
    stop_on_signals()  # a second Ctrl-C would cancel the gateway's tasks mid-shutdown
    data = Path(args.dev_data_dir or args.data_dir)
    model = None if args.no_demo else _demo_model()  # a bad DAGNATS_MODEL stops us here
    handlers = handlers_from_flags(args.handlers, args.handler_concurrency)
    data.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - before anything runs
    lock = _lock(data)  # held until this process ends
    sessions = _local_socket(data)
    stack = LocalStack(
        store_dir=data / "nats",
        nats_port=_port_or_free(args.nats_port),
        engine_port=_port_or_free(args.engine_port),
        local_socket=sessions,
    )
    workers: list[Worker] = []
    metrics: MetricsEndpoint | None = None
    try:
        await stack.start()
        config = GatewayConfig.from_env(
            stack.target, host="127.0.0.1", port=_port_or_free(args.gateway_port)
        )
        gateway = await stack.start_gateway(
            dataclasses.replace(
                config, client_credentials=NO_CREDENTIALS, worker_credentials=NO_CREDENTIALS
            )
        )
        nats, engine = stack.nats, stack.engine
        metrics = serve_metrics(engine, "127.0.0.1", _port_or_free(args.metrics_port))
        found = {
            "engine": engine.target,
            "nats": nats.url,
            "gateway": gateway.url,
            "metrics": metrics.url,
        }
        if sessions is not None:
            found["local_socket"] = str(sessions)
        (data / DEV_FILE).write_text(json.dumps(found))
        print(f"nats-server  {nats.url}  (data in {data / 'nats'}, sync_interval: always)")
        print(f"engine       {engine.target}  (gRPC)")
        if sessions is not None:
            print(
                f"local socket {sessions}  (workers on this host find it; "
                "docs/how-to/topologies.md says how)"
            )
        else:
            print("local socket none: the data directory's path is too long for one")
        print(f"gateway      {gateway.url}  (HTTP; API at {gateway.url}/docs)")
        print(f"console      {gateway.url}/ui")
        print(f"metrics      {metrics.url}  (the services' counters, for Prometheus)")
        if model is not None:
            print(f"model        {_describe(model)}")
        client = stack.client
        earlier = await client.list_runs(limit=10_000)
        if earlier:
            print(f"found {len(earlier)} earlier run(s); `dagnats run list` shows them")
        if handlers is not None:
            hosted = in_process_worker(engine, handlers, concurrency=args.handler_concurrency)
            workers.append(await hosted.__aenter__())
            print(f"handlers     {', '.join(sorted(handlers))}  (in this process)")
        if not args.no_demo:
            worker = stack.worker({demo.TASK_TYPE: demo.make_agent_turn(model or demo.StandIn())})
            workers.append(await worker.__aenter__())
            await _demo(client, gateway.url, _cli(data))
        if args.exit_after_demo:
            return 0
        print("\nserving; Ctrl-C stops everything", flush=True)
        await asyncio.Event().wait()
        return 0
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                await worker.stop(grace=2.0)
        if metrics is not None:
            metrics.stop()
        await stack.stop()
        close = getattr(model, "aclose", None)
        if close is not None:
            await close()
        lock.close()


def _lock(data: Path) -> IO[str]:
    """The data directory for this process alone: two nats-servers on one
    store would corrupt it.

    Raises:
        UsageError: another ``dagnats dev`` holds it.
    """
    lock = (data / "dev.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise UsageError(
            f"{data} is in use by dagnats dev (pid {holder}); stop it, "
            "or give this one its own --data-dir"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def _demo_model() -> ChatModel:
    try:
        return demo.demo_model()
    except ModuleNotFoundError as err:  # a provider package: the message names the extra
        raise UsageError(f"DAGNATS_MODEL: {err}") from None


def _describe(model: ChatModel) -> str:
    if isinstance(model, demo.StandIn):
        return "the demo's stand-in (set DAGNATS_MODEL and its key for a real one)"
    where = getattr(model, "base_url", None)
    return f"{model.name} at {where}" if where else model.name


def _cli(data: Path) -> str:
    """How the printed commands find this engine: through ``dev.json`` in the
    data directory, named when it is not the default."""
    if data == Path(DEFAULT_DATA_DIR):
        return "dagnats"
    return f"dagnats --data-dir {shlex.quote(str(data))}"


async def _demo(client: Client, gateway_url: str, cli: str) -> None:
    await client.register_workflow(demo.WORKFLOW)
    run = await client.start_run(demo.NAME, {"question": "How warm is it in Lisbon?"})
    print(f"\ndemo: started run {run.run_id} of workflow {run.workflow}")
    run = await client.wait_for_run(run.run_id, timeout=60)
    print_run(run, as_json=False)
    print(
        "\nlook at it with:\n"
        f"  {cli} run get {run.run_id}\n"
        f"  {cli} run get {run.run_id} --json\n"
        f"  {cli} journal read {run.run_id} {demo.STEP_ID}\n"
        f"  {cli} journal check {run.run_id}\n"
        f"  {cli} run list\n"
        f"  curl {gateway_url}/runs/{run.run_id}\n"
        f"  curl {gateway_url}/runs/{run.run_id}/steps/{demo.STEP_ID}/journal"
    )
