"""The context a handler gets for one leased task.

Invariants:

- A task is settled at most once: the first ``continue_``, ``complete``,
  ``fail``, ``fail_permanent`` or ``pause`` claims it before its RPC is sent,
  so a second one raises ``TaskAlreadySettled`` even while the first is in
  flight. A settle whose RPC fails with a domain error (after the retries in
  ``_rpc``) releases the claim: the engine stored nothing, so the handler may
  settle again. A settle cancelled in flight keeps its claim: the engine may
  have stored it.
- Outputs are encoded before anything is sent or claimed: a value that is not
  JSON raises ``InvalidArgument`` and leaves the task unsettled.
- Once cancelled, a context stays cancelled; ``cancellation`` is set at the
  same moment ``cancelled`` turns true.
- Every call made for the task (journal, reports, heartbeats, checkpoints)
  rides out a transport failure for as long as the task's ``lease`` lasts,
  which each answered heartbeat extends (see ``_rpc.Lease``): a service
  restart or a stream-leader election of a few seconds loses nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from google.protobuf.duration_pb2 import Duration

from dagnats.core.claims import lease_claim
from dagnats.core.errors import Conflict, DagnatsError, InvalidArgument, RecordTooLarge
from dagnats.core.outcomes import Outcome, commit_of
from dagnats.core.payload import decode, encode
from dagnats.core.seam import seam
from dagnats.core.settings import env_int
from dagnats.core.statechain import (
    SNAPSHOT_BYTES,
    SNAPSHOT_EVERY,
    STATE_MAX_BYTES,
    Chain,
    ChainSettings,
)
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk._errors import (
    ApprovalPending,
    BudgetExceeded,
    Committed,
    Fenced,
    InputsQueued,
    RestartLimit,
    RunCancelled,
    Stale,
    TaskAlreadySettled,
)
from dagnats.sdk._journal import InputMode, Journal, PlacedInput
from dagnats.sdk._rpc import EngineRpc, Lease
from dagnats.sdk._session import JournalSession
from dagnats.sdk._state import HeldState, HeldStates, chain_of
from dagnats.sdk._state import store as store_state

# When the engine does not say how long a lease lasts, assume this (its default).
ASSUMED_LEASE = 30.0

# A failure refused as too large for a journal record is committed again with
# its error cut to this many bytes, and without the state.
FAILURE_ERROR_BYTES = 16 * 1024

# When a commit stores the whole state rather than what the dispatch added
# (the state chain), and how large the state may grow.
CHAIN_SETTINGS = ChainSettings(
    snapshot_every=env_int("DAGNATS_STATE_SNAPSHOT_EVERY", SNAPSHOT_EVERY),
    snapshot_bytes=env_int("DAGNATS_STATE_SNAPSHOT_BYTES", SNAPSHOT_BYTES),
    state_max_bytes=env_int("DAGNATS_STATE_MAX_BYTES", STATE_MAX_BYTES),
)
# The states of steps whose task went back to the queue, held in this process
# for the dispatch that comes back to it; only states a claim's answer would
# not carry (a claim's answer holds up to 1.5 MiB).
HELD_STATES = HeldStates(env_int("DAGNATS_STATE_HELD_BYTES", 256 * 1024 * 1024))
STATE_HELD_FROM = 1536 * 1024

_UNSET: Any = object()


def describe_error(error: str | BaseException) -> str:
    """The text reported for a failure: a string as is, an exception as ``Type: message``."""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    return error


class TaskContext:
    """One dispatch of a step, as a handler sees it.

    A handler is ``async def handler(tc: TaskContext) -> None``. It reads the
    task (``input``, ``run_id``, ``iteration``, ...), may save and load a
    checkpoint, and settles the task exactly once with :meth:`continue_`,
    :meth:`complete`, :meth:`fail`, :meth:`fail_permanent` or :meth:`pause`.
    The worker creates contexts; handlers do not.
    """

    def __init__(
        self,
        leased: pb.LeasedTask,
        rpc: EngineRpc,
        *,
        worker_id: str = "",
        restart_limit: int = 5,
        leased_at: float | None = None,
        keep_task: bool = False,
        handed: Handover | None = None,
        build_id: str = "",
    ) -> None:
        """``build_id``: the worker's build, stamped on each commit.
        ``leased_at``: event-loop time the poll that leased the task was sent
        (now, when not given); the lease is counted from there. ``keep_task``: a
        journaled continue without a wait keeps the task for the next
        iteration (``next_task``). ``handed``: this dispatch's journal, handed
        over with the commit before it: :meth:`journal` claims it with its
        first write instead of a claim of its own."""
        self._leased = leased
        self._leased_at = asyncio.get_running_loop().time() if leased_at is None else leased_at
        self._lease = Lease(self.lease_duration or ASSUMED_LEASE, since=self._leased_at)
        self._settle_done = False
        self._worker_id = worker_id
        self._build_id = build_id
        self._restart_limit = restart_limit
        self._journal: Journal | None = None
        self._session: JournalSession | None = None
        self._held = HeldState(None, None)
        self._task = leased.task
        self._rpc = rpc
        self._input: Any = _UNSET
        self._settled_as: str | None = None
        self._cancelled = False
        self._cancellation = asyncio.Event()
        self._keep_task = keep_task
        self._handed = handed
        self._next: Kept | None = None

    # The task.

    @property
    def input(self) -> Any:
        """The step's input, JSON-decoded; None when empty.

        Raises:
            InvalidArgument: when the engine sent bytes that are not JSON.
        """
        if self._input is _UNSET:
            self._input = decode(self._task.input, field="input")
        return self._input

    @property
    def settings(self) -> Mapping[str, str]:
        """The run's settings (``Run.settings``): what the run was started
        (or forked) with, such as which model to call; empty when none."""
        return self._task.settings

    @property
    def run_id(self) -> str:
        """The run of the task."""
        return self._task.run_id

    @property
    def step_id(self) -> str:
        """The step of the task."""
        return self._task.step_id

    @property
    def task_type(self) -> str:
        """The task type the worker polled for."""
        return self._task.task_type

    @property
    def workflow(self) -> str:
        """Name of the run's workflow."""
        return self._task.workflow

    @property
    def iteration(self) -> int:
        """Iteration of the step, from 0; one more per accepted continue."""
        return self._task.iteration

    @property
    def attempt(self) -> int:
        """Attempt of this iteration, from 1; one more per engine retry."""
        return self._task.attempt

    @property
    def delivery(self) -> int:
        """How many times this task message was delivered, from 1."""
        return self._leased.delivery

    @property
    def trace_context(self) -> dict[str, str]:
        """W3C trace context of the dispatch (``traceparent``, ``tracestate``)."""
        return dict(self._task.trace_context)

    @property
    def lease_duration(self) -> float:
        """Seconds the lease lasts without a heartbeat (0 when the engine did not say)."""
        return self._leased.lease_duration.ToTimedelta().total_seconds()

    @property
    def cancelled(self) -> bool:
        """True once the engine said the run was cancelled."""
        return self._cancelled

    @property
    def cancellation(self) -> asyncio.Event:
        """Set when the run is cancelled; a handler may wait on it."""
        return self._cancellation

    @property
    def settled(self) -> bool:
        """True once the task was settled (or a settle is in flight)."""
        return self._settled_as is not None

    # The journal.

    @property
    def fenced(self) -> bool:
        """True once a journal write found a successor holding the step."""
        return self._journal is not None and self._journal.fenced

    @property
    def journaled(self) -> Journal | None:
        """The journal handle once :meth:`journal` claimed it."""
        return self._journal

    async def journal(self) -> Journal:
        """Claim this dispatch's journal; the same handle on later calls.

        After the claim, :meth:`load_checkpoint` and :meth:`checkpoint` travel
        through the journal's commits, and every settle commits before it
        reports.

        Raises:
            Stale: a late redelivery; the task was released, nothing ran.
            Committed: the dispatch was committed by a holder that crashed
                before its event was published; the outcome was reported now.
            RestartLimit: the iteration was claimed too often in a row; the
                failure was committed and reported.
            Fenced: another holder's claim landed first; it holds the step.
        """
        if self._journal is not None:
            return self._journal
        await seam("before_claim")
        self._session = self._session or JournalSession(self._rpc, lease=self._lease)
        if self._handed is not None:
            # The commit before this dispatch handed it over (the hand-over): the
            # claim is stored with the first record, fenced on that commit.
            token = self._handed.token
            token.claim.worker_id = self._worker_id
            self._journal = Journal(
                self._session,
                token,
                cancellation=self._cancellation,
                checked_at=self._handed.checked_at,
                budget=self._budget(),
            )
            self._held = self._handed.state
            await seam("after_claim")
            return self._journal
        if self._leased.HasField("journal_claim"):
            # Claimed as the task was leased, to be stored with the first
            # record (the claim with the lease): the tail was read after the poll was sent.
            claimed, sent = self._leased.journal_claim, self._leased_at
        else:
            claimed, sent = await self._claim()
        self._journal = Journal(
            self._session,
            claimed.token,
            cancellation=self._cancellation,
            checked_at=sent,
            budget=self._budget(),
        )
        self._held = await self._claimed_state(claimed)
        await seam("after_claim")
        return self._journal

    def _budget(self) -> jpb.Budget | None:
        """The run's budget, when its task carries one: every model call of the
        journal then asks the journal to check it."""
        return self._task.budget if self._task.HasField("budget") else None

    def _pauses_for_budget(self) -> bool:
        budget = self._budget()
        return budget is not None and budget.policy == jpb.BUDGET_POLICY_PAUSE

    async def _wait_for_budget(self, exceeded: BudgetExceeded) -> None:
        """End the iteration whose model call the budget refused, under the
        pause policy: a continue that waits for an input (of mode ``BUDGET``,
        which the next model call's check places); at once, when inputs are
        queued already. The next iteration starts from the state saved so far."""
        output = {
            "budget_exceeded": {
                "tokens": exceeded.tokens,
                "cost_micros": exceeded.cost_micros,
                "budget_tokens": exceeded.budget_tokens,
                "budget_cost_micros": exceeded.budget_cost_micros,
            }
        }
        try:
            await self.continue_(output, until_input=True)
        except InputsQueued:
            await self.continue_(output)

    async def _claimed_state(self, claimed: jpb.Claimed) -> HeldState:
        """The state the claim found, rebuilt by the journal from its chain:
        in the answer, or read with ``ReadState`` when it did not fit."""
        if not claimed.has_state:
            return HeldState(None, None)
        data = claimed.state
        if claimed.state_follows:
            held = HELD_STATES.take(self.run_id, self.step_id, claimed.token.base_seq)
            if held is not None:
                return held
            request = jpb.ReadStateRequest(
                run_id=self.run_id, step_id=self.step_id, at_seq=claimed.token.base_seq
            )
            data = await self._rpc.read_state(request) or b""
        found = claimed.state_chain
        chain = Chain(size=len(data), depth=found.depth, delta_bytes=found.chain_bytes)
        return HeldState(data, chain)

    async def _claim(self) -> tuple[jpb.Claimed, float]:
        """Claim the journal (``Claim``): the answer, and when it was sent."""
        assert self._session is not None
        request = lease_claim(
            self._leased,
            worker_id=self._worker_id,
            restart_limit=self._restart_limit,
            build_id=self._build_id,
        )
        # A claim that raises Fenced lost to a concurrent claim of this
        # dispatch (between its read of the tail and its append): the task is
        # that holder's, not ours to report.
        sent = asyncio.get_running_loop().time()
        response = await self._session.claim(request)
        if response.HasField("settled"):
            await self._settled_by_journal(response.settled)
        return response.claimed, sent

    async def _settled_by_journal(self, settled: jpb.Settled) -> None:
        # The claim carried the lease: the journal service settles the task
        # behind its answer, and no report follows.
        self._settled_as = settled.reason
        self._settle_done = True
        if settled.reason == "stale":
            raise Stale(self.run_id, self.step_id, settled.detail)
        signal = RestartLimit if settled.reason == "restart_limit" else Committed
        raise signal(self.run_id, self.step_id, settled.detail)

    def _request(self, request: pb.ReportRequest) -> pb.ReportRequest:
        request.lease = self._leased.lease
        request.run_id = self.run_id
        request.step_id = self.step_id
        request.iteration = self.iteration
        request.attempt = self.attempt
        return request

    # Checkpoints.

    async def load_checkpoint(self) -> Any | None:
        """The state last saved with :meth:`checkpoint`, JSON-decoded.

        Returns:
            The state, or None when nothing was saved.

        Raises:
            DagnatsError: a domain error from the engine; ``Unavailable`` when it
                cannot be reached.
        """
        if self._journal is not None:
            return self._held.value()
        response = await self._rpc.load_checkpoint(
            pb.LoadCheckpointRequest(run_id=self.run_id, step_id=self.step_id), lease=self._lease
        )
        if not response.found:
            return None
        return decode(response.state, field="state")

    async def checkpoint(self, state: Any) -> None:
        """Save ``state`` (JSON-encoded) as the step's checkpoint.

        Raises:
            InvalidArgument: ``state`` is not JSON, or it is larger than the
                engine's ``loop_state_max_bytes``.
            DagnatsError: another domain error; ``Unavailable`` when the engine
                cannot be reached.
        """
        data = encode(state, field="state")
        if self._journal is not None:
            self._held.replace(data)  # saved by the commit that ends the dispatch
            return
        await self._rpc.save_checkpoint(
            pb.SaveCheckpointRequest(
                run_id=self.run_id, step_id=self.step_id, state=data, lease=self._leased.lease
            ),
            lease=self._lease,
        )

    async def append_state(self, key: str, items: Sequence[Any], **fields: Any) -> None:
        """Add ``items`` to the list at ``key`` of the state (a JSON object;
        ``{}`` when nothing was saved) and set ``fields``: the state of a
        conversation that grows. The commit that ends the dispatch stores
        what was appended, not the whole state again (the state chain), and
        the worker keeps the state in memory for the iterations it keeps.
        :meth:`load_checkpoint` returns the state the appends built; change it
        only through this method or :meth:`checkpoint`.

        Raises:
            InvalidArgument: the state is not a JSON object, its ``key`` is not
                a list, or an item or field is not JSON.
        """
        if self._journal is not None:
            self._held.append(key, items, fields)
            return
        held = HeldState(None, None)
        state = await self.load_checkpoint()
        if state is not None:
            held.replace(encode(state, field="state"))
        held.append(key, items, fields)
        await self.checkpoint(held.value())

    # Settling.

    async def continue_(
        self,
        output: Any = None,
        *,
        delay: float | None = None,
        until: datetime | None = None,
        until_input: bool = False,
    ) -> None:
        """End this iteration and ask for the next one, at once or after a wait.

        The wait options combine; whichever comes first wakes the step. While
        the step waits no task is in flight and no worker is held, and an engine
        restart loses nothing. ``loop_delay`` does not apply to a waiting
        iteration.

        Args:
            output: Progress output (JSON-serialisable), shown on the step.
            delay: Wake after this many seconds.
            until: Wake at this time (timezone-aware).
            until_input: Wake when an input is submitted to the step.

        Raises:
            InputsQueued: ``until_input`` while inputs are queued: place them
                and run another turn instead (nothing was settled).
            InvalidArgument: ``output`` is not JSON or a wait is malformed.
            TaskAlreadySettled: the task was already settled.
        """
        message = pb.Continue(output=encode(output, field="output"))
        if delay is not None or until is not None or until_input:
            message.wait.CopyFrom(_wait(delay, until, until_input))
        if until_input and self._settled_as is None and await self._inputs_queued():
            raise InputsQueued(f"inputs are queued for step {self.step_id}; place them first")
        await self._settle("continue", message)

    async def place_inputs(self, mode: InputMode) -> list[PlacedInput]:
        """Place the step's queued inputs of ``mode`` into this iteration.

        Each input is claimed with compare-and-swap and recorded in the journal;
        the record is the truth. A redelivery of the iteration gets back what an
        earlier delivery placed, once, before any new ones; no request id is
        ever placed twice.

        Raises:
            Conflict: the journal was not claimed (call ``await tc.journal()``).
            Fenced: a successor holds the step.
        """
        if self._journal is None:
            raise Conflict("place_inputs needs the journal: call await tc.journal() first")
        return await self._journal.place_inputs(mode)

    async def _wait_for_approval(self, pending: ApprovalPending) -> None:
        """End the iteration of a tool call waiting for approval: a continue
        with the state saved so far that waits for an input, holding no worker
        (the approval wakes it); at once, when inputs are queued already."""
        waiting = [{"call": p.key, "digest": p.digest, "tool": p.name} for p in pending.waiting]
        output: dict[str, Any] = {"awaiting_approval": waiting[0]}
        if len(waiting) > 1:  # several calls of a parallel group
            output["awaiting_approvals"] = waiting
        try:
            await self.continue_(output, until_input=True)
        except InputsQueued:
            await self.continue_(output)

    async def _inputs_queued(self) -> bool:
        response = await self._rpc.list_inputs(
            ipb.ListRequest(run_id=self.run_id, step_id=self.step_id, status=ipb.STATUS_QUEUED),
            lease=self._lease,
        )
        return bool(response.inputs)

    async def put_stream(self, chunk: Any) -> None:
        """Send a chunk of live preview to the step's readers (the spec's
        PutStream): text for a ``str``, JSON otherwise. A preview is not a
        record: a crash abandons it, and the step runs again. Claims the
        journal on first use; never waits on a slow reader (see
        :class:`dagnats.sdk.TokenStream`).
        """
        (await self.journal()).put_stream(chunk)

    async def complete(self, output: Any = None) -> None:
        """End the step with ``output`` (JSON-serialisable).

        Raises:
            InvalidArgument: ``output`` is not JSON; nothing was sent.
            TaskAlreadySettled: the task was already settled.
        """
        await self._settle("complete", pb.Complete(output=encode(output, field="output")))

    async def fail(self, error: str | BaseException, *, reason: str = "") -> None:
        """Fail this attempt; the step's retry policy decides what happens next.

        Args:
            error: What went wrong; an exception is reported as ``Type: message``.
            reason: A machine-readable reason, such as ``"timeout"``.

        Raises:
            TaskAlreadySettled: the task was already settled.
        """
        await self._settle("fail", _failure(error, reason, pb.FAILURE_KIND_RETRIABLE))

    async def fail_permanent(self, error: str | BaseException, *, reason: str = "") -> None:
        """Fail the step without a retry.

        Args:
            error: What went wrong; an exception is reported as ``Type: message``.
            reason: A machine-readable reason.

        Raises:
            TaskAlreadySettled: the task was already settled.
        """
        await self._settle("fail", _failure(error, reason, pb.FAILURE_KIND_PERMANENT))

    async def pause(self, duration: float) -> None:
        """Ask for this same iteration again after ``duration`` seconds.

        Raises:
            InvalidArgument: ``duration`` is negative or not finite.
            TaskAlreadySettled: the task was already settled.
        """
        if not math.isfinite(duration) or duration < 0:
            raise InvalidArgument(
                f"duration must be a finite number of seconds >= 0, got {duration!r}",
                field="duration",
            )
        wait = Duration()
        wait.FromNanoseconds(round(duration * 1e9))
        await self._settle("pause", pb.Pause(duration=wait))

    # Cancellation.

    async def heartbeat(self) -> None:
        """Extend the task's lease; the worker also does this in the background.

        Raises:
            RunCancelled: the run was cancelled; the handler should stop.
        """
        if self._cancelled or await self._beat():
            raise RunCancelled(self.run_id)

    async def _beat(self) -> bool:
        # The worker's background heartbeat: marks the context, never raises
        # RunCancelled (the worker cancels the handler's task instead).
        sent = asyncio.get_running_loop().time()
        response = await self._rpc.heartbeat(
            pb.HeartbeatRequest(lease=self._leased.lease, run_id=self.run_id), lease=self._lease
        )
        self._lease.extended(sent)
        if response.cancelled:
            self._mark_cancelled()
        return self._cancelled

    def next_task(self) -> Kept | None:
        """The next iteration's task when this one's commit kept the task
        message for it (the kept task)."""
        return self._next

    def _kept(self, nxt: jpb.NextDispatch, commit: jpb.Commit) -> Kept:
        leased = pb.LeasedTask()
        leased.CopyFrom(self._leased)  # the same message, lease and delivery
        leased.ClearField("journal_claim")  # this delivery's claim, not the next dispatch's
        task = leased.task
        task.iteration, task.attempt = nxt.iteration, nxt.attempt
        task.input = nxt.input
        task.trace_context.clear()
        task.trace_context.update(nxt.trace_context)
        assert self._journal is not None  # only a journal's commit hands over
        handed = Handover(nxt.token, self._held, self._journal.checked_at)
        return Kept(leased, self._lease.expires - self._lease.duration, handed)

    def _close(self) -> None:
        """Give back the journal's stream, once nothing is left to write (the
        worker calls this after the task is settled)."""
        if self._session is not None:
            self._session.close()

    def _mark_cancelled(self) -> None:
        self._cancelled = True
        self._cancellation.set()

    async def _give_back(self) -> None:
        """Hand back a task whose handler never began: the engine delivers it
        again at once, and its next taker claims the dispatch."""
        request = self._request(pb.ReportRequest())
        request.redeliver.SetInParent()
        await self._rpc.report(request, lease=self._lease)
        self._settle_done = True

    async def _give_up_cancelled(self) -> None:
        """Let go of the task of a cancelled run, which drops its outcome. A
        journaled dispatch cannot commit any more (the journal refuses the
        run's writes): its task is acknowledged instead."""
        if self._journal is None:
            if self._settled_as is None:
                await self.fail_permanent(f"run {self.run_id} was cancelled", reason="cancelled")
            return
        request = self._request(pb.ReportRequest())
        request.acknowledge.SetInParent()
        await self._rpc.report(request, lease=self._lease)
        self._settle_done = True

    async def _settle(self, field: str, outcome: Outcome) -> None:
        if self._settled_as is not None:
            raise TaskAlreadySettled(
                run_id=self.run_id, step_id=self.step_id, settled_as=self._settled_as
            )
        self._settled_as = field
        try:
            if self._journal is not None:
                # The commit is the state of record; the journal service
                # answers once it is stored, then publishes its event and
                # releases the task.
                commit = commit_of(outcome, None)
                commit.build_id = self._build_id  # the engine pins the step to it
                # Asks to keep the task for the next iteration, which the
                # worker then runs on this lease; the journal service grants
                # it to a continue that does not wait: the kept task.
                try:
                    if self._held.present:
                        store_state(self._held, commit, CHAIN_SETTINGS)
                    nxt = await self._journal.commit(
                        commit, lease=self._leased.lease, keep_task=self._keep_task
                    )
                except RecordTooLarge:
                    if field != "fail":
                        raise  # the handler may save less; unhandled, the step fails
                    # A failure must end its attempt whatever it carries. Nothing
                    # resumes from a failure's state (a retry loads the commit
                    # that ended the iteration before), so it goes without it.
                    commit = _small_failure(commit)
                    commit.build_id = self._build_id
                    nxt = await self._journal.commit(commit, lease=self._leased.lease)
                if commit.has_state and commit.action == jpb.ACTION_CONTINUE:
                    self._held.committed(chain_of(commit), self._journal.token.last_seq)
                    if nxt is None and len(self._held.data) > STATE_HELD_FROM:
                        HELD_STATES.put(self.run_id, self.step_id, self._held)
                self._next = self._kept(nxt, commit) if nxt is not None else None
            else:
                request = self._request(pb.ReportRequest())
                # "continue" is a Python keyword, so the oneof is set by name for all four.
                getattr(request, field).CopyFrom(outcome)
                if (await self._rpc.report(request, lease=self._lease)).cancelled:
                    self._mark_cancelled()
        except (DagnatsError, Fenced):
            self._settled_as = None
            raise
        except RunCancelled:  # the journal refused the commit: nothing was stored
            self._mark_cancelled()
            raise
        self._settle_done = True
        await seam("after_event")


class Handover(NamedTuple):
    """A dispatch's journal handed to its holder with the commit before it
    (the hand-over, ADR 34): the token whose first write stores the claim, the state that
    commit saved (None if it saved none), and when the commit's call was sent
    (event-loop time; see ``Journal``'s ``checked_at``)."""

    token: jpb.WriterToken
    state: HeldState
    checked_at: float | None


class Kept(NamedTuple):
    """The next iteration a commit kept the task message for (the kept task, ADR 31): the
    same lease and delivery, the new dispatch; when the lease was last known
    extended (event-loop time); its journal, if it was handed over."""

    leased: pb.LeasedTask
    leased_at: float
    handed: Handover | None


def _wait(delay: float | None, until: datetime | None, until_input: bool) -> pb.Wait:
    wait = pb.Wait(until_input=until_input)
    if delay is not None:
        if not math.isfinite(delay) or delay < 0:
            raise InvalidArgument(f"delay must be >= 0 seconds, got {delay!r}", field="delay")
        wait.delay.FromNanoseconds(round(delay * 1e9))
    if until is not None:
        if until.tzinfo is None:
            raise InvalidArgument("until must be timezone-aware", field="until")
        wait.until.FromDatetime(until.astimezone(UTC))
    return wait


def _small_failure(commit: jpb.Commit) -> jpb.Commit:
    """``commit``, a failure refused as too large, without its state and with
    its error cut to ``FAILURE_ERROR_BYTES``: it fits any record."""
    error = commit.error.encode()
    if len(error) > FAILURE_ERROR_BYTES:
        cut = error[: FAILURE_ERROR_BYTES - 64].decode(errors="ignore")
        commit.error = f"{cut}... ({len(error):,} bytes in all)"
    commit.ClearField("state")
    commit.ClearField("state_delta")
    commit.has_state = False
    return commit


def _failure(error: str | BaseException, reason: str, kind: pb.FailureKind.ValueType) -> pb.Fail:
    return pb.Fail(error=describe_error(error), kind=kind, reason=reason)
