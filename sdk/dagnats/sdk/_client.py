"""The client for operators and applications: workflows and runs.

Every method is one engine call through ``_rpc`` (a deadline, transport
retries, domain errors) and returns the contract's own messages, whose typed
stubs document every field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from types import TracebackType
from typing import Any, Self

from dagnats.core.errors import DeadlineExceeded, Unavailable
from dagnats.core.payload import decode, encode
from dagnats.core.run_settings import check_settings
from dagnats.core.status import FINAL_RUN_STATUSES
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._errors import RunFailed
from dagnats.sdk._journal import InputMode
from dagnats.sdk._rpc import EngineRpc, RetryPolicy
from dagnats.sdk._usage import Budget


def run_output(run: pb.Run) -> Any:
    """The run's output, JSON-decoded; None when it has none.

    Raises:
        InvalidArgument: the output is not JSON.
    """
    return decode(run.output, field="output")


class Client:
    """Registers workflows and starts, watches, cancels and purges runs.

    Use it as ``async with Client(target) as c:`` or close it with
    ``await c.close()``. The connection opens on the first call.

    Args:
        target: Address of the engine, such as ``"localhost:7233"``.
        timeout: Deadline of one engine call, in seconds.
        retry_for: Seconds a call keeps retrying an engine it cannot reach
            (a restart, a leader election) before it raises ``Unavailable``.
        credentials: Token and TLS files; by default from the environment
            (``DAGNATS_TOKEN``, ``DAGNATS_TLS_CA``, ...; see ``Credentials``).
        inputs_target: Address of the inputs service when it runs apart from
            the engine (``dagnats serve inputs``); by default ``target``.

    Every method raises the domain error the engine answered with
    (``InvalidArgument``, ``NotFound``, ``Conflict``, ...), ``Unauthenticated``
    or ``PermissionDenied`` when the engine refused the credential, or
    ``Unavailable`` when the engine could not be reached after retries.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 10.0,
        retry_for: float = 30.0,
        credentials: Credentials | None = None,
        inputs_target: str | None = None,
    ) -> None:
        self._rpc = EngineRpc(
            target,
            timeout=timeout,
            retry=RetryPolicy(budget=retry_for),
            credentials=credentials,
            inputs_target=inputs_target,
        )

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
        """Close the connection; calls in flight are cancelled."""
        await self._rpc.close()

    # Workflows.

    async def register_workflow(self, document: str | Mapping[str, Any]) -> pb.Workflow:
        """Validate and store a workflow definition under its name.

        Args:
            document: YAML or JSON text, or a mapping (sent as JSON).

        Returns:
            The definition as stored.
        """
        text = document if isinstance(document, str) else _mapping_to_json(document)
        response = await self._rpc.register_workflow(pb.RegisterWorkflowRequest(document=text))
        return response.workflow

    async def get_workflow(self, name: str) -> pb.Workflow:
        """The definition registered under ``name``.

        Raises:
            NotFound: no workflow has that name.
        """
        response = await self._rpc.get_workflow(pb.GetWorkflowRequest(name=name))
        return response.workflow

    async def list_workflows(self) -> list[pb.Workflow]:
        """Every registered definition."""
        response = await self._rpc.list_workflows(pb.ListWorkflowsRequest())
        return list(response.workflows)

    # Runs.

    async def start_run(
        self,
        workflow: str,
        input: Any = None,
        *,
        idempotency_key: str = "",
        settings: Mapping[str, str] | None = None,
        budget: Budget | None = None,
    ) -> pb.Run:
        """Start a run of ``workflow``.

        Args:
            workflow: Name of a registered workflow.
            input: The run's input (JSON-serialisable).
            idempotency_key: A repeat with the same key returns the first run.
                Give one to make the call safe to retry after a timeout.
            settings: What its handlers read as ``TaskContext.settings``.
            budget: What the run's model calls may spend (the workflow's
                budget when None).

        Returns:
            The run (the existing one when the key was used before).

        Raises:
            InvalidArgument: ``input`` is not JSON, or a setting is malformed;
                nothing was sent.
            NotFound: no workflow has that name.
        """
        request = pb.StartRunRequest(
            workflow=workflow,
            input=encode(input, field="input"),
            idempotency_key=idempotency_key,
            settings=check_settings(settings or {}),
            budget=budget.to_proto() if budget is not None else None,
        )
        response = await self._rpc.start_run(request)
        return response.run

    async def fork_run(
        self,
        run_id: str,
        step_id: str,
        at_seq: int,
        *,
        input: Any = None,
        settings: Mapping[str, str] | None = None,
        steer: Any = None,
        idempotency_key: str = "",
    ) -> pb.ForkRunResponse:
        """Start a new run from the record at ``at_seq`` of ``step_id``'s
        journal in run ``run_id``: its journal starts with a copy of the
        records through that one, so nothing before it runs again.

        Args:
            run_id: The source run (running or ended).
            step_id: The step whose journal is copied.
            at_seq: The last record copied.
            input: The new run's input; None keeps the source's.
            settings: Settings set on top of the source's (an empty value
                removes one).
            steer: A steering input (JSON-serialisable) the forked step places.
            idempotency_key: A repeat with the same key answers the same run.

        Returns:
            The answer: the new run, whether this call made it, how many
            records it copied.

        Raises:
            InvalidArgument: a malformed argument, or a record no run can
                resume after (a cancel, a commit that ends the step).
            NotFound: no such run (or it was purged), or no such step.
        """
        changes = pb.ForkChanges(settings=check_settings(settings or {}))
        if input is not None:
            changes.input, changes.has_input = encode(input, field="input"), True
        if steer is not None:
            changes.steer = encode(steer, field="steer")
        request = pb.ForkRunRequest(
            run_id=run_id,
            step_id=step_id,
            at_seq=at_seq,
            changes=changes,
            idempotency_key=idempotency_key,
        )
        return await self._rpc.fork_run(request)

    async def get_run(self, run_id: str) -> pb.Run:
        """The run and the state of its steps.

        Raises:
            NotFound: no run has that id.
        """
        response = await self._rpc.get_run(pb.GetRunRequest(run_id=run_id))
        return response.run

    async def run_usage(self, run_id: str) -> pb.RunUsage:
        """What the run's model calls spent, per step and in total: kept,
        retried and fenced calls apart (``spent`` is all three), and the
        calls a fork copied from its source (``copied``: not spent by this
        run), read from the run's journals.

        Raises:
            NotFound: no run has that id.
        """
        return (await self.get_run_and_usage(run_id))[1]

    async def get_run_and_usage(self, run_id: str) -> tuple[pb.Run, pb.RunUsage]:
        """The run and its usage (see :meth:`run_usage`), in one call.

        Raises:
            NotFound: no run has that id.
        """
        response = await self._rpc.get_run(pb.GetRunRequest(run_id=run_id, with_usage=True))
        return response.run, response.usage

    async def list_runs(
        self,
        *,
        workflow: str = "",
        status: pb.RunStatus.ValueType | None = None,
        limit: int = 0,
    ) -> list[pb.Run]:
        """Runs, newest first.

        Args:
            workflow: Only runs of this workflow, when set.
            status: Only runs with this status, when set.
            limit: Most runs to return; 0 lets the engine choose (100).
        """
        request = pb.ListRunsRequest(
            workflow=workflow,
            status=pb.RUN_STATUS_UNSPECIFIED if status is None else status,
            limit=limit,
        )
        response = await self._rpc.list_runs(request)
        return list(response.runs)

    async def watch_runs(
        self,
        *,
        workflow: str = "",
        status: pb.RunStatus.ValueType | None = None,
        limit: int = 0,
    ) -> AsyncGenerator[pb.WatchRunsResponse, None]:
        """A live list of runs: first a snapshot (``snapshot`` true, ``runs``
        the list as ``list_runs`` answers it), then each change of it as runs
        are stored (``runs`` changed or entered, ``removed`` left). Runs come
        without input and outputs. The engine pushes every change; an engine
        restart is ridden out for ``retry_for`` seconds and answered with a new
        snapshot. It never ends by itself.

        Args:
            workflow: Only runs of this workflow, when set.
            status: Only runs with this status, when set.
            limit: Most runs in the list; 0 means 100, at most 1000.

        Raises:
            InvalidArgument: a bad workflow name, status or limit.
            Unavailable: the engine could not be reached for ``retry_for`` seconds.
        """
        request = pb.WatchRunsRequest(
            workflow=workflow,
            status=pb.RUN_STATUS_UNSPECIFIED if status is None else status,
            limit=limit,
        )
        async for response in self._rpc.watch_runs(request):
            yield response

    async def cancel_run(self, run_id: str, reason: str = "") -> pb.Run:
        """Cancel a run and its child runs.

        Returns:
            The run after the cancel.
        """
        response = await self._rpc.cancel_run(pb.CancelRunRequest(run_id=run_id, reason=reason))
        return response.run

    async def upgrade_run(self, run_id: str, build_id: str) -> pb.Run:
        """Move a running run to worker build ``build_id``: each step that
        recorded a build goes to that one, and a pinned step whose task
        waits for its old build is dispatched again to the new one. Its next
        iterations replay nothing of the old build's iterations; an
        iteration cut short on the old build is replayed by the new code.

        Returns:
            The run after the move.

        Raises:
            InvalidArgument: a malformed run id or build id.
            NotFound: no run has that id.
            Conflict: the run has ended.
        """
        request = pb.UpgradeRunRequest(run_id=run_id, build_id=build_id)
        return (await self._rpc.upgrade_run(request)).run

    async def purge_run(self, run_id: str) -> None:
        """Delete a finished run and everything stored for it.

        Raises:
            Conflict: the run has not finished.
        """
        await self._rpc.purge_run(pb.PurgeRunRequest(run_id=run_id))

    async def watch_run(self, run_id: str) -> AsyncGenerator[pb.Run, None]:
        """Yield the run as it is now, then each time it changes, until it has
        ended: the last run yielded is completed, failed or cancelled.

        A change is any difference in the ``Run`` message: the run's status,
        output or error, or a step's status, iteration, attempt, output, error
        or wait. A watcher that falls far behind skips intermediate states,
        never the last one. The engine pushes each change (``WatchRun``); there
        is no polling. An engine restart is ridden out: the watch is opened
        again for ``retry_for`` seconds, and repeats nothing it yielded.

        Raises:
            InvalidArgument: a malformed run id.
            NotFound: no run has that id.
            Unavailable: the engine could not be reached for ``retry_for`` seconds.
        """
        async for response in self._rpc.watch_run(pb.WatchRunRequest(run_id=run_id)):
            yield response.run

    # The one public `timeout` parameter (ASYNC109): waiting for a run to finish
    # has its own budget, separate from the deadline of each engine call.
    async def wait_for_run(self, run_id: str, *, timeout: float = 60.0) -> pb.Run:  # noqa: ASYNC109
        """Wait until the run is completed, failed or cancelled (a ``WatchRun``
        with ``ended_only``: the answer comes as the engine stores the run's
        end, and none of the changes before it is sent).

        Args:
            run_id: The run.
            timeout: Seconds to wait in all.

        Returns:
            The finished run.

        Raises:
            DeadlineExceeded: the run had not finished after ``timeout`` seconds.
            NotFound: no run has that id.
        """
        return await self._wait(pb.WatchRunRequest(run_id=run_id, ended_only=True), timeout)

    async def _wait(self, request: pb.WatchRunRequest, seconds: float) -> pb.Run:
        """The run of a ``WatchRun`` of ``request`` once it has ended, waited
        for ``seconds`` in all."""
        run_id = request.run_id
        try:
            async with asyncio.timeout(seconds):
                async for response in self._rpc.watch_run(request):
                    run_id = response.run.run_id
                    if response.run.status in FINAL_RUN_STATUSES:
                        return response.run
        except TimeoutError:
            what = f"run {run_id}" if run_id else f"the run of {request.start.workflow}"
            raise DeadlineExceeded(f"{what} had not finished after {seconds}s") from None
        raise Unavailable(f"the watch of run {run_id} ended before the run did")

    async def run(
        self,
        workflow: str,
        input: Any = None,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109
        idempotency_key: str = "",
        settings: Mapping[str, str] | None = None,
        budget: Budget | None = None,
    ) -> Any:
        """Start a run of ``workflow``, wait for it and return its output.

        One ``WatchRun`` call starts the run and is answered twice: with the
        run as started, and once it has ended (``ended_only``: no message for
        the changes in between).

        Args:
            workflow: Name of a registered workflow.
            input: The run's input (JSON-serialisable).
            timeout: Seconds to wait for the run to finish; the run goes on
                after that, and a call with the same ``idempotency_key`` waits
                for the same run.
            idempotency_key: A repeat with the same key waits for the first run.
            settings: What its handlers read as ``TaskContext.settings``.
            budget: What the run's model calls may spend (the workflow's
                budget when None).

        Returns:
            The output of the completed run, JSON-decoded (None when it has none).

        Raises:
            RunFailed: the run failed or was cancelled; it carries the run.
            DeadlineExceeded: the run had not finished after ``timeout`` seconds.
            InvalidArgument: ``input`` is not JSON; nothing was sent.
            NotFound: no workflow has that name.
        """
        start = pb.StartRunRequest(
            workflow=workflow,
            input=encode(input, field="input"),
            idempotency_key=idempotency_key,
            settings=check_settings(settings or {}),
            budget=budget.to_proto() if budget is not None else None,
        )
        run = await self._wait(pb.WatchRunRequest(start=start, ended_only=True), timeout)
        if run.status != pb.RUN_STATUS_COMPLETED:
            raise RunFailed(run)
        return run_output(run)

    # Inputs.

    async def submit_input(
        self,
        run_id: str,
        step_id: str,
        request_id: str,
        content: Any,
        *,
        mode: InputMode = InputMode.STEER,
    ) -> tuple[ipb.Input, bool]:
        """Send an input to a running step; a repeat of ``request_id`` returns
        the original unchanged.

        Returns:
            The stored input and whether this call created it.

        Raises:
            Conflict: the step has finished.
            InvalidArgument: bad mode or content (not JSON, too large).
        """
        response = await self._rpc.submit_input(
            ipb.SubmitRequest(
                run_id=run_id,
                step_id=step_id,
                request_id=request_id,
                mode=ipb.Mode.ValueType(mode.value),
                content=encode(content, field="content"),
            )
        )
        return response.input, response.created

    async def get_input(
        self,
        run_id: str,
        step_id: str,
        request_id: str,
        *,
        wait: float = 0.0,
        if_status: ipb.Status.ValueType = ipb.STATUS_UNSPECIFIED,
    ) -> ipb.Input:
        """An input's state, waiting up to ``wait`` seconds (at most 60) for it
        to change.

        Args:
            wait: Seconds to wait for a change; 0 answers at once.
            if_status: The status the caller last saw: the answer comes as soon
                as the status differs from it, at once when it already does.
                Unset, the wait is for a change from the status on arrival.
        """
        request = ipb.GetRequest(
            run_id=run_id, step_id=step_id, request_id=request_id, if_status=if_status
        )
        if wait:
            request.wait.FromNanoseconds(round(wait * 1e9))
        response = await self._rpc.get_input(request, deadline=wait + self._rpc.timeout)
        return response.input

    async def withdraw_input(self, run_id: str, step_id: str, request_id: str) -> ipb.Input:
        """Withdraw a queued input.

        Raises:
            Conflict: it was placed already.
        """
        response = await self._rpc.withdraw_input(
            ipb.WithdrawRequest(run_id=run_id, step_id=step_id, request_id=request_id)
        )
        return response.input


def _mapping_to_json(document: Mapping[str, Any]) -> str:
    return encode(dict(document), field="document").decode()
