"""The inputs operations and the InputsService servicer.

:class:`Inputs` holds the one implementation of submit, get, withdraw and
list, as plain async methods from protobuf request to protobuf response that
raise domain errors. The gRPC servicer and the NATS endpoints
(:mod:`dagnats.inputs.natsapi`) both call it. Decisions come from
:mod:`dagnats.inputs.rules`; bytes move through :mod:`dagnats.inputs.store`.

No accepted input is left queued on a finished step: a submission is checked
against the run before the record is created and again after, and an input
created while the step finished is closed (``unanswered``) and refused.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable

from dagnats.core import errors
from dagnats.core.grpcutil import Context, domain_errors
from dagnats.core.ids import check_request_id, check_run_id, check_token
from dagnats.core.status import step_status_from_proto
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.inputs import convert, rules
from dagnats.inputs.rules import InputState, Refusal, Status
from dagnats.inputs.store import InputStore, StaleRevision, close_input
from dagnats.inputs.v1 import inputs_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2_grpc as pb_grpc

MAX_WAIT = rules.MAX_WAIT


def _new_nonce() -> str:
    return secrets.token_hex(8)


def _check_names(run_id: str, step_id: str, request_id: str) -> None:
    check_run_id(run_id)
    check_token(step_id, field="step_id")
    check_request_id(request_id)


def _check_wait(request: pb.GetRequest) -> float:
    wait = request.wait.ToNanoseconds() / 1e9
    if wait < 0 or wait > MAX_WAIT:
        raise errors.InvalidArgument(
            f"wait is {wait:g}s; it must be between 0 and {MAX_WAIT:g}s", field="wait"
        )
    return wait


def _check_status_filter(status: int, field: str) -> Status | None:
    if not status:
        return None
    found = convert.status_from_proto(status)
    if found is None:
        raise errors.InvalidArgument(f"{field} {status} is not a status", field=field)
    return found


def _accepts_inputs(run: epb.Run | None, step_id: str) -> bool:
    step = convert.find_step(run, step_id) if run is not None else None
    if run is None or step is None:
        return False
    running = run.status == epb.RUN_STATUS_RUNNING
    return rules.accepts_inputs(running, step_status_from_proto(step.status))


def _finished(run_id: str, step_id: str) -> errors.Conflict:
    return errors.Conflict(f"step {step_id} of run {run_id} has finished; it takes no more inputs")


class Inputs:
    """Submit, get, withdraw and list, independent of the transport.

    Args:
        store: the JetStream adapter.
        clock: seconds since the epoch.
        nonce: a fresh random token per call (recognises a retried create).
        max_bytes: the largest content accepted.
    """

    def __init__(
        self,
        store: InputStore,
        *,
        clock: Callable[[], float] = time.time,
        nonce: Callable[[], str] = _new_nonce,
        max_bytes: int = rules.MAX_CONTENT_BYTES,
    ) -> None:
        self.store = store
        self._clock = clock
        self._nonce = nonce
        self._max_bytes = max_bytes

    async def submit(self, request: pb.SubmitRequest) -> pb.SubmitResponse:
        """Queue an input, or return the one stored under its request id.

        Raises:
            InvalidArgument: a malformed field; nothing is stored.
            NotFound: no such run or step.
            Conflict: the step has finished.
        """
        submission = rules.check_submission(
            request.run_id,
            request.step_id,
            request.request_id,
            convert.mode_from_proto(request.mode),
            request.content,
            max_bytes=self._max_bytes,
        )
        run_id, step_id = submission.run_id, submission.step_id
        run: epb.Run | None = await self._require_step(run_id, step_id)
        if not _accepts_inputs(run, step_id):
            # A retry of an input accepted before the step finished still
            # gets the original back: its record lives as long as its run.
            existing = await self.store.get(run_id, step_id, submission.request_id)
            if existing is None:
                raise _finished(run_id, step_id)
            # If it is still queued, its first try created it after the step
            # finished and stopped before checking the run again, so the
            # step's close missed it: it is closed here, then answered.
            state, _ = await close_input(self.store, *existing, self._clock())
            return self._submitted(state or existing[0], run, created=False)
        fresh = rules.new_input(submission, created_by=self._nonce(), now=self._clock())
        state, created = await self.store.create(fresh)
        if created:
            run = await self.store.load_run(run_id)
            if not _accepts_inputs(run, step_id):
                state = await self._close_created(state)
        if state.status is Status.QUEUED:
            # Published on a repeat too (the Msg-Id dedupes it), so a client's
            # retry repairs a crash between the create and this publish.
            await self.store.publish_submitted(state, self._clock())
        return self._submitted(state, run, created=created)

    async def _require_step(self, run_id: str, step_id: str) -> epb.Run:
        run = await self.store.load_run(run_id)
        if run is None:
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        if convert.find_step(run, step_id) is None:
            raise errors.NotFound(f"run {run_id} has no step {step_id}", field="step_id")
        return run

    async def _close_created(self, state: InputState) -> InputState:
        """The step finished while ``state`` was being created: close it, and
        refuse unless a placement got to it first (then it was answered)."""
        stored = await self.store.get(state.run_id, state.step_id, state.request_id)
        if stored is not None:
            current, _ = await close_input(self.store, stored[0], stored[1], self._clock())
            if current is not None and current.status in (Status.PLACED, Status.WITHDRAWN):
                return current
        raise _finished(state.run_id, state.step_id)

    def _submitted(
        self, state: InputState, run: epb.Run | None, *, created: bool
    ) -> pb.SubmitResponse:
        return pb.SubmitResponse(input=convert.to_proto(self._seen(state, run)), created=created)

    def _seen(self, state: InputState, run: epb.Run | None) -> InputState:
        """The input as a client sees it now (``rules.visible``)."""
        window = self.store.dedupe_window
        return convert.visible(state, run, now=self._clock(), window=window)

    def _until_expiry(self, state: InputState, left: float) -> float:
        """Seconds a wait on ``state`` may last: ``left``, or less when it is
        queued and expires sooner."""
        if state.status is not Status.QUEUED:
            return left
        expiry = state.created_at + self.store.dedupe_window - self._clock()
        return min(left, max(expiry, 0.0) + 0.001)

    async def get(self, request: pb.GetRequest) -> pb.GetResponse:
        """The input with the status a client sees, waiting up to ``wait`` for
        it to differ from ``if_status`` (or, when that is unset, from now).

        Raises:
            InvalidArgument: a malformed field or a wait over 60 s.
            NotFound: no such input.
        """
        _check_names(request.run_id, request.step_id, request.request_id)
        wait = _check_wait(request)
        if_status = _check_status_filter(request.if_status, "if_status")
        if not wait:
            stored = await self.store.get(request.run_id, request.step_id, request.request_id)
            if stored is None:
                raise _no_input(request.request_id)
            run = await self.store.load_run(request.run_id)
            return pb.GetResponse(input=convert.to_proto(self._seen(stored[0], run)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        async with self.store.watch(request.run_id, request.step_id, request.request_id) as watch:
            if watch.input is None:
                raise _no_input(request.request_id)
            seen = if_status or self._seen(watch.input, watch.run).status
            while self._seen(watch.input, watch.run).status is seen:
                left = deadline - loop.time()
                if left <= 0:
                    break
                # A queued input expires by the clock, with no write to wake
                # the watch: it is looked at again at its expiry at the latest.
                await watch.next(self._until_expiry(watch.input, left))
                if watch.input is None:
                    raise _no_input(request.request_id)
            return pb.GetResponse(input=convert.to_proto(self._seen(watch.input, watch.run)))

    async def withdraw(self, request: pb.WithdrawRequest) -> pb.WithdrawResponse:
        """Withdraw a queued input; a repeat returns the withdrawn input.

        Raises:
            NotFound: no such input.
            Conflict: the input was placed, or the step finished first.
        """
        _check_names(request.run_id, request.step_id, request.request_id)
        while True:
            stored = await self.store.get(request.run_id, request.step_id, request.request_id)
            if stored is None:
                raise _no_input(request.request_id)
            state, revision = stored
            now, window = self._clock(), self.store.dedupe_window
            match rules.withdraw(state, now=now, window=window):
                case Refusal(message=message):
                    raise errors.Conflict(message)
                case InputState() as withdrawn:
                    if withdrawn != state:
                        try:
                            await self.store.update(withdrawn, revision)
                        except StaleRevision:
                            continue  # placed or withdrawn meanwhile: decide again
                    return pb.WithdrawResponse(input=convert.to_proto(withdrawn))

    async def list(self, request: pb.ListRequest) -> pb.ListResponse:
        """The inputs of a step, oldest first, optionally one status (as seen
        by clients) or one mode only. A step without inputs lists none; an
        unknown run or step is ``NotFound``."""
        check_run_id(request.run_id)
        check_token(request.step_id, field="step_id")
        status = _check_status_filter(request.status, "status")
        mode = convert.mode_from_proto(request.mode) if request.mode else None
        if request.mode and mode is None:
            raise errors.InvalidArgument(f"mode {request.mode} is not a mode", field="mode")
        run = await self._require_step(request.run_id, request.step_id)
        found = []
        for state, _ in await self.store.list(request.run_id, request.step_id):
            seen = self._seen(state, run)
            if (status is None or seen.status is status) and (mode is None or state.mode is mode):
                found.append(convert.to_proto(seen))
        return pb.ListResponse(inputs=found)


def _no_input(request_id: str) -> errors.NotFound:
    return errors.NotFound(f"no input with request_id {request_id!r}", field="request_id")


class InputsServicer(pb_grpc.InputsServiceServicer):
    """InputsService over gRPC; every method is :class:`Inputs`' own."""

    def __init__(self, logic: Inputs) -> None:
        self.logic = logic

    @domain_errors
    async def Submit(self, request: pb.SubmitRequest, context: Context) -> pb.SubmitResponse:
        return await self.logic.submit(request)

    @domain_errors
    async def Get(self, request: pb.GetRequest, context: Context) -> pb.GetResponse:
        return await self.logic.get(request)

    @domain_errors
    async def Withdraw(self, request: pb.WithdrawRequest, context: Context) -> pb.WithdrawResponse:
        return await self.logic.withdraw(request)

    @domain_errors
    async def List(self, request: pb.ListRequest, context: Context) -> pb.ListResponse:
        return await self.logic.list(request)
