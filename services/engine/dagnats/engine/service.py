"""The EngineService servicer: validates requests, then hands them to the
engine. Protobuf stays here and in :mod:`dagnats.engine.convert`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, assert_never

from dagnats.core import errors, tracing
from dagnats.core import jetstream as jsx
from dagnats.core.budget_wire import check_budget
from dagnats.core.claims import lease_claim
from dagnats.core.grpcutil import Context, abort_with, as_domain_error, domain_errors
from dagnats.core.ids import (
    check_build_id,
    check_lease,
    check_run_id,
    check_token,
    check_worker_id,
    new_run_id,
)
from dagnats.core.partitions import partition_of, pull_priority
from dagnats.core.payload import check_json
from dagnats.core.run_settings import check_settings
from dagnats.core.seam import seam
from dagnats.core.status import step_status_from_proto
from dagnats.core.subjects import lane_build, task_consumer, task_subject
from dagnats.core.timestamps import duration
from dagnats.engine import convert, definition, rules
from dagnats.engine import model as m
from dagnats.engine.cancels import CancelWatch
from dagnats.engine.convert_workflow import stored_workflow, workflow_from_proto, workflow_to_proto
from dagnats.engine.fork import Forks
from dagnats.engine.open_pulls import Lane, OpenPulls
from dagnats.engine.ownership import Ownership
from dagnats.engine.processor import Engine
from dagnats.engine.purge import purge_run
from dagnats.engine.report import lease_position, outcome_event, publish_outcome
from dagnats.engine.run_feed import RunFeed, listed
from dagnats.engine.run_list import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    Created,
    Filter,
    Listed,
    PageWhole,
    ReadEveryRun,
    ReadMoreEntries,
    candidates,
    most_loaded,
    newest,
    page_is_whole,
    settle_by_creation,
)
from dagnats.engine.store import Delivery, StoredRun
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.engine.v1 import engine_pb2_grpc as pb_grpc
from dagnats.engine.v1 import internal_pb2 as ipb
from dagnats.engine.watch import RunWatches
from dagnats.journal.service import MAX_RESTART_LIMIT
from dagnats.journal.store import JournalStore
from dagnats.journal.usage import read_ledger, run_usage
from dagnats.journal.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

MAX_TASK_TYPES = 32
MAX_TASKS = 256
MAX_POLL_WAIT = 60.0
DEFAULT_POLL_WAIT = 10.0
MAX_IDEMPOTENCY_KEY = 256
MAX_INPUT_BYTES = 4 << 20
MAX_CANCEL_WATCH = 1024
# Runs a page of ListRuns loads at once through the runs by creation time.
LOAD_AT_ONCE = 100


def _cancel_watch(request: pb.PollTasksRequest) -> list[str]:
    runs = list(dict.fromkeys(request.cancel_watch))
    if len(runs) > MAX_CANCEL_WATCH:
        raise errors.InvalidArgument(
            f"cancel_watch names at most {MAX_CANCEL_WATCH} runs", field="cancel_watch"
        )
    for i, run_id in enumerate(runs):
        check_run_id(run_id, field=f"cancel_watch[{i}]")
    return runs


def _runs_filter(request: pb.WatchRunsRequest) -> Filter:
    workflow = check_token(request.workflow, field="workflow") if request.workflow else ""
    if request.status not in pb.RunStatus.values():
        raise errors.InvalidArgument(f"status {request.status} is not a run status", field="status")
    limit = request.limit or DEFAULT_LIMIT
    if not 0 < limit <= MAX_LIMIT:
        raise errors.InvalidArgument(f"limit must be between 1 and {MAX_LIMIT}", field="limit")
    return Filter(workflow=workflow, status=request.status, limit=limit)


class Claims(Protocol):
    """The journal service of this process claiming a first delivery's
    journal as its task is leased (``JournalServicer.claim_with_lease``, ADR 42)."""

    def __call__(
        self, request: jpb.ClaimRequest, *, first: bool = False
    ) -> Awaitable[jpb.Claimed | None]: ...


class EngineServicer(pb_grpc.EngineServiceServicer):
    """The engine's gRPC methods. ``journal`` is the journal's store: a report
    and a heartbeat are checked against the step's journal, and a purge
    removes it. ``claims``: the journal service of this process, if it runs
    one, which claims a first delivery's journal with its lease."""

    def __init__(
        self,
        engine: Engine,
        journal: JournalStore,
        *,
        claims: Claims | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        self.engine = engine
        # The partitions whose tasks its polls fetch (the engine's by default).
        self.ownership = ownership or engine.ownership
        self.store = engine.store
        self.journal = journal
        self.claims = claims
        # The local socket of this process, offered with each poll's answer
        # and each watch's first to clients on this host.
        self.local_socket: pb.LocalSocket | None = None
        self._consumers: set[str] = set()
        self.watches = RunWatches(engine.runs, wrote_last=engine.wrote_last)
        engine.on_stored = self.watches.written
        if engine.heard is not None:
            engine.heard.on_other_write = self.watches.heard
        self.feed = RunFeed(engine.store)
        self.cancels = CancelWatch(engine.store)
        self.forks = Forks(engine, journal)
        self.pulls = OpenPulls(self._pull, self.store.give_back)

    # ---- workflows ----------------------------------------------------------------

    @domain_errors
    async def RegisterWorkflow(
        self, request: pb.RegisterWorkflowRequest, context: Context
    ) -> pb.RegisterWorkflowResponse:
        source = request.WhichOneof("source")
        if source == "document":
            workflow = definition.parse_document(request.document)
        elif source == "workflow":
            workflow = workflow_from_proto(request.workflow)
        else:
            raise errors.InvalidArgument("a workflow or a document is required", field="source")
        message = workflow_to_proto(workflow)
        await self.store.put_workflow(message)
        return pb.RegisterWorkflowResponse(workflow=message)

    @domain_errors
    async def GetWorkflow(
        self, request: pb.GetWorkflowRequest, context: Context
    ) -> pb.GetWorkflowResponse:
        name = check_token(request.name, field="name")
        return pb.GetWorkflowResponse(workflow=await self.store.get_workflow(name))

    @domain_errors
    async def ListWorkflows(
        self, request: pb.ListWorkflowsRequest, context: Context
    ) -> pb.ListWorkflowsResponse:
        workflows = sorted(await self.store.list_workflows(), key=lambda w: w.name)
        return pb.ListWorkflowsResponse(workflows=workflows)

    # ---- runs ---------------------------------------------------------------------

    @domain_errors
    async def StartRun(self, request: pb.StartRunRequest, context: Context) -> pb.StartRunResponse:
        stored, created = await self._start(request)
        return pb.StartRunResponse(run=stored.record.run, created=created)

    async def _start(self, request: pb.StartRunRequest) -> tuple[StoredRun, bool]:
        """Start a run (or find the one its idempotency key names); the run as
        stored, and whether this call created it."""
        name = check_token(request.workflow, field="workflow")
        payload = check_json(request.input, field="input", limit=MAX_INPUT_BYTES)
        key = request.idempotency_key
        if len(key) > MAX_IDEMPOTENCY_KEY:
            raise errors.InvalidArgument(
                f"idempotency_key is longer than {MAX_IDEMPOTENCY_KEY} characters",
                field="idempotency_key",
            )
        settings = check_settings(request.settings)
        budget = check_budget(request.budget) if request.HasField("budget") else None
        run_id = new_run_id()
        workflow = stored_workflow(await self.store.get_workflow(name))
        if key:
            run_id = await self.store.claim_run_key(name, key, run_id)
            existing = await self.engine.read_run(run_id)  # the run now
            if existing is not None:
                if existing.record.outbox:
                    existing = await self.engine.flush(existing)
                return existing, False
        accepted = rules.start_run(
            run_id=run_id,
            workflow=workflow,
            input=payload,
            now=self.engine.clock(),
            idempotency_key=key,
            settings=tuple(sorted(settings.items())),
            budget=budget,
        )
        trace_context: dict[str, str] = {}
        tracing.inject(trace_context)
        return await self.engine.create(accepted, trace_context), True

    @domain_errors
    async def ForkRun(self, request: pb.ForkRunRequest, context: Context) -> pb.ForkRunResponse:
        forked = await self.forks.fork(request)
        return pb.ForkRunResponse(
            run=forked.stored.record.run, created=forked.created, copied=forked.copied
        )

    @domain_errors
    async def GetRun(self, request: pb.GetRunRequest, context: Context) -> pb.GetRunResponse:
        run_id = check_run_id(request.run_id)
        stored = await self.engine.read_run(run_id)  # with kept iterations not written yet
        if stored is None:
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        answer = pb.GetRunResponse(run=await self._with_waits_for_builds(stored))
        if request.with_usage:  # read from the run's journals: the usage ledger
            found = await read_ledger(self.journal, run_id)
            steps = [s.step_id for s in stored.record.run.steps]
            answer.usage.CopyFrom(run_usage(found, steps))
        return answer

    async def _with_waits_for_builds(self, stored: StoredRun) -> pb.Run:
        """The run, each step whose task waits on its pinned build's lane with
        no worker of that build there marked ``waiting_for_build`` (a copy:
        the stored run may be this engine's guess). A step running on a kept
        message is not: its holder runs it, and a message its dead holder
        left is moved to the lane by the next poll that finds it. A run with
        no pinned running step is returned as it is, with no read."""
        run, records = stored.record.run, stored.record.step_records
        pinned = [
            (i, build, task)
            for i, step in enumerate(run.steps)
            if step.status == pb.STEP_STATUS_RUNNING
            and (build := convert.pinned_build_of(stored.record, step))
            and (task := _task_type(stored.record.workflow, step.step_id))
            and not (step.step_id in records and records[step.step_id].kept_seq)
        ]
        if not pinned:
            return run
        marked = pb.Run()
        marked.CopyFrom(run)
        # The lane's consumer of the run's partition: the one its task is
        # delivered from, polled by the workers of the replica owning it.
        partition = partition_of(run.run_id, self.ownership.partitions)
        for i, build, task in pinned:
            lease = self.engine.config.task_ack_wait
            present = await self.store.build_present(task, build, lease, partition)
            marked.steps[i].waiting_for_build = not present
        return marked

    @domain_errors
    async def UpgradeRun(
        self, request: pb.UpgradeRunRequest, context: Context
    ) -> pb.UpgradeRunResponse:
        run_id = check_run_id(request.run_id)
        build = check_token(request.build_id, field="build_id")
        before = await self.engine.read_run(run_id)
        upgrade = m.UpgradeRequested(build=build)
        result = None if before is None else await self.engine.apply(run_id, upgrade)
        if before is None or result is None:
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        run, decision = result
        if isinstance(decision, m.Dropped) and run.status.terminal:
            raise errors.Conflict(f"run {run_id} is {run.status.value}; it cannot be upgraded")
        await seam("after_upgrade_stored")
        await self._clear_old_lanes(before, build)
        return pb.UpgradeRunResponse(run=convert.run_to_proto(run))

    async def _clear_old_lanes(self, before: StoredRun, build: str) -> None:
        """Purge what the moved steps' old lanes hold of them, once the move
        is stored: the dispatch is on the new lane, so the old message is a
        copy. A crash before this leaves it to the lease, which settles a
        message off its step's lane, or to the run's purge."""
        for step in before.record.run.steps:
            old = convert.pinned_build_of(before.record, step)
            task = _task_type(before.record.workflow, step.step_id)
            if old and old != build and task and step.status == pb.STEP_STATUS_RUNNING:
                subject = task_subject(task, before.record.run.run_id, step.step_id, old)
                await self.store.purge_subject(jsx.TASKS, subject)

    async def WatchRun(
        self, request: pb.WatchRunRequest, context: Context
    ) -> AsyncIterator[pb.WatchRunResponse]:
        try:
            first = True
            async for response in self.watch(request):
                if first and self.local_socket is not None:
                    response.local_socket.CopyFrom(self.local_socket)
                first = False
                yield response
        except Exception as err:
            if (domain := as_domain_error(err)) is None:
                raise
            await abort_with(context, domain)

    async def watch(self, request: pb.WatchRunRequest) -> AsyncIterator[pb.WatchRunResponse]:
        """WatchRun's states, as gRPC and the local socket send
        them: domain errors are raised."""
        if request.HasField("start"):
            if request.run_id:
                raise errors.InvalidArgument("give a run id or a start, not both", field="run_id")
            stored, _ = await self._start(request.start)
        else:
            stored = await self.store.require_run(check_run_id(request.run_id))
        async for state in self.watches.follow(stored, ended_only=request.ended_only):
            run = await self._with_waits_for_builds(state)
            yield pb.WatchRunResponse(run=run, revision=state.revision)

    @domain_errors
    async def ListRuns(self, request: pb.ListRunsRequest, context: Context) -> pb.ListRunsResponse:
        workflow = check_token(request.workflow, field="workflow") if request.workflow else ""
        limit = request.limit or 100
        if not 0 < limit <= 10_000:
            raise errors.InvalidArgument("limit must be between 1 and 10000", field="limit")
        wanted = Filter(workflow=workflow, status=request.status, limit=limit)
        page = await self._newest_by_creation(wanted)
        if page is None:
            page = await self._newest_by_writes(wanted)
        return pb.ListRunsResponse(runs=[run.view for run in page])

    async def _newest_by_creation(self, wanted: Filter) -> list[Listed[pb.Run]] | None:
        """A page of the newest runs read through the runs by creation time:
        the newest entries, then the stretch before those read, as long as a
        run whose entry was not read could still belong (``settle_by_creation``
        says how far), and of their runs only those the page needs, newest
        first. None when the entries cannot settle it (``ReadEveryRun``)."""
        skew = round(self.engine.config.clock_skew * 1e9)
        loaded: dict[str, Listed[pb.Run] | None] = {}
        read = await self.store.created_runs(2 * wanted.limit)
        entries, newest_at = read.entries, read.newest
        while True:
            page = await self._load_page(candidates(entries, wanted), wanted, loaded)
            step = settle_by_creation(
                page,
                wanted,
                unread_before=read.unread_before,
                loaded=len(loaded),
                skew=skew,
                read=len(entries),
                newest=newest_at,
            )
            match step:
                case PageWhole():
                    return page
                case ReadEveryRun():
                    return None
                case ReadMoreEntries(entries=more):
                    read = await self.store.created_runs(more, before=read.start)
                    entries = read.entries + entries
                case _:
                    assert_never(step)

    async def _load_page(
        self,
        order: list[Created],
        wanted: Filter,
        loaded: dict[str, Listed[pb.Run] | None],
    ) -> list[Listed[pb.Run]]:
        """The page of the runs of ``order`` (newest first), loaded in that
        order, a page's worth at once, until the page is full, ``order`` is
        done, or ``most_loaded`` runs were loaded. ``loaded`` keeps each run
        read (None: not stored) across the reads of one page."""
        most = most_loaded(wanted)
        page: list[Listed[pb.Run]] = []
        at = 0
        while at < len(order) and len(page) < wanted.limit and len(loaded) < most:
            batch = order[at : at + min(wanted.limit, LOAD_AT_ONCE)]
            at += len(batch)
            missing = [entry.run_id for entry in batch if entry.run_id not in loaded]
            for run_id, stored in (await self.store.load_runs(missing)).items():
                loaded[run_id] = None if stored is None else listed(stored, whole=True)
            page = newest((run for e in order[:at] if (run := loaded[e.run_id])), wanted)
        return page

    async def _newest_by_writes(self, wanted: Filter) -> list[Listed[pb.Run]]:
        """A page of the newest runs read through the runs bucket's newest
        writes: it costs the runs written since about its oldest run, not
        every stored run. Read back from the newest writes, four times
        further each time the page could still miss a run (page_is_whole)."""
        skew = round(self.engine.config.clock_skew * 1e9)
        writes = 2 * wanted.limit
        while True:
            recent = await self.store.recent_runs(writes)
            page = newest((listed(s, whole=True) for s in recent.runs), wanted)
            if page_is_whole(page, wanted, unread_before=recent.unread_before, skew=skew):
                return page
            writes *= 4

    async def WatchRuns(
        self, request: pb.WatchRunsRequest, context: Context
    ) -> AsyncIterator[pb.WatchRunsResponse]:
        try:
            runs = _runs_filter(request)
            async for snapshot, changes in self.feed.follow(runs):
                yield pb.WatchRunsResponse(
                    snapshot=snapshot, runs=changes.runs, removed=changes.removed
                )
        except Exception as err:
            if (domain := as_domain_error(err)) is None:
                raise
            await abort_with(context, domain)

    @domain_errors
    async def CancelRun(
        self, request: pb.CancelRunRequest, context: Context
    ) -> pb.CancelRunResponse:
        run_id = check_run_id(request.run_id)
        reason = request.reason or "cancelled by request"
        result = await self._cancel(run_id, reason)
        if result is None:
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        run, decision = result
        if isinstance(decision, m.Dropped) and run.status is not m.RunStatus.CANCELLED:
            raise errors.Conflict(f"run {run_id} is {run.status.value}; it cannot be cancelled")
        return pb.CancelRunResponse(run=convert.run_to_proto(run))

    async def _cancel(self, run_id: str, reason: str) -> tuple[m.Run, m.Decision] | None:
        """Cancel the run, then its live child runs, and theirs, before the
        answer: the cancel stored each stopped step's cancel record, so once
        CancelRun answers, no journal of the tree takes a new call. (The child
        runs' cancel events on the history come after, and are dropped.)"""
        result = await self.engine.apply(run_id, m.CancelRequested(reason=reason))
        if result is not None and isinstance(decision := result[1], m.Accepted):
            children = [e for e in decision.effects if isinstance(e, m.CancelChildRun)]
            await asyncio.gather(*(self._cancel(c.child_run_id, c.reason) for c in children))
        return result

    @domain_errors
    async def PurgeRun(self, request: pb.PurgeRunRequest, context: Context) -> pb.PurgeRunResponse:
        run_id = check_run_id(request.run_id)
        await purge_run(self.store, self.journal, self.engine.inputs, run_id, asked=True)
        return pb.PurgeRunResponse()

    # ---- tasks --------------------------------------------------------------------

    @domain_errors
    async def PollTasks(
        self, request: pb.PollTasksRequest, context: Context
    ) -> pb.PollTasksResponse:
        return await self.poll(request)

    async def poll(self, request: pb.PollTasksRequest) -> pb.PollTasksResponse:
        """PollTasks, as gRPC and the local socket call it:
        domain errors are raised."""
        types = list(dict.fromkeys(request.task_types))
        if not types:
            raise errors.InvalidArgument("at least one task type is required", field="task_types")
        if len(types) > MAX_TASK_TYPES:
            raise errors.InvalidArgument(
                f"at most {MAX_TASK_TYPES} task types per poll", field="task_types"
            )
        for i, task_type in enumerate(types):
            check_token(task_type, field=f"task_types[{i}]")
        max_tasks = request.max_tasks or 1
        if not 0 < max_tasks <= MAX_TASKS:
            raise errors.InvalidArgument(f"max_tasks must be 1..{MAX_TASKS}", field="max_tasks")
        if not 0 <= request.restart_limit <= MAX_RESTART_LIMIT:
            raise errors.InvalidArgument(
                f"restart_limit must be 0..{MAX_RESTART_LIMIT}", field="restart_limit"
            )
        check_worker_id(request.worker_id)
        build = check_build_id(request.build_id)
        wait = request.wait.ToNanoseconds() / 1e9 if request.HasField("wait") else DEFAULT_POLL_WAIT
        wait = min(max(wait, 0.05), MAX_POLL_WAIT)
        if request.cancel_watch:
            runs = _cancel_watch(request)
            return pb.PollTasksResponse(cancelled_runs=await self.cancels.wait(runs, wait))
        # A worker of a build takes its build's lane of each type too: the
        # tasks of steps pinned to it. Of each lane, every partition: those
        # this replica owns first, the others only when no poll of their
        # owner waits (``pull_priority``).
        owned = self.ownership.owned()
        lanes = [
            Lane(t, b, k, pull_priority(k, owned))
            for t in types
            for b in dict.fromkeys(("", build))
            for k in range(self.ownership.partitions)
        ]
        for task_type, lane, partition, _ in lanes:
            await self._ensure_consumer(task_type, lane, partition)
        msgs = await self.pulls.fetch(lanes, max_tasks, wait)
        claiming = request if request.claim_journal and self.claims is not None else None
        try:
            leased = [
                t
                for t in await asyncio.gather(*(self._lease(m, claiming, build) for m in msgs))
                if t
            ]
        except asyncio.CancelledError:
            await self.store.give_back(msgs)  # the caller left: no one will read these leases
            raise
        return pb.PollTasksResponse(tasks=leased, local_socket=self.local_socket)

    async def _ensure_consumer(self, task_type: str, build: str, partition: int) -> None:
        name = task_consumer(task_type, build, partition)
        if name not in self._consumers:
            ack_wait = self.engine.config.task_ack_wait
            await self.store.ensure_task_consumer(
                task_type,
                ack_wait,
                build,
                partition=partition,
                partitions=self.ownership.partitions,
            )
            self._consumers.add(name)

    async def _pull(self, lane: Lane, batch: int, seconds: float) -> list[Delivery]:
        return await self.store.pull_tasks(
            lane.task_type, batch, seconds, lane.build, lane.partition, lane.priority
        )

    async def _lease(
        self, msg: Delivery, claiming: pb.PollTasksRequest | None = None, build: str = ""
    ) -> pb.LeasedTask | None:
        """Turn a task message into a lease, or settle it at once when its run
        ended or its step moved on (a stale duplicate), or when it is off its
        step's lane for a worker of ``build`` (moved to the lane). With
        ``claiming`` (the poll, which asked), a first delivery's journal is
        claimed with it."""
        task = pb.Task.FromString(msg.data)
        # The run as this engine last wrote it, when it says the task is
        # current: the engine that dispatched the task usually leases it. A
        # guess that is stale by then leases a stale task, as a read just
        # before the run moved on would; the claim and the report's checks
        # refuse it. Only a read settles a task as stale.
        seq = msg.stream_seq
        await self.engine.creating(task.run_id)  # a first task may come before its run
        stored = self.engine.last_written(task.run_id)
        current = _current_task(stored, task, seq)
        # Whether ``stored`` is the run as a read would give it now: a guess
        # nobody else wrote over since (heard writes), or a read.
        known = current is task and self.engine.quiet(task.run_id)
        if current is None or msg.delivered > 1:
            # A task delivered again is leased on a read only. It may be a
            # kept message (every delivery of one after its holder's first
            # is a redelivery), and leased on a guess for an older dispatch
            # than it carries (the guess predates the hold, or its later
            # iterations), its claim would find that one past and
            # acknowledge the message the current dispatch rides on.
            found = await self.engine.read_run(task.run_id)
            if found is None and (wait := self._run_awaited(msg)) is not None:
                log.info("run %s: not stored yet; its task waits %.2fs", task.run_id, wait)
                await msg.nak(delay=wait)
                return None
            current = _current_task(found, task, seq)
            stored, known = found, True
        if current is None:
            log.info("run %s step %s: task no longer current; settled", task.run_id, task.step_id)
            await msg.ack()
            return None
        assert stored is not None
        match await self._lane_for(stored, current, msg, build):
            case m.MoveToLane(build=lane):
                await self._move_to_lane(current, msg, lane)
                return None
            case m.LeaseHere():
                pass
            case unknown:
                assert_never(unknown)
        log.info(
            "run %s step %s: leased (%d, %d) delivery %d",
            current.run_id,
            current.step_id,
            current.iteration,
            current.attempt,
            msg.delivered,
        )
        lease_duration = duration(self.engine.config.task_ack_wait)
        leased = pb.LeasedTask(
            task=current, lease=msg.lease, delivery=msg.delivered, lease_duration=lease_duration
        )
        if claiming is not None:
            first = known and stored is not None and _first_dispatch(stored, current, msg.delivered)
            claimed = await self._claim_with_lease(leased, claiming, first=first)
            if claimed is not None:
                leased.journal_claim.CopyFrom(claimed)
        return leased

    async def _claim_with_lease(
        self, leased: pb.LeasedTask, poll: pb.PollTasksRequest, *, first: bool
    ) -> jpb.Claimed | None:
        """The claim with the lease: the journal claim of ``leased`` that rides
        its holder's first record (ADR 42), or None: the worker then claims as
        usual, so a failure here costs it that call and nothing else.
        ``first``: the run is known running and the task is its step's first
        dispatch, delivered once: its claim reads nothing (ADR 50)."""
        assert self.claims is not None
        task = leased.task
        request = lease_claim(
            leased,
            worker_id=poll.worker_id,
            restart_limit=poll.restart_limit,
            build_id=poll.build_id,
        )
        try:
            return await self.claims(request, first=first)
        except Exception as err:  # the worker's own claim tries again, and answers
            log.info("run %s step %s: no claim with the lease: %r", task.run_id, task.step_id, err)
            return None

    async def _lane_for(
        self, stored: StoredRun, task: pb.Task, msg: Delivery, build: str
    ) -> m.LaneDecision:
        """Whether the message ``msg`` of ``task`` may be leased to a worker of
        ``build`` or moves to its step's lane (``rules.lane_for_lease``). Only
        a pinned workflow's step with no build, delivered again, reads more:
        the build of its journal's holder, on the tail (one direct get)."""
        step = next((s for s in stored.record.run.steps if s.step_id == task.step_id), None)
        if step is None:
            return m.LeaseHere()
        holder = ""
        pinned_policy = stored.record.workflow.build_policy != pb.BUILD_POLICY_UPGRADE
        if rules.asks_holder(
            pinned_policy=pinned_policy, step_build=step.build_id, delivery=msg.delivered
        ):
            tail = await self.journal.tail(task.run_id, task.step_id)
            holder = convert.holder_build(tail, task.iteration) if tail is not None else ""
        return rules.lane_for_lease(
            pin=convert.pinned_build_of(stored.record, step),
            lane_build=lane_build(msg.subject),
            worker_build=build,
            holder_build=holder,
        )

    async def _move_to_lane(self, task: pb.Task, msg: Delivery, build: str) -> None:
        """Put a message of a step that belongs to ``build`` (pinned to it, or
        its first claim's), found off that build's lane, on the lane: its
        dispatch is made again there (as a vanished task's is) and the step
        records the build if it has none, unless the lane holds it already,
        then this message is settled. Never given back: a delivery counts
        toward the restart limit. A crash between the two leaves this message
        to be found again, its step pinned, and the lane holding the
        dispatch."""
        run_id, step_id = task.run_id, task.step_id
        subject = task_subject(task.task_type, run_id, step_id, build)
        msg_id = convert.task_msg_id(run_id, step_id, task.iteration, task.attempt)
        if not await self.store.task_in_flight(subject, msg_id):
            log.info("run %s step %s: moved to the lane of build %s", run_id, step_id, build)
            vanished = m.TaskVanished(
                step_id=step_id, iteration=task.iteration, attempt=task.attempt, build=build
            )
            await self.engine.apply(run_id, vanished)
            await seam("after_moved_to_lane")
        await msg.ack()

    def _run_awaited(self, msg: Delivery) -> float | None:
        """How long to give back a task whose run is not stored (None: settle it)."""
        age = self.engine.clock() - msg.stored_at
        return rules.awaits_its_run(
            age,
            msg.delivered,
            retry_budget=jsx.RETRY_BUDGET,
            clock_skew=self.engine.config.clock_skew,
        )

    @domain_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Context
    ) -> pb.HeartbeatResponse:
        lease = check_lease(request.lease)
        run_id = check_run_id(request.run_id)
        await self._check_holder(lease, releasing=False)
        await self.store.extend_lease(lease)
        active = await self.store.run_is_active(run_id)
        return pb.HeartbeatResponse(cancelled=not active)

    @domain_errors
    async def Report(self, request: pb.ReportRequest, context: Context) -> pb.ReportResponse:
        lease = check_lease(request.lease)
        run_id = check_run_id(request.run_id)
        step_id = check_token(request.step_id, field="step_id")
        kind = request.WhichOneof("outcome")
        if kind is None:
            raise errors.InvalidArgument("an outcome is required", field="outcome")
        if kind in ("acknowledge", "redeliver"):
            # Only the holder lets its task go or gives it back.
            await self._check_holder(lease, releasing=kind == "acknowledge")
            if kind == "acknowledge":
                await self.store.release(lease)
            else:
                # Not begun by its holder: the next taker gets it now, claims
                # its dispatch and fences the holder, as after the lease.
                await self.store.redeliver(lease)
            return pb.ReportResponse(cancelled=not await self.store.run_is_active(run_id))
        if request.iteration < 0 or request.attempt < 0:
            raise errors.InvalidArgument("iteration and attempt must be >= 0", field="attempt")
        if request.attempt == 0:
            raise errors.InvalidArgument(
                "a report names the dispatch it settles: set iteration and attempt to the task's",
                field="attempt",
            )
        outcome = getattr(request, kind)
        if kind in ("continue", "complete"):
            check_json(outcome.output, field=f"{kind}.output", limit=MAX_INPUT_BYTES)
        if kind == "pause" and outcome.duration.ToNanoseconds() <= 0:
            raise errors.InvalidArgument("pause.duration must be positive", field="pause.duration")
        stored = await self.store.load_run(run_id)
        if stored is None:
            await self.store.release(lease)
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        cancelled = stored.record.run.status == pb.RUN_STATUS_CANCELLED
        event = outcome_event(
            run_id=run_id,
            step_id=step_id,
            iteration=request.iteration,
            attempt=request.attempt,
            journal_seq=request.journal_seq,
            outcome=outcome,
            now=self.engine.clock(),
        )
        # A cancelled run drops the event: nothing to check it against (the
        # step's journal ends in a cancel record, which no report names).
        if not cancelled and await self._contradicted(event):
            return pb.ReportResponse(stale=True)
        await publish_outcome(self.store, lease, event)
        return pb.ReportResponse(
            cancelled=cancelled, stale=not cancelled and self._stale(stored, event)
        )

    async def _contradicted(self, event: ipb.HistoryEvent) -> bool:
        """Check a report against the step's journal: raise ``Fenced``, or return
        True (stale: publish nothing), unless the journal allows it."""
        report = convert.event_to_input(event)
        assert isinstance(report, m.StepReport)
        tail = await self._journal_tail(event.run_id, event.step_id)
        named = None
        if event.journal_seq > 0:
            if tail is not None and tail.seq == event.journal_seq:
                named = tail  # the usual case: the commit is the tail
            else:
                at = await self.journal.written_at(event.run_id, event.step_id, event.journal_seq)
                named = convert.journal_mark(at.record, at.delivery) if at else None
        refused = rules.check_journal_report(report, tail, named)
        if named is not None:
            event.build_id = named.build  # the commit's build, as its own event carries it
        return self._answer(event.run_id, event.step_id, refused)

    async def _check_holder(self, lease: str, *, releasing: bool) -> None:
        """Raise ``Fenced`` when the journal says another delivery holds the task."""
        delivery, seq = lease_position(lease)
        task = await self.store.task_at(seq)
        if task is None:
            return  # acknowledged already: the lease extends and releases nothing
        tail = await self._journal_tail(task.run_id, task.step_id)
        identity = m.Identity(iteration=task.iteration, attempt=task.attempt)
        if tail is not None and tail.dispatch > (identity.iteration, identity.attempt):
            # Moved past the dispatch it was published for: kept for a later one?
            identity = await self._leased_dispatch(task, seq)
        # A claim of a run that ended answers stale: its task may go, whoever holds it.
        ended = releasing and not await self.store.run_is_active(task.run_id)
        refused = rules.check_journal_lease(
            identity, delivery, tail, releasing=releasing, run_ended=ended
        )
        self._answer(task.run_id, task.step_id, refused)  # a lease is never refused as stale

    async def _leased_dispatch(self, task: pb.Task, seq: int) -> m.Identity:
        """The dispatch the task message at ``seq`` carries: the one it was
        published for, or the one its holder kept it for (the kept task)."""
        # A read, not this engine's last write: an older guess would name an
        # older dispatch, and the holder's heartbeat would be refused. Caught
        # up with the journal: kept iterations may not be written yet (deferred writes).
        stored = await self.engine.read_run(task.run_id)
        record = stored.record.step_records.get(task.step_id) if stored else None
        if stored is not None and record is not None and record.kept_seq == seq:
            step = next(s for s in stored.record.run.steps if s.step_id == task.step_id)
            return m.Identity(iteration=step.iteration, attempt=step.attempt)
        return m.Identity(iteration=task.iteration, attempt=task.attempt)

    async def _journal_tail(self, run_id: str, step_id: str) -> m.JournalMark | None:
        tail = await self.journal.last_written(run_id, step_id)
        return convert.journal_mark(tail.record, tail.delivery) if tail is not None else None

    def _answer(self, run_id: str, step_id: str, refused: m.Contradicted | None) -> bool:
        """Raise ``Fenced`` for a fenced refusal; whether the call is stale."""
        if refused is None:
            return False
        self.engine.counters[f"refused_{refused.reason}"] += 1
        log.info(
            "run %s step %s: refused (%s): %s", run_id, step_id, refused.reason, refused.message
        )
        if refused.reason == "fenced":
            raise errors.Fenced(
                run_id, step_id, detail=f"run {run_id} step {step_id}: {refused.message}"
            )
        return True

    def _stale(self, stored: StoredRun, event: ipb.HistoryEvent) -> bool:
        """Whether the rules would drop ``event`` on the run as stored now. A hint
        for the reporter (the HTTP bridge answers 410 with it); the event is
        published all the same and the processor, on the latest run, decides."""
        run_input = convert.event_to_input(event)
        if run_input is None:
            return False
        run = convert.record_from_proto(stored.record)
        decision = rules.apply(run, run_input, self.engine.clock(), self.engine.options)
        return isinstance(decision, m.Dropped)

    # ---- checkpoints --------------------------------------------------------------

    @domain_errors
    async def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: Context
    ) -> pb.SaveCheckpointResponse:
        run_id = check_run_id(request.run_id)
        step_id = check_token(request.step_id, field="step_id")
        limit = self.engine.config.loop_state_max_bytes
        if len(request.state) > limit:
            raise errors.InvalidArgument(
                f"checkpoint is {len(request.state)} bytes; loop_state_max_bytes is {limit}",
                field="state",
            )
        await self._require_step(run_id, step_id)
        await self.store.save_checkpoint(run_id, step_id, request.state)
        return pb.SaveCheckpointResponse()

    @domain_errors
    async def LoadCheckpoint(
        self, request: pb.LoadCheckpointRequest, context: Context
    ) -> pb.LoadCheckpointResponse:
        run_id = check_run_id(request.run_id)
        step_id = check_token(request.step_id, field="step_id")
        state = await self.store.load_checkpoint(run_id, step_id)
        if state is None:
            return pb.LoadCheckpointResponse(found=False)
        return pb.LoadCheckpointResponse(found=True, state=state)

    async def _require_step(self, run_id: str, step_id: str) -> ipb.RunRecord:
        stored = await self.store.require_run(run_id)
        if not any(s.step_id == step_id for s in stored.record.run.steps):
            raise errors.NotFound(f"run {run_id} has no step {step_id!r}", field="step_id")
        return stored.record


def _current_task(stored: StoredRun | None, task: pb.Task, seq: int) -> pb.Task | None:
    """The task to lease for the message at ``seq`` carrying ``task``, by
    ``stored`` (``rules.carried_dispatch``): ``task`` itself, or the dispatch
    its holder kept the message for (the kept task); None when it carries no current
    dispatch."""
    run = stored.record.run if stored is not None else None
    step = next((s for s in run.steps if s.step_id == task.step_id), None) if run else None
    if stored is None or run is None:
        return None
    record = stored.record.step_records.get(task.step_id)
    published_for = m.Identity(iteration=task.iteration, attempt=task.attempt)
    carried = rules.carried_dispatch(
        convert.run_status_from_proto(run.status),
        step_status_from_proto(step.status) if step is not None else None,
        m.Identity(iteration=step.iteration, attempt=step.attempt) if step else None,
        published_for,
        kept=record is not None and record.kept_seq == seq,
    )
    if carried is None or carried == published_for:
        return task if carried is not None else None
    kept = pb.Task()
    kept.CopyFrom(task)
    kept.iteration, kept.attempt = carried.iteration, carried.attempt
    return kept


def _task_type(workflow: pb.Workflow, step_id: str) -> str:
    """The task type of a step of ``workflow`` ("": it runs none)."""
    return next((s.task for s in workflow.steps if s.id == step_id), "")


def _first_dispatch(stored: StoredRun, task: pb.Task, delivery: int) -> bool:
    """Whether ``task``, delivered for the ``delivery``-th time, is the first
    delivery of its step's first dispatch by the run ``stored``: iteration 0,
    attempt 1, never dispatched again (a vanished task's new message) nor
    kept. No holder came before it, so the step's journal holds nothing: a
    dispatch's message is published again only under its Msg-Id, inside the
    window that drops a duplicate (``rules.republishable``)."""
    record = stored.record.step_records.get(task.step_id)
    again = record is not None and (record.redispatches > 0 or record.kept_seq > 0)
    # A forked step's journal starts with the copied prefix: not empty.
    forked = stored.record.run.forked_from.step_id == task.step_id
    return (task.iteration, task.attempt, delivery) == (0, 1, 1) and not again and not forked
