"""ForkRun: a new run whose step starts from a record of another run's journal.

In order, each step safe to repeat, so that a crash anywhere leaves either
no new run or one that starts whole:

1. The source's records of the step through ``at_seq`` are read, and
   ``replay.fork_point`` says where the step resumes (or why it cannot).
2. The new run's id: fresh, or the one the idempotency key is bound to. A
   run stored under it already is the answer.
3. The records are copied in order to the new run's journal of the step,
   their sequence fields moved (``journal.fork.moved``), each append fenced
   on the copy before it; then the fork's record, which counts them and
   names their digest. A copy that a crash stopped half-way is found and
   carried on (the copies are the journal's first records, in order).
4. A steering input is queued for the step (deduplicated on its request id).
5. The run is stored, its forked step dispatched at the resume point. Until
   this write nothing dispatches the step, so no half-copied journal is ever
   claimed; a fork without a key that crashed before it leaves a journal no
   run names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import assert_never

from dagnats.core import errors, tracing
from dagnats.core.errors import Fenced
from dagnats.core.ids import check_run_id, check_seq, check_token, new_run_id
from dagnats.core.payload import check_json
from dagnats.core.run_settings import check_settings, merged
from dagnats.core.seam import seam
from dagnats.engine import model as m
from dagnats.engine import rules
from dagnats.engine.convert import record_from_proto
from dagnats.engine.processor import Engine
from dagnats.engine.store import StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs import rules as input_rules
from dagnats.journal import convert as jconvert
from dagnats.journal import replay
from dagnats.journal.fork import moved, prefix_digest
from dagnats.journal.store import JournalStore
from dagnats.journal.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

MAX_INPUT_BYTES = 4 << 20
MAX_IDEMPOTENCY_KEY = 256
STEER_REQUEST_ID = "fork-steer"
# How many times a copy that met another copy of the same fork reads again.
COPY_TRIES = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Forked:
    """A fork's answer: the new run as stored, whether this call made it,
    and how many records it copied."""

    stored: StoredRun
    created: bool
    copied: int


@dataclass(frozen=True, slots=True, kw_only=True)
class _Asked:
    run_id: str
    step_id: str
    at_seq: int
    input: bytes | None
    settings: dict[str, str]
    steer: bytes
    key: str


def _checked(request: pb.ForkRunRequest) -> _Asked:
    """The request's fields, each checked at the edge."""
    changes = request.changes
    if request.at_seq == 0:
        raise errors.InvalidArgument("at_seq is required: a record's sequence", field="at_seq")
    if len(request.idempotency_key) > MAX_IDEMPOTENCY_KEY:
        raise errors.InvalidArgument(
            f"idempotency_key is longer than {MAX_IDEMPOTENCY_KEY} characters",
            field="idempotency_key",
        )
    field = "changes.input"
    new_input = check_json(changes.input, field=field, limit=MAX_INPUT_BYTES)
    steer = b""
    if changes.steer:
        steer = check_json(changes.steer, field="changes.steer", allow_empty=False)
    return _Asked(
        run_id=check_run_id(request.run_id),
        step_id=check_token(request.step_id, field="step_id"),
        at_seq=check_seq(request.at_seq, field="at_seq"),
        input=new_input if changes.has_input else None,
        settings=check_settings(changes.settings, field="changes.settings"),
        steer=steer,
        key=request.idempotency_key,
    )


class Forks:
    """The engine's ForkRun, on its stores: the runs (through ``engine``),
    the journal and the inputs."""

    def __init__(self, engine: Engine, journal: JournalStore) -> None:
        self.engine = engine
        self.journal = journal

    async def fork(self, request: pb.ForkRunRequest) -> Forked:
        """Fork as the request asks (see the module docstring).

        Raises:
            InvalidArgument: a malformed field, or a record no run resumes after.
            NotFound: no such run (or it was purged), or no such step.
        """
        asked = _checked(request)
        source, records, resume = await self._source(asked)
        # A fork's key has a namespace of its own beside StartRun's; the run
        # keeps it as its idempotency key, so that its purge releases it.
        key = f"fork.{asked.key}" if asked.key else ""
        run_id = new_run_id()
        if key:
            run_id = await self.engine.store.claim_run_key(source.workflow.name, key, run_id)
            existing = await self.engine.read_run(run_id)
            if existing is not None:
                if existing.record.outbox:
                    existing = await self.engine.flush(existing)
                return Forked(stored=existing, created=False, copied=len(records))
        await self._copy(run_id, asked, records, resume)
        await seam("after_fork_copied")
        if asked.steer:
            await self._steer(run_id, asked.step_id, asked.steer)
        accepted = rules.fork_run(
            source,
            run_id=run_id,
            origin=m.ForkOrigin(run_id=asked.run_id, step_id=asked.step_id, at_seq=asked.at_seq),
            resume=m.Resume(
                iteration=resume.iteration,
                attempt=resume.attempt,
                iterations=resume.iteration,
                output=resume.output,
            ),
            input=source.input if asked.input is None else asked.input,
            settings=tuple(sorted(merged(dict(source.settings), asked.settings).items())),
            now=self.engine.clock(),
            idempotency_key=key,
        )
        trace_context: dict[str, str] = {}
        tracing.inject(trace_context)
        stored = await self.engine.create(accepted, trace_context)
        log.info("run %s: forked from run %s at seq %d", run_id, asked.run_id, asked.at_seq)
        return Forked(stored=stored, created=True, copied=len(records))

    async def _source(self, asked: _Asked) -> tuple[m.Run, list[jpb.Record], replay.ResumeAt]:
        """The source run now, its step's records through ``at_seq``, and
        where the forked step resumes.

        Raises:
            NotFound: no such run or step.
            InvalidArgument: a step without a journal, or a record no run
                resumes after.
        """
        stored = await self.engine.read_run(asked.run_id)
        if stored is None:
            raise errors.NotFound(
                f"run {asked.run_id} does not exist (or was purged)", field="run_id"
            )
        source = record_from_proto(stored.record)
        if not source.has_step(asked.step_id):
            raise errors.NotFound(
                f"run {asked.run_id} has no step {asked.step_id!r}", field="step_id"
            )
        if source.workflow.step(asked.step_id).task is None:
            raise errors.InvalidArgument(
                f"step {asked.step_id!r} runs a child run, not a handler: it has no journal",
                field="step_id",
            )
        records = await self.journal.read(
            asked.run_id, asked.step_id, after=0, through=asked.at_seq
        )
        decision = replay.fork_point(jconvert.all_entries(records), asked.at_seq)
        match decision:
            case replay.NoResume(reason=reason):
                raise errors.InvalidArgument(reason, field="at_seq")
            case replay.ResumeAt():
                return source, records, decision
            case _:
                assert_never(decision)

    async def _copy(
        self, run_id: str, asked: _Asked, records: list[jpb.Record], resume: replay.ResumeAt
    ) -> None:
        """Copy ``records`` and the fork's record to the new run's journal,
        carrying on from a copy stopped half-way (or made at once by a
        retry of the same fork)."""
        for attempt in range(COPY_TRIES):
            try:
                await self._copy_once(run_id, asked, records, resume)
                return
            except Fenced:
                if attempt == COPY_TRIES - 1:
                    raise
                log.info("run %s: another copy of the fork went ahead; reading again", run_id)

    async def _copy_once(
        self, run_id: str, asked: _Asked, records: list[jpb.Record], resume: replay.ResumeAt
    ) -> None:
        step_id = asked.step_id
        there = await self.journal.read(run_id, step_id, after=0, limit=len(records) + 1)
        seqs: dict[int, int] = {}
        last = 0
        for i, record in enumerate(records):
            if i < len(there):
                seqs[record.seq] = last = there[i].seq
                continue
            copy = moved(record, run_id, seqs)
            last = await self.journal.append_copied(
                copy, after=last, msg_id=f"{run_id}.{step_id}.copy.{i}"
            )
            seqs[record.seq] = last
            if i == 0:
                await seam("after_fork_first_copy")
        if len(there) > len(records):
            return  # the fork's record is stored
        marker = jpb.Record(
            run_id=run_id,
            step_id=step_id,
            iteration=resume.iteration,
            attempt=resume.attempt,
            expected_seq=last,
            base_seq=seqs.get(resume.base_seq, 0),
            fork=jpb.Fork(
                run_id=asked.run_id,
                step_id=step_id,
                at_seq=asked.at_seq,
                copied=len(records),
                digest=prefix_digest(records),
            ),
        )
        marker.time.GetCurrentTime()
        await self.journal.append_copied(marker, after=last, msg_id=f"{run_id}.{step_id}.fork")

    async def _steer(self, run_id: str, step_id: str, content: bytes) -> None:
        """Queue the steering input the forked step places first."""
        inputs = self.engine.inputs
        if inputs is None:
            raise errors.Unavailable("this engine has no inputs store to queue a steer in")
        submission = input_rules.check_submission(
            run_id, step_id, STEER_REQUEST_ID, input_rules.Mode.STEER, content
        )
        fresh = input_rules.new_input(submission, created_by=run_id, now=self.engine.clock())
        await inputs.create(fresh)
