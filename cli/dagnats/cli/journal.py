"""``dagnats journal check`` and ``dagnats journal read``: the journal from a terminal.

``check`` prints the audit of a run's journal (one line per violation, then a
summary) and exits 1 on any violation. ``read`` prints a step's records, one
line each, or one JSON object per line with ``--json``; ``--follow`` keeps
printing records as they are written, until interrupted.

The journal service is reached through :class:`JournalClient`, a small client
of its own (not ``dagnats.sdk``, whose workers speak to the journal through the
task API); failed calls become the domain error the service raised.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import grpc
import grpc.aio
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from dagnats.core import errors
from dagnats.core.grpcutil import error_from_rpc
from dagnats.core.tracing import client_interceptors
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.journal.v1 import journal_pb2_grpc

if TYPE_CHECKING:
    from dagnats.journal.v1.journal_pb2_grpc import JournalServiceAsyncStub

# Records per Read page when not following; a shorter page is the last one.
PAGE = 500
# How much of a payload a record's one-line summary shows.
PREVIEW = 60


class JournalClient:
    """Calls the journal service's read-only methods.

    Use it as ``async with JournalClient(target) as journal:``. The channel
    opens on the first call, so that it belongs to the running event loop.

    Args:
        target: Address of the journal service, such as ``"localhost:7233"``.
        timeout: Deadline of one call (of one page, for ``read``), in seconds.

    Every method raises the domain error the service answered with
    (``NotFound``, ``InvalidArgument``, ``Unavailable``, ...).
    """

    def __init__(self, target: str, *, timeout: float = 30.0) -> None:
        self._target = target
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: JournalServiceAsyncStub | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(None)

    async def check(self, run_id: str) -> pb.CheckResponse:
        """Audit the journal of a run.

        Returns:
            The violations and how many steps and records were checked.
        """
        try:
            return await self._connect().Check(
                pb.CheckRequest(run_id=run_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as err:
            raise self._domain_error(err) from None

    async def read(
        self, run_id: str, step_id: str, *, from_seq: int = 0, follow: bool = False
    ) -> AsyncIterator[pb.Record]:
        """Yield a step's records from ``from_seq`` on, in sequence order.

        Without ``follow`` it ends at the tail; with it, it waits for new
        records until the caller stops iterating.
        """
        if follow:
            request = pb.ReadRequest(run_id=run_id, step_id=step_id, from_seq=from_seq, follow=True)
            async for record in self._stream(request, deadline=None):
                yield record
            return
        while True:
            request = pb.ReadRequest(run_id=run_id, step_id=step_id, from_seq=from_seq, limit=PAGE)
            count = 0
            async for record in self._stream(request, deadline=self._timeout):
                count += 1
                from_seq = record.seq + 1
                yield record
            if count < PAGE:
                return

    async def _stream(
        self, request: pb.ReadRequest, *, deadline: float | None
    ) -> AsyncIterator[pb.Record]:
        call = self._connect().Read(request, timeout=deadline)
        try:
            async for response in call:
                yield response.record
        except grpc.aio.AioRpcError as err:
            raise self._domain_error(err) from None
        finally:
            call.cancel()  # a no-op once the stream ended; stops it if the caller left early

    def _connect(self) -> JournalServiceAsyncStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                self._target, interceptors=client_interceptors()
            )
            self._stub = journal_pb2_grpc.JournalServiceStub(self._channel)
        return self._stub

    def _domain_error(self, err: grpc.aio.AioRpcError) -> errors.DagnatsError:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            # A server without the journal service (an engine served on its own).
            return errors.Unavailable(f"{self._target} does not serve the journal service")
        return error_from_rpc(err)


# ---- commands ----------------------------------------------------------------------


def add_journal_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``journal check`` and ``journal read`` to the ``dagnats`` parser.

    Both take ``--engine`` (the address that serves the journal; the caller
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
    read.add_argument("--follow", action="store_true", help="keep printing new records")


async def run_journal(args: argparse.Namespace, target: str) -> int:
    """Run ``journal check`` or ``journal read``; returns the exit code.

    Raises:
        DagnatsError: the journal service failed the call.
    """
    async with JournalClient(target) as journal:
        if args.action == "check":
            return await _check(journal, args.run_id, as_json=args.json)
        return await _read(
            journal,
            args.run_id,
            args.step_id,
            from_seq=args.from_seq,
            follow=args.follow,
            as_json=args.json,
        )


def _with_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--engine", default=None, help="engine address (default: DAGNATS_ENGINE)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _sequence(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a sequence number is not negative: {value}")
    return value


async def _check(journal: JournalClient, run_id: str, *, as_json: bool) -> int:
    response = await journal.check(run_id)
    if as_json:
        print(json.dumps(_as_dict(response), indent=2))
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
    journal: JournalClient,
    run_id: str,
    step_id: str,
    *,
    from_seq: int,
    follow: bool,
    as_json: bool,
) -> int:
    async for record in journal.read(run_id, step_id, from_seq=from_seq, follow=follow):
        print(json.dumps(record_dict(record)) if as_json else record_line(record), flush=follow)
    return 0


# ---- one record ----------------------------------------------------------------------


def record_line(record: pb.Record) -> str:
    """``  14  2/1  tool_intent  charge {"amount": 5} unsafe  (writer 3f9a...)``."""
    kind = record.WhichOneof("kind") or "unknown"
    return (
        f"{record.seq:>6}  {record.iteration}/{record.attempt:<3} {kind:<11}  "
        f"{_summary(record)}  (writer {record.writer})"
    )


def _summary(record: pb.Record) -> str:
    match record.WhichOneof("kind"):
        case "claim":
            c = record.claim
            return f"worker {c.worker_id or '-'} delivery {c.delivery}"
        case "model":
            return f"#{record.model.position} {_preview(record.model.response)}"
        case "tool_intent":
            i = record.tool_intent
            safety = "safe" if i.replay == pb.REPLAY_SAFE else "unsafe"
            honours = f" honours seq {i.honours_seq}" if i.honours_seq else ""
            return f"#{i.position} {i.name} {_preview(i.input)} {safety}{honours}"
        case "tool_output":
            o = record.tool_output
            return f"intent {o.intent_seq}: {_shorten(json.dumps(o.chunk))}"
        case "tool_result":
            return _result_summary(record.tool_result)
        case "commit":
            return _commit_summary(record.commit)
    return "-"


def _result_summary(r: pb.ToolResult) -> str:
    if r.interrupted:
        partial = f" after {_shorten(json.dumps(r.partial))}" if r.partial else ""
        return f"intent {r.intent_seq}: interrupted{partial}"
    if r.error:
        return f"intent {r.intent_seq}: error {_shorten(json.dumps(r.error))}"
    return f"intent {r.intent_seq}: {_preview(r.output)}"


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
    if c.has_state:
        parts.append("with state")
    return " ".join(parts)


def record_dict(record: pb.Record) -> dict[str, Any]:
    """A record as JSON, its JSON payloads decoded rather than base64."""
    data = _as_dict(record)
    for kind, field in _JSON_PAYLOADS:
        if kind in data and field in data[kind]:
            data[kind][field] = _decode(getattr(getattr(record, kind), field))
    return data


_JSON_PAYLOADS = (
    ("model", "response"),
    ("tool_intent", "input"),
    ("tool_result", "output"),
    ("commit", "state"),
    ("commit", "output"),
)


def _as_dict(message: Message) -> dict[str, Any]:
    # Zero values printed too: a script reading iteration 0 should not find it missing.
    return MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _preview(raw: bytes) -> str:
    if not raw:
        return "-"
    try:
        text = json.dumps(json.loads(raw), separators=(",", ":"))
    except ValueError:
        text = raw.decode(errors="replace")
    return _shorten(text)


def _shorten(text: str) -> str:
    return text if len(text) <= PREVIEW else text[: PREVIEW - 3] + "..."


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
