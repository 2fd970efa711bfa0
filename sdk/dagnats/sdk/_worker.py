"""The worker: polls the engine for tasks and runs one handler per task.

Invariants:

- The poll loop never runs a handler itself and never dies of an engine
  error: each leased task runs in its own asyncio task, and a failed poll is
  logged and retried after a jittered backoff.
- At most ``concurrency`` handlers run at once; a poll asks for exactly the
  free slots, so the worker never leases a task it cannot start.
- Every task ends with exactly one report unless the handler settled it: the
  outcome the handler chose, or one the worker derives from how it ended
  (see ``_conclude``). A report that cannot be delivered while the lease
  lasts is logged and dropped; the lease then expires and the engine
  delivers the task again.
- The lease is kept alive until the task is settled, the settle included: a
  call retried while the engine restarts keeps its lease when the engine is
  back. Only a holder extends it (see ``_keep_alive``).
- A cancelled run's handlers are cancelled as soon as the engine answers
  the worker's watch for it (``_cancels``, a poll naming the runs its
  handlers run), or else its heartbeat says so.
- Stopping cancels the poll in flight. Tasks that poll had already leased are
  not lost: their leases expire and the engine delivers them again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from google.protobuf.duration_pb2 import Duration
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from dagnats.core import tracing
from dagnats.core.errors import Conflict, DagnatsError, InvalidArgument, ReplayMismatch
from dagnats.core.ids import check_build_id, check_token, check_worker_id
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk._cancels import CancelWatch
from dagnats.sdk._context import ASSUMED_LEASE, Handover, TaskContext, describe_error
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._errors import (
    ApprovalPending,
    BudgetExceeded,
    Fenced,
    JournalSignal,
    PermanentError,
    RunCancelled,
)
from dagnats.sdk._rpc import EngineRpc
from dagnats.sdk._session import Session

BUILD_ID_ENV = "DAGNATS_BUILD_ID"

log = logging.getLogger("dagnats.sdk")

Handler = Callable[[TaskContext], Awaitable[None]]

T = TypeVar("T")

# Errors a handler raises that no retry can get past: an invalid argument (a
# record too large for the journal among them) and a replay mismatch. The step
# fails for good with the error's message.
REFUSALS = (InvalidArgument, ReplayMismatch, BudgetExceeded)

NOT_SETTLED = "handler returned without calling continue_, complete, fail or pause"
_MIN_HEARTBEAT = 0.05
_POLL_BACKOFF = 0.2
_POLL_BACKOFF_MAX = 10.0


class Worker:
    """Runs handlers for the tasks of the given task types.

    Use it as ``async with Worker(target, handlers={...}):`` (it polls in the
    background until the block ends) or ``await worker.run()`` until
    ``await worker.stop()``. A worker runs once.

    Args:
        target: Address of the engine, such as ``"localhost:7233"``.
        handlers: ``async def handler(tc: TaskContext) -> None`` by task type.
        concurrency: Most handlers running at once.
        poll_wait: Longest time one poll waits for tasks, in seconds.
        rpc_timeout: Deadline of every other engine call, in seconds.
        heartbeat_interval: Seconds between automatic heartbeats; by default a
            third of the task's lease, at least 0.05.
        worker_id: Names the worker in the engine's logs and its journal
            claims, at most 256 characters; by default ``host-pid-random``.
        restart_limit: A journaled iteration whose last this many deliveries
            (1 to 1000) made no progress -- their holders died before writing
            anything but their claims -- fails with reason ``restart_limit``
            (retriable: the step's retry policy applies).
        credentials: Token and TLS files (a worker's token has the worker
            role); by default from the environment (see ``Credentials``).
        journal_target: Address of the journal service when it runs apart
            from the engine (``dagnats serve journal``); by default ``target``.
        inputs_target: Address of the inputs service, likewise.
        kept_iterations: How many times in a row a task is kept for its
            step's next iteration (the kept task): a journaled ``continue_`` without
            a wait keeps the task, and the engine hands the next iteration to
            this worker with the commit's answer, with no trip through the task
            queue. After this many the next iteration goes back to the queue,
            so that other runs' tasks get a turn; 0 sends every iteration
            through it.
        local_socket: Path of the services' local socket, for a worker on
            their host: its journal calls go there, framed on a Unix socket,
            instead of on gRPC, which costs a call more than its own work; by
            default ``DAGNATS_LOCAL_SOCKET``. ``"off"`` keeps every call on
            gRPC. Unset, the journal calls and the polls go to the socket the
            engine's polls name when that path is a socket on this host, the
            journal's calls go to the engine's address, and the socket takes
            the worker's hello; else on gRPC. The other engine calls stay on
            gRPC.
        journal_sessions: Opens the sessions the journal calls go on, in
            place of the two above. The services pass their own when they run
            the handlers in their process (their method table, called in the
            process: ``dagnats.engine.local_transport.LocalSession``).
        build_id: The build of this worker's code, one token of at most 64
            characters (``A-Z a-z 0-9 _ -``), such as a release or a commit;
            by default ``DAGNATS_BUILD_ID``, else none. A step's first
            commit records its worker's build, and under the workflow's
            ``pinned`` policy (the default) the step's later dispatches go
            only to workers of that build. A worker without one takes only
            unpinned tasks, as before builds existed.

    Raises:
        InvalidArgument: a task type is not one NATS token, or a number is out of range.
    """

    def __init__(
        self,
        target: str,
        *,
        handlers: Mapping[str, Handler],
        concurrency: int = 4,
        poll_wait: float = 5.0,
        rpc_timeout: float = 10.0,
        heartbeat_interval: float | None = None,
        worker_id: str | None = None,
        restart_limit: int = 5,
        credentials: Credentials | None = None,
        journal_target: str | None = None,
        inputs_target: str | None = None,
        kept_iterations: int = 64,
        local_socket: str | None = None,
        journal_sessions: Callable[[], Session] | None = None,
        build_id: str | None = None,
    ) -> None:
        _check_options(handlers, concurrency, poll_wait, rpc_timeout, heartbeat_interval)
        if not 0 <= kept_iterations <= 1_000_000:
            raise InvalidArgument(
                f"kept_iterations must be 0..1000000, got {kept_iterations}",
                field="kept_iterations",
            )
        self._kept_iterations = kept_iterations
        if not 1 <= restart_limit <= 1000:
            raise InvalidArgument(
                f"restart_limit must be 1..1000, got {restart_limit}", field="restart_limit"
            )
        self._restart_limit = restart_limit
        self._handlers = dict(handlers)
        self._concurrency = concurrency
        self._poll_wait = poll_wait
        self._heartbeat_interval = heartbeat_interval
        self._worker_id = check_worker_id(worker_id or _default_worker_id())
        self._build_id = check_build_id(
            os.environ.get(BUILD_ID_ENV, "") if build_id is None else build_id
        )
        self._rpc = EngineRpc(
            target,
            timeout=rpc_timeout,
            credentials=credentials,
            journal_target=journal_target,
            inputs_target=inputs_target,
            local_socket=local_socket,
            sessions=journal_sessions,
        )
        self._inflight: set[asyncio.Task[None]] = set()
        self._contexts: set[TaskContext] = set()  # of the handlers running now
        self._running: dict[TaskContext, asyncio.Task[None]] = {}  # their handlers' tasks
        self._cancels = CancelWatch(self._watch_cancels, self._run_cancelled)
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._finished = asyncio.Event()
        self._started = False
        self._grace = 0.0
        self._background: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        """The id the worker polls with."""
        return self._worker_id

    @property
    def in_flight(self) -> int:
        """Handlers running now."""
        return len(self._inflight)

    async def __aenter__(self) -> Self:
        self._background = asyncio.create_task(self.run(), name=f"worker {self._worker_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
        if self._background is not None:
            await self._background

    async def run(self) -> None:
        """Poll and run handlers until :meth:`stop` is called or this call is cancelled.

        When cancelled, handlers in flight are cancelled at once and not reported
        (their leases expire and the engine delivers the tasks again).

        Raises:
            Conflict: the worker has already run.
        """
        if self._started:
            raise Conflict("a Worker runs once; create another")
        self._started = True
        log.info("worker %s polling for %s", self._worker_id, sorted(self._handlers))
        self._rpc.check_local_socket()
        watching = asyncio.create_task(self._cancels.run(), name="cancel watch")
        try:
            await self._poll_loop()
        except asyncio.CancelledError:
            self._grace = 0.0
            raise
        finally:
            try:
                await self._drain()
            finally:
                watching.cancel()
                await asyncio.wait((watching,))
                await self._rpc.close()
                self._finished.set()
                log.info("worker %s stopped", self._worker_id)

    async def stop(self, *, grace: float = 10.0) -> None:
        """Stop polling, let handlers in flight finish, then return. Their
        next commits release their tasks; a task a commit kept for the next
        iteration anyway is given back, not begun, so another worker takes
        it at once.

        Args:
            grace: Seconds to wait for handlers in flight; those still running
                then are cancelled without a report (their leases expire and the
                engine delivers the tasks again).
        """
        self._grace = grace
        self._stopping.set()
        for tc in self._contexts:
            # Their next commits release their tasks: kept, a task would wait
            # out its lease before another worker got it.
            tc._keep_task = False
        if self._started:
            await self._finished.wait()

    # The poll loop.

    async def _poll_loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            free = await self._free_slots()
            if free == 0:
                continue  # stopping
            sent = asyncio.get_running_loop().time()  # the leases count from here
            try:
                leased = await self._unless_stopping(self._poll(free))
            except Exception as err:
                failures += 1
                delay = _backoff(failures)
                _log_poll_failure(err, delay)
                await self._unless_stopping(asyncio.sleep(delay))
                continue
            failures = 0
            for task in leased or ():
                self._start(task, sent)

    async def _free_slots(self) -> int:
        while len(self._inflight) >= self._concurrency and not self._stopping.is_set():
            self._slot_freed.clear()
            await self._unless_stopping(self._slot_freed.wait())
        if self._stopping.is_set():
            return 0
        return self._concurrency - len(self._inflight)

    async def _poll(self, max_tasks: int) -> list[pb.LeasedTask]:
        wait = Duration()
        wait.FromNanoseconds(round(self._poll_wait * 1e9))
        request = pb.PollTasksRequest(
            task_types=list(self._handlers),
            max_tasks=max_tasks,
            wait=wait,
            worker_id=self._worker_id,
            # A first delivery's journal comes claimed with its lease when the
            # engine's process serves the journal too (the claim with the lease).
            claim_journal=True,
            restart_limit=self._restart_limit,
            build_id=self._build_id,
        )
        # The engine holds a poll up to poll_wait, so the deadline is on top of that.
        deadline = self._poll_wait + self._rpc.timeout
        response = await self._rpc.poll_tasks(request, deadline=deadline)
        return list(response.tasks)

    async def _watch_cancels(self, runs: Sequence[str]) -> Sequence[str]:
        """One watch for the cancel of ``runs``: a poll that leases nothing."""
        wait = Duration()
        wait.FromNanoseconds(round(self._poll_wait * 1e9))
        request = pb.PollTasksRequest(
            task_types=list(self._handlers),
            wait=wait,
            worker_id=self._worker_id,
            cancel_watch=runs,
        )
        response = await self._rpc.poll_tasks(request, deadline=self._poll_wait + self._rpc.timeout)
        return list(response.cancelled_runs)

    def _run_cancelled(self, run_id: str) -> None:
        """The engine said ``run_id`` was cancelled: stop its handlers now (but
        one settling its task, whose settle the run drops or the journal refuses)."""
        for tc, running in list(self._running.items()):
            if tc.run_id == run_id and not tc.settled:
                log.info("run %s was cancelled; cancelling step %s", run_id, tc.step_id)
                tc._mark_cancelled()
                running.cancel()

    async def _unless_stopping(self, work: Coroutine[Any, Any, T]) -> T | None:
        """Await ``work`` unless stop() comes first; then cancel it and return None."""
        job = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((job, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not job.done():
                job.cancel()
                await asyncio.wait((job,))
        return None if job.cancelled() else job.result()

    async def _drain(self) -> None:
        pending = set(self._inflight)
        if pending and self._grace > 0:
            _, pending = await asyncio.wait(pending, timeout=self._grace)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("cancelled %d handler(s) still running at shutdown", len(pending))
            await asyncio.wait(pending)

    # One task.

    def _start(self, leased: pb.LeasedTask, leased_at: float) -> None:
        tc = self._context(leased, leased_at, keep_task=self._kept_iterations > 0)
        task = asyncio.create_task(self._carry_on(tc), name=f"task {tc.run_id}/{tc.step_id}")
        self._inflight.add(task)
        task.add_done_callback(self._finished_task)

    def _finished_task(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._slot_freed.set()
        if not task.cancelled() and (err := task.exception()) is not None:
            log.error("task runner failed", exc_info=err)

    def _context(
        self,
        leased: pb.LeasedTask,
        leased_at: float,
        *,
        keep_task: bool,
        handed: Handover | None = None,
    ) -> TaskContext:
        return TaskContext(
            leased,
            self._rpc,
            worker_id=self._worker_id,
            build_id=self._build_id,
            restart_limit=self._restart_limit,
            leased_at=leased_at,
            keep_task=keep_task,
            handed=handed,
        )

    async def _carry_on(self, tc: TaskContext) -> None:
        """Run the task, then each next iteration its commit kept the task
        for (the kept task), in the same slot on the same lease, up to
        ``kept_iterations`` in a row. Once stopping, a task a commit kept
        anyway (sent before the stop) is given back, not begun: it is
        delivered again at once, rather than when its lease runs out."""
        kept_for = 0
        while True:
            tc._keep_task = tc._keep_task and not self._stopping.is_set()
            self._contexts.add(tc)
            try:
                await self._execute(tc)
            finally:
                self._contexts.discard(tc)
            kept = tc.next_task()
            if kept is None:
                return
            kept_for += 1
            tc = self._context(
                kept.leased,
                kept.leased_at,
                keep_task=kept_for < self._kept_iterations,
                handed=kept.handed,
            )
            if self._stopping.is_set():
                await _report(tc._give_back())
                return

    async def _execute(self, tc: TaskContext) -> None:
        handler = self._handlers.get(tc.task_type)
        if handler is None:  # the engine sent a type we did not ask for
            await _report(tc.fail(f"worker {self._worker_id} has no handler for {tc.task_type}"))
            return
        parent = tracing.extract(tc.trace_context)
        with tracing.span(
            f"task {tc.task_type}",
            parent,
            kind=SpanKind.CONSUMER,
            attributes={
                "run_id": tc.run_id,
                "step_id": tc.step_id,
                "iteration": tc.iteration,
                "attempt": tc.attempt,
            },
        ) as span:
            # Its own task, so that a cancelled run cancels the handler (and its
            # RPCs) without cancelling the code that reports the outcome.
            running = asyncio.create_task(_invoke(handler, tc))
            beats = asyncio.create_task(self._keep_alive(tc, running))
            self._running[tc] = running
            self._cancels.add(tc.run_id)
            try:
                await asyncio.wait((running,))
                # The lease stays alive while the outcome is reported.
                await self._conclude(tc, running, span)
            finally:
                del self._running[tc]
                self._cancels.remove(tc.run_id)
                beats.cancel()
                if not running.done():  # stop() gave up on this task
                    running.cancel()
                await asyncio.wait((running, beats))
                if tc.journaled is not None:
                    await tc.journaled.close()  # no write is left in flight on the stream
                tc._close()

    async def _keep_alive(self, tc: TaskContext, running: asyncio.Task[None]) -> None:
        interval = self._heartbeat_interval or max(
            (tc.lease_duration or ASSUMED_LEASE) / 3, _MIN_HEARTBEAT
        )
        while True:
            await asyncio.sleep(interval)
            if tc._settle_done:  # the lease is spent; nothing left to keep alive
                return
            try:
                journal = tc.journaled
                # Only a holder may extend the lease: a zombie's heartbeat would
                # extend its successor's deadline. The journal says who holds
                # the step; but while a journal call is in flight (retried
                # through a restart, say) it cannot be asked, and then the
                # lease itself answers: while it lasts, the task was given to
                # no one else.
                if journal is not None and not (journal.in_flight and tc._lease.live()):
                    await journal.check_tail()
                cancelled = await tc._beat()
            except RunCancelled:  # the journal says so: the run's end sealed it
                tc._mark_cancelled()
                cancelled = True
            except Fenced:
                log.warning("%s/%s: a successor holds the step; stopping", tc.run_id, tc.step_id)
                running.cancel()
                return
            except Exception as err:  # the next beat may get through; the lease is longer
                log.warning("heartbeat for %s/%s failed: %s", tc.run_id, tc.step_id, err)
                continue
            if cancelled:
                log.info("run %s was cancelled; cancelling step %s", tc.run_id, tc.step_id)
                running.cancel()
                return

    @staticmethod
    async def _conclude(tc: TaskContext, running: asyncio.Task[None], span: Span) -> None:
        err = None if running.cancelled() else running.exception()
        if err is not None:
            span.record_exception(err)
            span.set_status(Status(StatusCode.ERROR, describe_error(err)))
        if isinstance(err, RunCancelled):
            tc._mark_cancelled()
        if isinstance(err, JournalSignal) or tc.fenced:
            # Settled by the journal already, or fenced: a fenced holder must not
            # acknowledge (it would take the task from its successor).
            span.set_status(Status(StatusCode.OK))
            return
        if tc.cancelled and not tc._settle_done:
            # The engine drops any outcome of a cancelled run: the task is let go.
            await _report(tc._give_up_cancelled())
            return
        if tc.settled:
            if err is not None and not isinstance(err, RunCancelled):
                log.warning("handler for %s raised after settling its task", tc.task_type)
            return
        if isinstance(err, ApprovalPending):
            span.set_status(Status(StatusCode.OK))
            await _report(tc._wait_for_approval(err))
        elif isinstance(err, BudgetExceeded) and tc._pauses_for_budget():
            # The pause policy: the step waits for an input that raises it.
            span.set_status(Status(StatusCode.OK))
            await _report(tc._wait_for_budget(err))
        elif running.cancelled():
            await _report(tc.fail("handler was cancelled"))
        elif isinstance(err, PermanentError):
            await _report(tc.fail_permanent(err, reason=err.reason))
        elif isinstance(err, REFUSALS):
            # Deterministic: every other delivery or attempt would be refused
            # the same way, so the step fails now, saying why.
            log.error("handler for %s was refused: %s", tc.task_type, err)
            await _report(tc.fail_permanent(err, reason=err.code))
        elif err is not None:
            log.error("handler for %s failed", tc.task_type, exc_info=err)
            await _report(tc.fail(err))
        else:
            span.set_status(Status(StatusCode.ERROR, NOT_SETTLED))
            await _report(tc.fail(NOT_SETTLED))


async def _invoke(handler: Handler, tc: TaskContext) -> None:
    await handler(tc)


async def _report(settle: Awaitable[None]) -> None:
    try:
        await settle
    except (DagnatsError, Fenced, RunCancelled) as err:
        log.warning(
            "could not report a task (%s); its lease will expire and the engine "
            "will deliver it again",
            err,
        )


def _check_options(
    handlers: Mapping[str, Handler],
    concurrency: int,
    poll_wait: float,
    rpc_timeout: float,
    heartbeat_interval: float | None,
) -> None:
    if not handlers:
        raise InvalidArgument("a worker needs at least one handler", field="handlers")
    for task_type, handler in handlers.items():
        check_token(task_type, field="handlers")
        if not callable(handler):
            raise InvalidArgument(f"handler for {task_type!r} is not callable", field="handlers")
    if concurrency < 1:
        raise InvalidArgument("concurrency must be at least 1", field="concurrency")
    if poll_wait <= 0:
        raise InvalidArgument("poll_wait must be positive", field="poll_wait")
    if rpc_timeout <= 0:
        raise InvalidArgument("rpc_timeout must be positive", field="rpc_timeout")
    if heartbeat_interval is not None and heartbeat_interval <= 0:
        raise InvalidArgument("heartbeat_interval must be positive", field="heartbeat_interval")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _backoff(failures: int) -> float:
    ceiling = min(_POLL_BACKOFF_MAX, _POLL_BACKOFF * 2 ** min(failures, 16))
    return random.uniform(ceiling / 2, ceiling)


def _log_poll_failure(err: Exception, delay: float) -> None:
    if isinstance(err, DagnatsError):
        log.warning("polling the engine failed (%s); retrying in %.2fs", err, delay)
    else:
        log.error("polling the engine failed; retrying in %.2fs", delay, exc_info=err)
