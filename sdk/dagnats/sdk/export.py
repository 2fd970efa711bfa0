"""A run's journal as a file: the journal export, written and read.

The export is JSON lines, one JSON object per line, UTF-8:

1. **The header**: ``format`` (``"dagnats.journal"``), ``version`` (1),
   ``run_id``, ``workflow`` and ``workflow_version``, the run's ``status``,
   ``input`` (its JSON value), ``settings`` (the run settings its handlers
   read as ``tc.settings``; absent from an older export: none) and
   ``error``, and ``steps``: for each step
   of the run, in definition order, its ``step_id``, ``task_type`` (empty
   for a sub-workflow step), ``input`` (the JSON value its handler reads as
   ``tc.input``), ``status`` and ``journaled`` (whether it has records below).
2. **A line per record**, step after step in the header's order, each step's
   in sequence order: ``step_id``, ``seq`` (the record's stream sequence) and
   ``record``, the ``dagnats.journal.v1.Record`` as protobuf JSON (field names
   as in the .proto; ``bytes`` fields in base64).
3. **The end**: ``{"end": true, "records": N}``. A file without it was cut
   short, and is refused.

Nothing in it depends on when it was written: a run that has ended exports
to the same bytes every time.

A reader ignores fields it does not know, in the header and in records
(protobuf JSON's ``ignore_unknown_fields``): a newer writer's additions do
not stop an older reader. A new ``version`` is a change a reader of the old
one cannot read; it refuses it, naming both.

:func:`open_export` reads what the header needs and checks that the run has a
journal before a line is written, so a missing run or a run without one is an
error, not an empty file; :meth:`Export.lines` then reads the records page by
page (``JournalClient.read``), so a large journal streams. ``dagnats journal
export`` and the HTTP API's ``GET /runs/{run_id}/journal/export`` write the
same lines; :func:`read_export` reads them back, for
``dagnats.sdk.testing.replay``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from dagnats.core.errors import InvalidArgument, NotFound
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._client import Client
from dagnats.sdk._journal_client import JournalClient
from dagnats.sdk.views import decode_payload, enum_name

FORMAT = "dagnats.journal"
VERSION = 1
MEDIA_TYPE = "application/x-ndjson"


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportedStep:
    """One step of an exported run: what its handler was given, and its records."""

    step_id: str
    task_type: str
    input: Any
    status: str
    records: tuple[jpb.Record, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportedRun:
    """A run as its journal export holds it (:func:`read_export`)."""

    run_id: str
    workflow: str
    status: str
    input: Any
    steps: tuple[ExportedStep, ...]
    source: str = ""
    # The run's settings its handlers read (``tc.settings``).
    settings: Mapping[str, str] = field(default_factory=dict)

    @property
    def records(self) -> int:
        """How many records the export holds, every step's."""
        return sum(len(step.records) for step in self.steps)


@dataclass(frozen=True, slots=True)
class Export:
    """A run's export, its header read: :meth:`lines` writes it."""

    header: Mapping[str, Any]
    journaled: tuple[str, ...]

    async def lines(self, journal: JournalClient) -> AsyncIterator[str]:
        """The export's lines, each ending in a newline: the header, each
        journaled step's records read page by page, then the end line."""
        run_id = str(self.header["run_id"])
        yield _line(self.header)
        count = 0
        for step_id in self.journaled:
            async for record in journal.read(run_id, step_id):
                count += 1
                yield _line({"step_id": step_id, "seq": record.seq, "record": _record_json(record)})
        yield _line({"end": True, "records": count})


async def open_export(client: Client, journal: JournalClient, run_id: str) -> Export:
    """The export of ``run_id``'s journal, ready to write.

    Raises:
        NotFound: no such run, or none of its steps has a journal record
            (a run of steps without a journal, or one purged).
    """
    run = await client.get_run(run_id)
    definition = await client.get_workflow(run.workflow)
    tasks = {step.id: step for step in definition.steps}
    journaled = tuple(
        [step.step_id for step in run.steps if await _has_records(journal, run_id, step.step_id)]
    )
    if not journaled:
        raise NotFound(
            f"run {run_id} has no journal: none of its steps recorded anything",
            field="run_id",
        )
    steps = [
        {
            "step_id": step.step_id,
            "task_type": tasks[step.step_id].task if step.step_id in tasks else "",
            "input": decode_payload(_step_input(run, tasks.get(step.step_id))),
            "status": enum_name(pb.StepStatus, step.status),
            "journaled": step.step_id in journaled,
        }
        for step in run.steps
    ]
    header = {
        "format": FORMAT,
        "version": VERSION,
        "run_id": run.run_id,
        "workflow": run.workflow,
        "workflow_version": definition.version,
        "status": enum_name(pb.RunStatus, run.status),
        "input": decode_payload(run.input),
        "settings": dict(run.settings),
        "error": run.error,
        "steps": steps,
    }
    return Export(header, journaled)


async def _has_records(journal: JournalClient, run_id: str, step_id: str) -> bool:
    async for _ in journal.read(run_id, step_id, limit=1):
        return True
    return False


def _step_input(run: pb.Run, step: pb.Step | None) -> bytes:
    """What a step's handler reads as its input: the run's for a step that
    depends on none, the one step's output it depends on, else an object of
    each one's output by step id (as the engine makes a task's input)."""
    if step is None or not step.depends_on:
        return run.input
    outputs = {s.step_id: s.output for s in run.steps}
    if len(step.depends_on) == 1:
        return outputs.get(step.depends_on[0], b"")
    merged = {d: decode_payload(outputs.get(d, b"")) for d in step.depends_on}
    return json.dumps(merged).encode()


def _record_json(record: jpb.Record) -> dict[str, Any]:
    return json_format.MessageToDict(record, preserving_proto_field_name=True)


def _line(value: Mapping[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n"


# ---- reading ---------------------------------------------------------------------------


def read_export(lines: Iterable[str], *, source: str = "export") -> ExportedRun:
    """The run an export's ``lines`` hold (a file opened as text will do).

    Args:
        lines: The export's lines, the header first.
        source: What to call the export in errors (its file name).

    Raises:
        InvalidArgument: it is not a journal export, of another version, cut
            short, or a line does not parse; the message names ``source``
            and the line.
    """
    numbered = enumerate(lines, start=1)
    header = _header(numbered, source)
    steps = {str(s.get("step_id", "")): s for s in header.get("steps", ())}
    records: dict[str, list[jpb.Record]] = {step_id: [] for step_id in steps}
    end: Mapping[str, Any] | None = None
    last = 1
    for number, text in numbered:
        last = number
        if not text.strip():
            continue
        if end is not None:
            raise _bad(source, number, "a line after the end line")
        item = _json_object(source, number, text)
        if item.get("end") is True:
            end = item
            continue
        step_id, record = _record(source, number, item)
        if step_id not in records:
            raise _bad(source, number, f"a record of step {step_id!r}, which the header omits")
        records[step_id].append(record)
    if end is None:
        raise _bad(source, last, "the export ends without its end line: it was cut short")
    found = sum(len(r) for r in records.values())
    if end.get("records") != found:
        raise _bad(source, last, f"the end line counts {end.get('records')} records; {found} read")
    return ExportedRun(
        run_id=str(header.get("run_id", "")),
        workflow=str(header.get("workflow", "")),
        status=str(header.get("status", "")),
        input=header.get("input"),
        settings=_settings(header.get("settings"), source),
        steps=tuple(
            ExportedStep(
                step_id=step_id,
                task_type=str(s.get("task_type", "")),
                input=s.get("input"),
                status=str(s.get("status", "")),
                records=tuple(records[step_id]),
            )
            for step_id, s in steps.items()
        ),
        source=source,
    )


def _header(numbered: Iterable[tuple[int, str]], source: str) -> Mapping[str, Any]:
    first = next(iter(numbered), None)
    if first is None:
        raise _bad(source, 0, "the file is empty: not a dagnats journal export")
    try:
        header = json.loads(first[1])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _bad(source, 1, f"not a dagnats journal export (no header of format {FORMAT!r})")
    version = header.get("version")
    if version != VERSION:
        raise _bad(
            source,
            1,
            f"journal export version {version!r} is not one this dagnats reads "
            f"(it reads version {VERSION})",
        )
    if not isinstance(header.get("steps"), list):
        raise _bad(source, 1, "the header lists no steps")
    return header


def _json_object(source: str, number: int, text: str) -> Mapping[str, Any]:
    try:
        item = json.loads(text)
    except ValueError as err:
        raise _bad(source, number, f"not JSON: {err}") from None
    if not isinstance(item, dict):
        raise _bad(source, number, "not a JSON object")
    return item


def _record(source: str, number: int, item: Mapping[str, Any]) -> tuple[str, jpb.Record]:
    step_id, seq, body = item.get("step_id"), item.get("seq"), item.get("record")
    if not isinstance(step_id, str) or not isinstance(body, dict):
        raise _bad(source, number, "a record line needs step_id and record")
    if not isinstance(seq, int) or seq < 1:
        raise _bad(source, number, f"seq must be a record sequence (1 or more), got {seq!r}")
    record = jpb.Record()
    try:
        json_format.ParseDict(body, record, ignore_unknown_fields=True)
    except json_format.ParseError as err:
        raise _bad(source, number, f"not a journal record: {err}") from None
    record.seq = seq
    return step_id, record


def _settings(value: Any, source: str) -> dict[str, str]:
    """The header's run settings: none in an export written before runs had
    them."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _bad(source, 1, "the header's settings are not a map of names to strings")
    return dict(value)


def _bad(source: str, number: int, problem: str) -> InvalidArgument:
    where = f"{source}: line {number}" if number else source
    return InvalidArgument(f"{where}: {problem}", field="export")
