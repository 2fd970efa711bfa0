"""``dagnats journal check``, ``read``, ``export`` and ``replay``: the journal from a terminal.

``check`` prints the audit of a run's journal (one line per violation, then a
summary) and exits 1 on any violation. ``read`` prints a step's records, one
line each, or one JSON object per line with ``--json``; ``--follow`` keeps
printing records as they are written, until the step has finished and every
record was printed (``dagnats.sdk.follow``, as the HTTP API's event stream).

The journal service is reached through ``dagnats.sdk.JournalClient``; the
JSON is ``dagnats.sdk.views.record_dict``, the same as the HTTP API's.

``export`` writes a run's journal export (``dagnats.sdk.export``: JSON lines,
the same bytes as the HTTP API's ``GET /runs/{run_id}/journal/export``) to a
file or standard output. ``replay`` runs the handlers ``--handlers
module:attr`` names against exported journals, or a deployment's runs
(``--run``, ``--workflow``), with ``dagnats.sdk.testing.replay``: a line per
divergence, then a summary; it exits 1 on any divergence, so CI can run it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from dagnats.cli.common import UsageError, load_handlers
from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_run_id, parse_seq
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.sdk import Client, Credentials, JournalClient
from dagnats.sdk.export import open_export
from dagnats.sdk.follow import follow_step
from dagnats.sdk.testing import Deployment, ReplayReport, replay
from dagnats.sdk.views import check_dict, record_dict

# A person at a terminal is told within seconds that the engine is not there;
# a restart of a few seconds is still ridden out.
RETRY_FOR = 5.0

# How much of a payload a record's one-line summary shows.
PREVIEW = 60
# Runs of a workflow ``journal replay --workflow`` replays at most.
MAX_REPLAY_RUNS = 1000


# ---- commands ----------------------------------------------------------------------


def add_journal_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``journal check``, ``read``, ``export`` and ``replay`` to the
    ``dagnats`` parser.

    Each takes ``--engine`` (the address that serves the journal; the caller
    resolves the default) and ``--json``.
    """
    parser = sub.add_parser("journal", help="audit and read step journals")
    actions = parser.add_subparsers(dest="action", required=True)
    check = _with_options(actions.add_parser("check", help="audit the journal of a run"))
    check.add_argument("run_id")
    read = _with_options(actions.add_parser("read", help="print a step's journal records"))
    read.add_argument("run_id")
    read.add_argument("step_id")
    read.add_argument(
        "--from", dest="from_seq", type=_sequence, default=0, help="first sequence to print"
    )
    read.add_argument(
        "--follow", action="store_true", help="keep printing new records until the step finishes"
    )
    export = _with_options(
        actions.add_parser("export", help="write a run's journal to a file (JSON lines)")
    )
    export.add_argument("run_id")
    export.add_argument(
        "-o", "--output", default="-", help="the file to write (default: standard output)"
    )
    replaying = _with_options(
        actions.add_parser(
            "replay",
            help="replay handlers against recorded journals; exit 1 on a divergence",
        )
    )
    replaying.add_argument(
        "files", nargs="*", metavar="FILE", help="journal exports, or directories of *.jsonl"
    )
    replaying.add_argument(
        "--handlers",
        required=True,
        metavar="MODULE:ATTR",
        help="the new code: a mapping of task type to handler",
    )
    replaying.add_argument(
        "--run", dest="runs", action="append", default=[], help="a run of the deployment"
    )
    replaying.add_argument("--workflow", default="", help="the deployment's newest runs of this")
    replaying.add_argument(
        "--limit", type=int, default=100, help=f"runs of --workflow (1-{MAX_REPLAY_RUNS})"
    )


async def run_journal(args: argparse.Namespace, target: str, credentials: Credentials) -> int:
    """Run ``journal check`` or ``journal read``; returns the exit code.

    Raises:
        DagnatsError: the journal service failed the call.
    """
    if args.action == "replay":
        return await _replay(args, target, credentials)
    async with JournalClient(target, retry_for=RETRY_FOR, credentials=credentials) as journal:
        if args.action == "export":
            async with Client(target, retry_for=RETRY_FOR, credentials=credentials) as client:
                return await _export(client, journal, args.run_id, args.output)
        if args.action == "check":
            return await _check(journal, args.run_id, as_json=args.json)
        if args.follow:
            async with Client(target, retry_for=RETRY_FOR, credentials=credentials) as client:
                return await _follow(client, journal, args, as_json=args.json)
        return await _read(journal, args.run_id, args.step_id, args.from_seq, as_json=args.json)


def _with_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--engine", default=None, help="engine address (default: DAGNATS_ENGINE)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _sequence(text: str) -> int:
    try:
        return parse_seq(text, field="--from")
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(err.message) from None


async def _check(journal: JournalClient, run_id: str, *, as_json: bool) -> int:
    response = await journal.check(run_id)
    if as_json:
        print(json.dumps(check_dict(response), indent=2))
    else:
        for line in check_lines(run_id, response):
            print(line)
    return 1 if response.violations else 0


def check_lines(run_id: str, response: pb.CheckResponse) -> list[str]:
    """The human output of ``journal check``: each violation, then a summary."""
    lines = []
    for v in response.violations:
        at = f"  seq {v.seq}" if v.seq else ""
        lines.append(f"step {v.step_id}{at}  {v.rule}: {v.message}")
    lines.append(
        f"journal of run {run_id}: {_plural(response.steps, 'step')}, "
        f"{_plural(response.records, 'record')}, "
        f"{_plural(len(response.violations), 'violation')}"
    )
    return lines


async def _read(
    journal: JournalClient, run_id: str, step_id: str, from_seq: int, *, as_json: bool
) -> int:
    async for record in journal.read(run_id, step_id, from_seq=from_seq):
        print(json.dumps(record_dict(record)) if as_json else record_line(record))
    return 0


async def _follow(
    client: Client, journal: JournalClient, args: argparse.Namespace, *, as_json: bool
) -> int:
    follow = follow_step(client, journal, args.run_id, args.step_id, from_seq=args.from_seq)
    async for item in follow:
        if isinstance(item, pb.Record):
            print(json.dumps(record_dict(item)) if as_json else record_line(item), flush=True)
    return 0


async def _export(client: Client, journal: JournalClient, run_id: str, output: str) -> int:
    """Write the export to ``output`` ("-": standard output); a file is
    written beside it first and renamed once whole, so a failed export
    leaves no file that looks whole."""
    export = await open_export(client, journal, check_run_id(run_id))
    with _output(output) as out:
        async for line in export.lines(journal):
            out.write(line)
    return 0


@contextlib.contextmanager
def _output(output: str) -> Iterator[TextIO]:
    if output == "-":
        yield sys.stdout
        return
    path = Path(output)
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            yield out
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


async def _replay(args: argparse.Namespace, target: str, credentials: Credentials) -> int:
    handlers = load_handlers(args.handlers)
    if not args.files and not args.runs and not args.workflow:
        raise UsageError("journal replay needs exported FILEs, --run or --workflow")
    if not 1 <= args.limit <= MAX_REPLAY_RUNS:
        raise UsageError(f"--limit must be 1..{MAX_REPLAY_RUNS}, got {args.limit}")
    reports: list[ReplayReport] = []
    if args.files:
        reports.append(await replay(args.files, handlers))
    if args.runs or args.workflow:
        runs = [check_run_id(r, field="--run") for r in args.runs]
        where = Deployment(
            target, run_ids=runs, workflow=args.workflow, limit=args.limit, credentials=credentials
        )
        reports.append(await replay(where, handlers))
    divergences = [d for r in reports for d in r.divergences]
    if args.json:
        print(json.dumps(_report_dict(reports), indent=2))
    else:
        for report in reports:
            for line in report.lines():
                print(line)
    return 1 if divergences else 0


def _report_dict(reports: list[ReplayReport]) -> dict[str, Any]:
    """The reports as one JSON object: the counts, and each divergence."""
    return {
        "runs": sum(r.runs for r in reports),
        "dispatches": sum(r.dispatches for r in reports),
        "unfinished": sum(r.unfinished for r in reports),
        "skipped": [s for r in reports for s in r.skipped],
        "divergences": [dataclasses.asdict(d) for r in reports for d in r.divergences],
    }


# ---- one record ----------------------------------------------------------------------


def record_line(record: pb.Record) -> str:
    """``  14  2/1  tool_intent  charge {"amount": 5} unsafe  (writer 3f9a...)``;
    a record that holds more than one entry is a line each, with the same sequence."""
    kind = record.WhichOneof("kind") or "unknown"
    leading = record.WhichOneof("leading")
    entries: list[tuple[str, Any]] = []
    if record.HasField("leading_claim"):
        entries.append(("claim", record.leading_claim))
    if leading:
        entries.append((leading.removeprefix("leading_"), getattr(record, leading)))
    if kind == "tool_intents":  # a parallel group: a line per call, in the response's order
        group = record.tool_intents
        entries += [(f"tool_intent[{i}]", intent) for i, intent in enumerate(group.intents)]
    else:
        entries.append((kind, getattr(record, kind) if kind != "unknown" else None))
    return "\n".join(
        f"{record.seq:>6}  {record.iteration}/{record.attempt:<3} {name:<11}  "
        f"{_summary(name, body)}  (writer {record.writer})"
        for name, body in entries
    )


def _summary(kind: str, body: Any) -> str:
    match kind:
        case "claim":
            return f"worker {body.worker_id or '-'} delivery {body.delivery}"
        case "model":
            return f"#{body.position} {_preview(body.response)}"
        case "tool_intent" | str() if kind.startswith("tool_intent["):
            safety = "safe" if body.replay == pb.REPLAY_SAFE else "unsafe"
            honours = f" honours seq {body.honours_seq}" if body.honours_seq else ""
            return f"#{body.position} {body.name} {_preview(body.input)} {safety}{honours}"
        case "tool_output":
            return f"intent {_intent(body)}: {_shorten(json.dumps(body.chunk))}"
        case "tool_result":
            return _result_summary(body)
        case "commit":
            return _commit_summary(body)
        case "cancel":
            return _shorten(json.dumps(body.reason))
        case "fork":
            return (
                f"{body.copied} records copied from run {body.run_id} step {body.step_id} "
                f"through seq {body.at_seq}"
            )
    return "-"


def _intent(body: pb.ToolResult | pb.ToolOutput) -> str:
    """``14``, or ``14[2]`` for the third call of a parallel group's record."""
    return f"{body.intent_seq}[{body.intent_index}]" if body.intent_index else str(body.intent_seq)


def _result_summary(r: pb.ToolResult) -> str:
    if r.interrupted:
        partial = f" after {_shorten(json.dumps(r.partial))}" if r.partial else ""
        return f"intent {_intent(r)}: interrupted{partial}"
    if r.error:
        return f"intent {_intent(r)}: error {_shorten(json.dumps(r.error))}"
    return f"intent {_intent(r)}: {_preview(r.output)}"


def _commit_summary(c: pb.Commit) -> str:
    action = pb.Action.Name(c.action).removeprefix("ACTION_").lower()
    parts = [action]
    if c.action == pb.ACTION_PAUSE:
        parts.append(f"{c.pause.ToTimedelta().total_seconds():g}s")
    if c.reason:
        parts.append(f"reason {c.reason}")
    if c.error:
        parts.append(f"error {_shorten(json.dumps(c.error))}")
    if c.output:
        parts.append(f"output {_preview(c.output)}")
    if c.HasField("state_delta"):
        d = c.state_delta
        parts.append(f"with state delta +{len(d.tail):,} bytes after {d.keep:,}, {d.size:,} in all")
    elif c.has_state:
        parts.append("with state")
    return " ".join(parts)


def _preview(raw: bytes) -> str:
    if not raw:
        return "-"
    try:
        text = json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        text = raw.decode(errors="replace")
    return _shorten(text)


def _shorten(text: str) -> str:
    return text if len(text) <= PREVIEW else text[: PREVIEW - 3] + "..."


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
