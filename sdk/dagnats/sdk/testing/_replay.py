"""Replaying recorded runs against new handler code, before it is deployed.

Each dispatch a step's journal recorded through its commit is run again: the
handler gets the ``TaskContext`` it had (the step's input, the iteration and
attempt, the state the commit before it stored) and a journal handle whose
calls a :class:`~dagnats.sdk.testing._recorded.RecordedSession` answers from
the dispatch's records, by the journal's own replay rules. No model or tool
is called, nothing connects anywhere. What the handler does after its calls
is concluded as a worker concludes it (``Worker._conclude``: an exception is
a failure, an approval that waits a continue, ...), and the commit is
compared with the recorded one.

A dispatch that recorded a failure may have failed in a call the journal
never stored (a model's error, a tool that raised before its intent): a call
past its recorded end is not counted as a divergence, and its replay stops
there (``ReplayReport.unfinished``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from opentelemetry.trace import INVALID_SPAN

from dagnats.core import statechain
from dagnats.core.errors import InvalidArgument, NotFound, Unavailable
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal import convert
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._client import Client
from dagnats.sdk._context import Handover, TaskContext
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._journal_client import JournalClient
from dagnats.sdk._rpc import EngineRpc, Lease
from dagnats.sdk._state import HeldState, chain_of
from dagnats.sdk._worker import Handler, Worker
from dagnats.sdk.export import ExportedRun, ExportedStep, open_export, read_export
from dagnats.sdk.testing._recorded import (
    Diverged,
    Divergence,
    RecordedDispatch,
    RecordedSession,
)

Handlers = Handler | Mapping[str, Handler]
"""One handler for every journaled step, or a handler per task type."""

Source = str | os.PathLike[str] | ExportedRun

_FAILURES = frozenset({jpb.ACTION_FAIL, jpb.ACTION_FAIL_PERMANENT})


@dataclass(frozen=True, slots=True)
class Deployment:
    """Runs of a live deployment to replay, their journals read from it.

    Args:
        target: The engine's address (``host:port``), which serves the journal.
        run_ids: The runs to replay; when empty, the newest ``limit`` runs of
            ``workflow``.
        workflow: Whose runs to replay when no ``run_ids`` are given.
        limit: How many of ``workflow``'s runs, newest first (1-1000).
        credentials: A client's token and TLS files; by default from the
            environment.
    """

    target: str
    _: KW_ONLY
    run_ids: Sequence[str] = ()
    workflow: str = ""
    limit: int = 100
    credentials: Credentials | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayReport:
    """What a replay found.

    Attributes:
        runs: Runs replayed.
        dispatches: Dispatches replayed (one iteration's attempt each).
        divergences: Each dispatch's divergence from its recording, in order.
        unfinished: Dispatches that recorded a failure, whose replay stopped
            at their recorded end (see the module's docstring).
        skipped: Steps not replayed, and why (no handler for their task type).
    """

    runs: int
    dispatches: int
    divergences: tuple[Divergence, ...]
    unfinished: int = 0
    skipped: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the new code asked for exactly what was recorded."""
        return not self.divergences

    def lines(self) -> list[str]:
        """The report in words: a line per divergence, then a summary."""
        found = [str(d) for d in self.divergences]
        found += [f"skipped: {s}" for s in self.skipped]
        summary = (
            f"replayed {self.dispatches} dispatch(es) of {self.runs} run(s): "
            f"{len(self.divergences)} divergence(s)"
        )
        if self.unfinished:
            summary += f", {self.unfinished} failed dispatch(es) replayed to their recorded end"
        found.append(summary)
        return found


async def replay(
    source: Source | Iterable[Source] | Deployment, handlers: Handlers
) -> ReplayReport:
    """Run ``handlers`` against recorded journals, calling no model and no tool,
    and report where they ask for something else than was recorded.

    Args:
        source: Journal exports (``dagnats journal export``): a file, a
            directory of ``*.jsonl`` files, several of either, or runs read
            already (:func:`dagnats.sdk.export.read_export`); or a
            :class:`Deployment` whose runs are read from its journal service.
        handlers: The new code: one handler for every journaled step, or a
            mapping of task type to handler (as ``Worker`` takes them); a step
            whose task type has none is skipped.

    Returns:
        The report: :attr:`ReplayReport.ok` when nothing diverged.

    Raises:
        InvalidArgument: an export is not one (corrupt, cut short, of an
            unknown version); the message names the file and line.
        NotFound: a run named in a :class:`Deployment` does not exist or has
            no journal.
    """
    runs = dispatches = unfinished = 0
    divergences: list[Divergence] = []
    skipped: list[str] = []
    async for run in _runs(source):
        runs += 1
        for step in run.steps:
            handler = _handler_for(handlers, step.task_type)
            if handler is None:
                if step.records:
                    skipped.append(
                        f"run {run.run_id} step {step.step_id}: no handler for "
                        f"task type {step.task_type!r}"
                    )
                continue
            for dispatch in recorded_dispatches(run, step):
                dispatches += 1
                found = await replay_dispatch(dispatch, handler)
                if found is not None and _ran_past_a_failure(found, dispatch):
                    unfinished += 1
                elif found is not None:
                    divergences.append(found)
    return ReplayReport(
        runs=runs,
        dispatches=dispatches,
        divergences=tuple(divergences),
        unfinished=unfinished,
        skipped=tuple(skipped),
    )


def _handler_for(handlers: Handlers, task_type: str) -> Handler | None:
    if not task_type:
        return None  # a sub-workflow step: its child run has the journals
    if isinstance(handlers, Mapping):
        return handlers.get(task_type)
    return handlers


def _ran_past_a_failure(found: Divergence, dispatch: RecordedDispatch) -> bool:
    return found.kind == "unrecorded_call" and dispatch.commit.action in _FAILURES


# ---- the runs --------------------------------------------------------------------------


async def _runs(source: Source | Iterable[Source] | Deployment) -> AsyncIterator[ExportedRun]:
    if isinstance(source, Deployment):
        async for run in _deployed(source):
            yield run
        return
    items: Iterable[Source] = (
        [source] if isinstance(source, str | os.PathLike | ExportedRun) else source
    )
    for item in items:
        if isinstance(item, ExportedRun):
            yield item
            continue
        for file in _files(Path(item)):
            yield _read_file(file)


def _files(path: Path) -> list[Path]:
    """The exports ``path`` names: itself, or a directory's ``*.jsonl``."""
    return sorted(path.glob("*.jsonl")) if path.is_dir() else [path]


def _read_file(path: Path) -> ExportedRun:
    try:
        with path.open(encoding="utf-8") as lines:
            return read_export(lines, source=str(path))
    except FileNotFoundError:
        raise InvalidArgument(f"{path}: no such file", field="export") from None
    except UnicodeDecodeError as err:
        raise InvalidArgument(f"{path}: not UTF-8 text: {err}", field="export") from None


async def _deployed(deployment: Deployment) -> AsyncIterator[ExportedRun]:
    async with (
        Client(deployment.target, credentials=deployment.credentials) as client,
        JournalClient(deployment.target, credentials=deployment.credentials) as journal,
    ):
        run_ids = list(deployment.run_ids)
        if not run_ids:
            if not deployment.workflow:
                raise InvalidArgument("a Deployment names run_ids or a workflow", field="workflow")
            listed = await client.list_runs(workflow=deployment.workflow, limit=deployment.limit)
            run_ids = [r.run_id for r in listed]
        for run_id in run_ids:
            try:
                export = await open_export(client, journal, run_id)
            except NotFound:
                if deployment.run_ids:
                    raise
                continue  # a listed run whose steps keep no journal
            lines = [line async for line in export.lines(journal)]
            yield read_export(lines, source=f"{deployment.target} run {run_id}")


# ---- the dispatches --------------------------------------------------------------------


def recorded_dispatches(run: ExportedRun, step: ExportedStep) -> list[RecordedDispatch]:
    """Every dispatch of ``step`` that its journal holds through a commit, in
    order: the records of its iteration up to the commit, and the state the
    commit before the iteration stored.

    Raises:
        InvalidArgument: a state cannot be rebuilt from the recorded chain.
    """
    by_seq = {r.seq: r for r in step.records}
    task_input = b"" if step.input is None else json.dumps(step.input).encode()
    found = []
    for commit in (r for r in step.records if r.HasField("commit")):
        base = by_seq.get(commit.base_seq)
        found.append(
            RecordedDispatch(
                run_id=run.run_id,
                step_id=step.step_id,
                task_type=step.task_type,
                workflow=run.workflow,
                input=task_input,
                settings=run.settings,
                iteration=commit.iteration,
                attempt=commit.attempt,
                base_seq=commit.base_seq,
                records=tuple(
                    r
                    for r in step.records
                    if r.iteration == commit.iteration and r.seq <= commit.seq
                ),
                commit=commit.commit,
                commit_seq=commit.seq,
                state=_state_at(by_seq, base, run.source) if base is not None else None,
                state_record=base.commit if base is not None else None,
                source=run.source,
            )
        )
    return found


def _state_at(by_seq: Mapping[int, jpb.Record], record: jpb.Record, source: str) -> bytes | None:
    """The state the commit ``record`` stored, rebuilt from its chain as the
    journal service rebuilds it (``dagnats.journal.state``), from memory."""
    if not record.HasField("commit") or not record.commit.has_state:
        return None
    deltas: list[jpb.Record] = []
    at = record
    while at.commit.HasField("state_delta"):
        deltas.append(at)
        base = by_seq.get(at.base_seq)
        if base is None or not base.HasField("commit") or not base.commit.has_state:
            raise InvalidArgument(
                f"{source}: the state of commit {record.seq} cannot be rebuilt: its chain "
                f"needs commit {at.base_seq}, which the export does not hold with a state",
                field="export",
            )
        at = base
    result = statechain.rebuild(
        at.commit.state, [convert.stored_delta(r.commit) for r in reversed(deltas)]
    )
    match result:
        case statechain.Rebuilt(state=state):
            return state
        case statechain.ChainBroken():
            raise InvalidArgument(
                f"{source}: the state of commit {record.seq}: {statechain.describe(result)}",
                field="export",
            )


async def replay_dispatch(dispatch: RecordedDispatch, handler: Handler) -> Divergence | None:
    """Run ``handler`` once on ``dispatch`` as recorded; its divergence, if any."""
    session = RecordedSession(dispatch)
    tc = TaskContext(
        _leased(dispatch),
        _ReplayRpc(session),
        worker_id="replay",
        handed=Handover(_token(dispatch, session), _held(dispatch), None),
    )
    await tc.journal()  # handed over: no call; the state is the recorded one
    running = asyncio.create_task(_invoke(handler, tc))
    try:
        await asyncio.wait((running,))
        if not _diverged(running):
            # As a worker concludes a handler's end: a failure for an error,
            # a continue that waits for an approval, ...
            await Worker._conclude(tc, running, INVALID_SPAN)
    except Diverged:
        pass  # recorded by the session
    finally:
        journal = tc.journaled
        if journal is not None:
            await journal.close()
    return session.divergences[0] if session.divergences else None


async def _invoke(handler: Handler, tc: TaskContext) -> None:
    await handler(tc)


def _diverged(running: asyncio.Task[None]) -> bool:
    return not running.cancelled() and isinstance(running.exception(), Diverged)


def _leased(dispatch: RecordedDispatch) -> pb.LeasedTask:
    """The task the dispatch's handler was given."""
    task = pb.Task(
        run_id=dispatch.run_id,
        step_id=dispatch.step_id,
        task_type=dispatch.task_type,
        iteration=dispatch.iteration,
        attempt=dispatch.attempt,
        input=dispatch.input,
        workflow=dispatch.workflow,
        settings=dispatch.settings,
    )
    return pb.LeasedTask(task=task, lease="replay", delivery=1)


def _token(dispatch: RecordedDispatch, session: RecordedSession) -> jpb.WriterToken:
    return jpb.WriterToken(
        run_id=dispatch.run_id,
        step_id=dispatch.step_id,
        iteration=dispatch.iteration,
        attempt=dispatch.attempt,
        writer=secrets.token_hex(8),
        base_seq=dispatch.base_seq,
        last_seq=dispatch.base_seq,
        snapshot_seq=dispatch.base_seq,
        replay_positions=session.recorded_positions,
        claim=jpb.Claim(delivery=1, worker_id="replay"),
    )


def _held(dispatch: RecordedDispatch) -> HeldState:
    if dispatch.state is None or dispatch.state_record is None:
        return HeldState(None, None)
    held = HeldState(dispatch.state, chain_of(dispatch.state_record))
    held.seq = dispatch.base_seq
    return held


class _ReplayRpc(EngineRpc):
    """The calls a handler's context makes besides the journal's, answered
    without a service: the journal's go to the recorded session; a heartbeat
    says the run goes on; no input is queued (the recording placed what
    there was); a live preview goes nowhere. Nothing else may be called."""

    def __init__(self, session: RecordedSession) -> None:
        super().__init__(
            "replay.invalid:1", timeout=30.0, credentials=Credentials(), sessions=lambda: session
        )

    async def heartbeat(
        self, request: pb.HeartbeatRequest, *, lease: Lease | None = None
    ) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse()

    async def list_inputs(
        self, request: ipb.ListRequest, *, lease: Lease | None = None
    ) -> ipb.ListResponse:
        return ipb.ListResponse()

    async def put_stream(
        self, requests: AsyncIterator[jpb.PutStreamRequest]
    ) -> jpb.PutStreamResponse:
        published = 0
        async for _ in requests:
            published += 1
        return jpb.PutStreamResponse(published=published)

    def _channel(self, target: str) -> Any:
        raise Unavailable("a replay answers the journal's calls only; this handler made another")
