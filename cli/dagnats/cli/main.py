"""dagnats: run the product locally, serve a service, manage workflows and runs.

Errors are one line on stderr and a non-zero exit code, never a traceback. A
reader that stops early (``dagnats journal read ... | head``) ends the command
quietly, as it ends any Unix tool: exit code 141, nothing on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from dagnats.cli.approvals import add_approval_commands, run_approvals
from dagnats.cli.common import (
    DEFAULT_DATA_DIR,
    DEV_FILE,
    UsageError,
    dumps,
    print_run,
    print_usage,
    stop_on_signals,
)
from dagnats.cli.journal import RETRY_FOR, add_journal_commands, run_journal
from dagnats.core.errors import DagnatsError, Unavailable
from dagnats.core.ids import check_run_id, check_token, parse_seq
from dagnats.core.natsauth import FLAGS as NATS_FLAGS
from dagnats.core.natsauth import NatsSettings
from dagnats.core.run_settings import parse_assignments
from dagnats.core.settings import DEFAULT_PORTS, SERVICES
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import Credentials, InputMode
from dagnats.sdk.diff import format_diff
from dagnats.sdk.views import enum_name, input_dict, run_dict, usage_dict, workflow_dict

DEFAULT_ENGINE = "127.0.0.1:7233"
# The exit code of a command whose reader closed the pipe (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141

RUN_STATUSES = ("running", "completed", "failed", "cancelled")
# How long `run watch --stream` waits, once the run ended, for the marker that
# ends a stream it showed (a preview is best-effort: the marker may be lost).
MARKER_WAIT = 5.0
# The longest `run start --wait` and `run watch --stream` wait for a run to end.
WAIT_SECONDS = 3600.0


# Set by ``main`` from ``--data-dir``: where ``dagnats dev`` keeps its data and ``dev.json``.
_data_dir = Path(DEFAULT_DATA_DIR)


def port(text: str) -> int:
    """A port flag's value: 0 (a free one) to 65535, or argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def default_target() -> str:
    """``DAGNATS_ENGINE``, else the engine the ``dagnats dev`` of the data
    directory started (its ``dev.json``), else the default."""
    if env := os.environ.get("DAGNATS_ENGINE"):
        return env
    try:
        return str(json.loads((_data_dir / DEV_FILE).read_text())["engine"])
    except (OSError, ValueError, KeyError):
        return DEFAULT_ENGINE


# Where `make docs-serve` serves the documentation site (the Makefile's DOCS_ADDR).
DOCS_URL = "http://127.0.0.1:8000/"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dagnats",
        description=__doc__.splitlines()[0],
        epilog=f"documentation: {DOCS_URL} (make docs-serve in a checkout serves it)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("DAGNATS_DATA_DIR", DEFAULT_DATA_DIR),
        help="the data of `dagnats dev`; the other commands find its engine there "
        "(DAGNATS_DATA_DIR, default .dagnats)",
    )
    for name, what in (
        ("ca", "CA of the engine's certificate"),
        ("cert", "client certificate"),
        ("key", "client certificate's key"),
    ):
        parser.add_argument(
            f"--tls-{name}",
            default=os.environ.get(f"DAGNATS_TLS_{name.upper()}") or None,
            help=f"TLS to the engine: PEM file of the {what} (DAGNATS_TLS_{name.upper()}); "
            "the token is DAGNATS_TOKEN",
        )
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="run nats-server, the services and a demo agent")
    # Its own dest: a subcommand's default would overwrite the global option.
    dev.add_argument(
        "--data-dir", dest="dev_data_dir", default=None, help="where data lives (as above)"
    )
    dev.add_argument("--nats-port", type=port, default=4222, help="NATS port (falls back to free)")
    dev.add_argument("--engine-port", type=port, default=7233, help="engine gRPC port")
    dev.add_argument("--gateway-port", type=port, default=8080, help="HTTP gateway port")
    dev.add_argument(
        "--metrics-port",
        type=port,
        default=9464,
        help="the services' counters for Prometheus, at /metrics",
    )
    dev.add_argument("--no-demo", action="store_true", help="do not run the demo agent")
    dev.add_argument("--exit-after-demo", action="store_true", help="stop after the demo run")
    _with_handler_options(dev)

    serve = sub.add_parser(
        "serve",
        help="serve the engine, the journal or the inputs service, or all three on one port "
        "(against NATS), or the HTTP gateway (against them)",
    )
    serve.add_argument("service", choices=[*SERVICES, "all", "gateway"])
    serve.add_argument(
        "--nats", default=os.environ.get("DAGNATS_NATS_URL", "nats://127.0.0.1:4222")
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--port",
        type=port,
        default=None,
        help="default 7233 (engine, all), 7234 (journal), 7235 (inputs), 8080 (gateway)",
    )
    serve.add_argument("--engine", default=None, help="gateway: engine address (DAGNATS_ENGINE)")
    serve.add_argument(
        "--journal",
        default=os.environ.get("DAGNATS_JOURNAL"),
        help="gateway: journal service address, when it runs apart (DAGNATS_JOURNAL)",
    )
    serve.add_argument(
        "--inputs",
        default=os.environ.get("DAGNATS_INPUTS"),
        help="gateway: inputs service address, when it runs apart (DAGNATS_INPUTS)",
    )
    serve.add_argument(
        "--nats-monitor",
        default=os.environ.get("DAGNATS_NATS_MONITOR"),
        help="nats-server monitoring URL, to check sync_interval at start-up",
    )
    serve.add_argument(
        "--local-socket",
        default=os.environ.get("DAGNATS_LOCAL_SOCKET") or None,
        metavar="PATH",
        help="journal, all: also take the journal's calls (and with the engine, its polls "
        "and watches) on a Unix socket at PATH, for clients on this host (DAGNATS_LOCAL_SOCKET)",
    )
    serve.add_argument(
        "--metrics-port",
        type=port,
        default=os.environ.get("DAGNATS_METRICS_PORT") or None,
        metavar="PORT",
        help="engine, journal, all: serve the services' counters for Prometheus at "
        "http://HOST:PORT/metrics (DAGNATS_METRICS_PORT; 0: a free port)",
    )
    serve.add_argument(
        "--partitions",
        type=int,
        default=None,
        metavar="P",
        help="engine, all: the number of partitions, 1 to 64, fixed when the deployment is "
        "first provisioned (DAGNATS_PARTITIONS; unset: the recorded number, 1 at first)",
    )
    serve.add_argument(
        "--replica-id",
        default=None,
        metavar="ID",
        help="engine, all: this replica's id among those sharing the partitions "
        "(DAGNATS_REPLICA_ID; default random)",
    )
    for setting, (flag, about) in NATS_FLAGS.items():
        serve.add_argument(flag, default=None, help=f"engine: {about} ({setting})")
    _with_handler_options(serve)

    _workflow_commands(sub.add_parser("workflow", help="register and read workflows"))
    _run_commands(sub.add_parser("run", help="start, read, cancel and watch runs"))
    add_journal_commands(sub)
    return parser


def _with_handler_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--handlers",
        default=None,
        metavar="MODULE:ATTR",
        help="run these handlers (a mapping of task type to handler) in this process, "
        "their journal calls answered without gRPC; trusted code only",
    )
    p.add_argument(
        "--handler-concurrency",
        type=int,
        default=16,
        help="most --handlers running at once (default 16)",
    )


def _with_client_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--engine", default=None, help="engine address (default: DAGNATS_ENGINE)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _workflow_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    _with_client_options(sub.add_parser("apply", help="register a YAML or JSON file")).add_argument(
        "file"
    )
    _with_client_options(sub.add_parser("get", help="show a workflow")).add_argument("name")
    validate = sub.add_parser(
        "validate", help="check a YAML or JSON file with the engine's rules, offline"
    )
    validate.add_argument("file")
    validate.add_argument("--json", action="store_true", help="print the definition as JSON")
    _with_client_options(sub.add_parser("list", help="list workflows"))


def _run_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    start = _with_client_options(sub.add_parser("start", help="start a run"))
    start.add_argument("workflow")
    start.add_argument("--input", default=None, help="input as JSON")
    start.add_argument("--idempotency-key", default="")
    start.add_argument("--wait", action="store_true", help="wait for the run to finish")
    start.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting its handlers read",
    )
    start.add_argument(
        "--budget-tokens", type=int, default=0, help="most tokens its model calls may spend"
    )
    start.add_argument(
        "--budget-cost", type=float, default=0.0, help="most cost (price table's currency)"
    )
    start.add_argument("--budget-policy", choices=("fail", "pause"), default="fail")
    fork = _with_client_options(
        sub.add_parser("fork", help="start a new run from a record of a run's journal")
    )
    fork.add_argument("run_id")
    fork.add_argument("--step", required=True, help="the step whose journal to copy")
    fork.add_argument("--at", required=True, help="the last record copied: its sequence")
    fork.add_argument("--input", default=None, help="the new run's input as JSON")
    fork.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="change a setting"
    )
    fork.add_argument("--steer", default=None, help="a steering input (JSON, or text)")
    fork.add_argument("--idempotency-key", default="")
    fork.add_argument("--wait", action="store_true", help="wait for the new run to finish")
    diff = _with_client_options(sub.add_parser("diff", help="two runs' journals side by side"))
    diff.add_argument("run_a")
    diff.add_argument("run_b")
    for name in ("get", "watch", "purge"):
        _with_client_options(sub.add_parser(name, help=f"{name} a run")).add_argument("run_id")
    sub.choices["watch"].add_argument(
        "--stream", action="store_true", help="print the steps' live tokens as they come"
    )
    cancel = _with_client_options(sub.add_parser("cancel", help="cancel a run"))
    cancel.add_argument("run_id")
    cancel.add_argument("--reason", default="")
    upgrade = _with_client_options(
        sub.add_parser("upgrade", help="move a running run to another worker build")
    )
    upgrade.add_argument("run_id")
    upgrade.add_argument("--build", required=True, help="the build its steps go to")
    listing = _with_client_options(sub.add_parser("list", help="list runs"))
    listing.add_argument("--workflow", default="")
    listing.add_argument("--status", choices=RUN_STATUSES, default=None)
    listing.add_argument("--limit", type=int, default=50)
    raising = _with_client_options(
        sub.add_parser("raise-budget", help="raise the budget of a run paused by it (an input)")
    )
    raising.add_argument("run_id")
    raising.add_argument("--step", required=True, help="the step waiting for the raise")
    raising.add_argument("--tokens", type=int, default=0)
    raising.add_argument("--cost", type=float, default=0.0)
    raising.add_argument("--request-id", default="", help="makes a repeat the same input")
    add_approval_commands(sub, _with_client_options)


# ---- output ----------------------------------------------------------------------


# ---- commands ----------------------------------------------------------------------


def credentials(args: argparse.Namespace) -> Credentials:
    """The token (``DAGNATS_TOKEN``) and TLS files the client commands use."""
    env = Credentials.from_env()
    return Credentials(
        token=env.token, ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, tls=env.tls
    )


def _read_file(name: str) -> str:
    try:
        return Path(name).read_text()
    except OSError as err:
        raise UsageError(f"cannot read {name}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {name}: it is not UTF-8 text") from None


def _validate(args: argparse.Namespace) -> int:
    """The engine's own parse and validation, with no engine: the same
    messages ``workflow apply`` would get back."""
    from dagnats.engine.definition import parse_document, to_mapping

    workflow = parse_document(_read_file(args.file))
    if args.json:
        print(dumps(to_mapping(workflow)))
    else:
        print(f"workflow {workflow.name} is valid ({len(workflow.steps)} steps)")
    return 0


async def _workflow(args: argparse.Namespace) -> int:
    from dagnats.sdk import Client

    if args.action == "validate":
        return _validate(args)
    target = args.engine or default_target()
    async with Client(target, retry_for=RETRY_FOR, credentials=credentials(args)) as client:
        if args.action == "apply":
            text = _read_file(args.file)
            workflow = await client.register_workflow(text)
            if args.json:
                print(dumps(workflow_dict(workflow)))
            else:
                print(f"workflow {workflow.name} registered ({len(workflow.steps)} steps)")
        elif args.action == "get":
            print(dumps(workflow_dict(await client.get_workflow(args.name))))
        else:
            workflows = await client.list_workflows()
            if args.json:
                print(dumps([workflow_dict(w) for w in workflows]))
            for w in [] if args.json else workflows:
                print(f"{w.name:<24} {len(w.steps)} steps  version {w.version or '-'}")
    return 0


async def _run(args: argparse.Namespace) -> int:
    from dagnats.sdk import Client

    target = args.engine or default_target()
    async with Client(target, retry_for=RETRY_FOR, credentials=credentials(args)) as client:
        match args.action:
            case "start":
                payload = _parse_input(args.input)
                run = await client.start_run(
                    args.workflow,
                    payload,
                    idempotency_key=args.idempotency_key,
                    settings=parse_assignments(args.set),
                    budget=_budget(args),
                )
                if args.wait:
                    run = await client.wait_for_run(run.run_id, timeout=WAIT_SECONDS)
                print_run(run, args.json)
                return 1 if run.status == pb.RUN_STATUS_FAILED else 0
            case "fork":
                return await _fork(client, args)
            case "diff":
                return await _diff(client, target, args)
            case "get":
                run, usage = await client.get_run_and_usage(args.run_id)
                if args.json:
                    print(dumps({**run_dict(run), "usage": usage_dict(usage)}))
                else:
                    print_run(run, False)
                    print_usage(usage)
            case "raise-budget":
                raised = {k: v for k, v in (("tokens", args.tokens), ("cost", args.cost)) if v}
                if not raised:
                    raise UsageError("give --tokens, --cost or both: what to add to the budget")
                request_id = args.request_id or f"budget-{secrets.token_hex(8)}"
                item, _ = await client.submit_input(
                    args.run_id, args.step, request_id, raised, mode=InputMode.BUDGET
                )
                print(dumps(input_dict(item)) if args.json else f"input {item.request_id} queued")
            case "cancel":
                print_run(await client.cancel_run(args.run_id, args.reason), args.json)
            case "upgrade":
                print_run(await client.upgrade_run(args.run_id, args.build), args.json)
            case "purge":
                await client.purge_run(args.run_id)
                print(f"run {args.run_id} purged")
            case "watch" if args.stream:
                return await _watch_stream(client, target, args.run_id, credentials(args))
            case "watch":
                return await _watch(client, args.run_id, args.json)
            case "approvals" | "approve" | "deny":
                from dagnats.sdk import JournalClient

                creds = credentials(args)
                async with JournalClient(target, retry_for=RETRY_FOR, credentials=creds) as j:
                    return await run_approvals(args, client, j)
            case "list":
                status = (
                    pb.RunStatus.Value(f"RUN_STATUS_{args.status.upper()}") if args.status else None
                )
                runs = await client.list_runs(
                    workflow=args.workflow, status=status, limit=args.limit
                )
                if args.json:
                    print(dumps([run_dict(r) for r in runs]))
                    return 0
                for r in runs:
                    print(f"{r.run_id}  {r.workflow:<20} {enum_name(pb.RunStatus, r.status)}")
    return 0


async def _fork(client: Any, args: argparse.Namespace) -> int:
    """``run fork``: the new run, printed as ``run get`` prints one."""
    steer = None
    if args.steer is not None:
        try:
            steer = json.loads(args.steer)
        except ValueError:
            steer = args.steer  # plain text steers as a JSON string
    answer = await client.fork_run(
        args.run_id,
        check_token(args.step, field="--step"),
        parse_seq(args.at, field="--at"),
        input=_parse_input(args.input),
        settings=parse_assignments(args.set),
        steer=steer,
        idempotency_key=args.idempotency_key,
    )
    run = answer.run
    if args.wait:
        run = await client.wait_for_run(run.run_id, timeout=WAIT_SECONDS)
    if not args.json:
        print(f"forked from run {args.run_id} step {args.step} at seq {args.at}: ", end="")
        print(f"{answer.copied} records copied")
    print_run(run, args.json)
    return 1 if run.status == pb.RUN_STATUS_FAILED else 0


async def _diff(client: Any, target: str, args: argparse.Namespace) -> int:
    """``run diff``: each step's entries in common, then the rest side by side."""
    from dagnats.gateway.rundiff import run_diff
    from dagnats.sdk import JournalClient

    run_a = check_run_id(args.run_a, field="run_a")
    run_b = check_run_id(args.run_b, field="run_b")
    creds = credentials(args)
    async with JournalClient(target, retry_for=RETRY_FOR, credentials=creds) as journal:
        found = await run_diff(client, journal, run_a, run_b)
    if args.json:
        print(dumps(found))
        return 0
    print(format_diff(found))
    return 0


def _budget(args: argparse.Namespace) -> Any:
    """``run start``'s budget, or None when it set no bound."""
    if not args.budget_tokens and not args.budget_cost:
        return None
    from dagnats.sdk import Budget

    return Budget(tokens=args.budget_tokens, cost=args.budget_cost, policy=args.budget_policy)


def _parse_input(raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError as err:
        raise UsageError(f"--input is not valid JSON: {err}") from None


async def _watch(client: Any, run_id: str, as_json: bool) -> int:
    """Print the run each time it changes until it ends."""
    run = None
    async for run in client.watch_run(run_id):
        if as_json:
            print(json.dumps(run_dict(run), ensure_ascii=False), flush=True)
        else:
            print_run(run, False)
            print(flush=True)
    return 1 if run is not None and run.status == pb.RUN_STATUS_FAILED else 0


async def _watch_stream(client: Any, target: str, run_id: str, creds: Credentials) -> int:
    """Print the live tokens of the run's steps until the run ends: tokens as
    they come, a marker line when a stream is committed or abandoned."""
    from dagnats.sdk import JournalClient

    run = await client.get_run(run_id)
    waiting = len(run.steps)
    # Streams shown and not yet ended by a marker: the run's end can arrive
    # before the marker of the model response that led to it.
    open_streams: set[tuple[str, str, int]] = set()
    ended = asyncio.Event()

    async def follow(journal: JournalClient, step_id: str) -> None:
        nonlocal waiting
        async for event_id, data in journal.watch_stream(run_id, step_id):
            kind = data.get("type")
            if not event_id:  # subscribed
                waiting -= 1
                if not waiting:
                    print(f"watching run {run_id}", file=sys.stderr, flush=True)
                continue
            stream = (step_id, str(data.get("writer")), int(data.get("position", -1)))
            if kind in ("token", "gap"):
                open_streams.add(stream)
                ended.clear()
            elif kind in ("committed", "abandoned"):
                open_streams.discard(stream)
                if not open_streams:
                    ended.set()
            if kind == "token":
                if data.get("seq") == 1 and "retry_of" in data:
                    print(f"\n[{step_id}: retry of {data['retry_of']}]", flush=True)
                text = data.get("text")
                print(text if text is not None else dumps(data.get("json")), end="", flush=True)
            elif kind == "gap":
                print(f"[{step_id}: {data['dropped']} chunks not shown]", end="", flush=True)
            elif kind == "committed":
                print(f"\n[{step_id}: committed, record {data['record_seq']}]", flush=True)
            elif kind == "abandoned":
                print(f"\n[{step_id}: abandoned ({data['reason']})]", flush=True)

    async with JournalClient(target, retry_for=RETRY_FOR, credentials=creds) as journal:
        tasks = [asyncio.create_task(follow(journal, s.step_id)) for s in run.steps]
        try:
            run = await client.wait_for_run(run_id, timeout=WAIT_SECONDS)
            if open_streams:  # its last marker is on its way, or was lost
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ended.wait(), MARKER_WAIT)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    print(f"\nrun {run_id} {enum_name(pb.RunStatus, run.status)}", flush=True)
    return 1 if run.status == pb.RUN_STATUS_FAILED else 0


def _require_server(command: str) -> None:
    """One line naming the extra, when the services are not installed."""
    from dagnats.core.extras import MissingExtra, require_server

    try:
        require_server(command)
    except MissingExtra as err:
        raise UsageError(str(err)) from None


async def _serve(args: argparse.Namespace) -> int:
    _require_server(f"dagnats serve {args.service}")
    stop_on_signals()  # a stopped container's SIGTERM stops the server in order
    from dagnats.cli.handlers import NEEDS_BOTH, handlers_from_flags, in_process_worker

    if args.handlers is not None and args.service != "all":
        raise UsageError(NEEDS_BOTH)
    if args.local_socket is not None and args.service not in ("journal", "all"):
        raise UsageError("--local-socket needs the journal: dagnats serve journal or all")
    if args.metrics_port is not None and args.service not in ("engine", "journal", "all"):
        raise UsageError(
            "--metrics-port serves the engine's and the journal's counters: "
            "dagnats serve engine, journal or all (the gateway has its own /metrics)"
        )
    if args.service == "gateway":
        return await _serve_gateway(args)
    from dagnats.core.jetstream import Topology
    from dagnats.engine.config import ReplicaConfig
    from dagnats.engine.metrics import MetricsEndpoint, serve_metrics
    from dagnats.engine.security import ServerSecurity
    from dagnats.engine.server import start_services

    services = SERVICES if args.service == "all" else (args.service,)
    replica = ReplicaConfig.from_env(partitions=args.partitions, replica_id=args.replica_id)
    handlers = handlers_from_flags(args.handlers, args.handler_concurrency)
    replicas = int(os.environ.get("DAGNATS_REPLICAS", "1"))
    server = await start_services(
        args.nats,
        services=services,
        host=args.host,
        port=DEFAULT_PORTS[services[0]] if args.port is None else args.port,
        topology=Topology(replicas=replicas),
        monitor_url=args.nats_monitor,
        security=ServerSecurity.from_env(),
        nats_settings=_nats_settings(args),
        own_port=handlers is not None,
        local_socket=Path(args.local_socket) if args.local_socket else None,
        replica=replica,
    )
    print(f"{' and '.join(server.services)} serving on {server.target}", flush=True)
    if server.local_socket is not None:
        print(f"local socket on {server.local_socket.path}", flush=True)
    metrics: MetricsEndpoint | None = None
    try:
        if args.metrics_port is not None:
            metrics = serve_metrics(server, args.host, args.metrics_port)
            print(f"metrics on {metrics.url}", flush=True)
        async with contextlib.AsyncExitStack() as hosted:
            if handlers is not None:
                worker = in_process_worker(server, handlers, concurrency=args.handler_concurrency)
                await hosted.enter_async_context(worker)
                print(f"handlers {', '.join(sorted(handlers))} in this process", flush=True)
            await asyncio.Event().wait()
    finally:
        if metrics is not None:
            metrics.stop()
        await server.stop()
    return 0


def _nats_settings(args: argparse.Namespace) -> NatsSettings:
    """The ``DAGNATS_NATS_*`` settings, each flag given in place of its variable."""
    flags = {s: getattr(args, f.lstrip("-").replace("-", "_")) for s, (f, _) in NATS_FLAGS.items()}
    return NatsSettings.from_env({**os.environ, **{s: v for s, v in flags.items() if v}})


async def _serve_gateway(args: argparse.Namespace) -> int:
    from dagnats.gateway import GatewayConfig, start_gateway
    from dagnats.gateway.config import DEFAULT_PORT

    config = GatewayConfig.from_env(
        args.engine or default_target(),
        host=args.host,
        port=DEFAULT_PORT if args.port is None else args.port,
        journal_target=args.journal,
        inputs_target=args.inputs,
    )
    server = await start_gateway(config)
    print(f"gateway serving on {server.url} (engine {config.engine_target})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
    return 0


async def _journal(args: argparse.Namespace) -> int:
    return await run_journal(args, args.engine or default_target(), credentials(args))


async def _dev(args: argparse.Namespace) -> int:
    _require_server("dagnats dev")
    from dagnats.cli.dev import run_dev

    return await run_dev(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "dev": _dev,
    "serve": _serve,
    "workflow": _workflow,
    "run": _run,
    "journal": _journal,
}


def _where(args: argparse.Namespace) -> str:
    """Which engine a command could not reach, and how it was chosen."""
    if args.command in ("dev", "serve") or isinstance(getattr(args, "engine", None), str):
        return ""
    if os.environ.get("DAGNATS_ENGINE"):
        return f" (engine {default_target()}, from DAGNATS_ENGINE)"
    dev_json = _data_dir / DEV_FILE
    if dev_json.exists():
        return f" (engine {default_target()}, from {dev_json}: is that dagnats dev still running?)"
    return (
        f" (engine {DEFAULT_ENGINE}: there is no {dev_json}; start `dagnats dev`, or name "
        "the engine with --data-dir, DAGNATS_ENGINE or --engine)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader left (``| head``). Later writes, the interpreter's final
        # flush included, go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    global _data_dir
    args = build_parser().parse_args(argv)
    _data_dir = Path(args.data_dir)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = asyncio.run(COMMANDS[args.command](args))
        sys.stdout.flush()  # here, so a closed pipe is noticed inside main
        return code
    except Unavailable as err:
        print(f"error: {err}{_where(args)}", file=sys.stderr)
        return 1
    except (DagnatsError, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


if __name__ == "__main__":
    # ``python -m`` runs this file as ``__main__``; the commands import
    # ``dagnats.cli.main``, whose UsageError is the one they raise.
    from dagnats.cli import main as cli

    sys.exit(cli.main())
