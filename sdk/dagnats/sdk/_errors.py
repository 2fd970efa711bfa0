"""Errors the SDK raises, and the ones a handler raises to steer its task.

The domain errors, ``JournalSignal`` and ``Fenced`` are the ones every dagnats
component shares (``dagnats.core.errors``); a failed call becomes the very error
the service raised, with its typed fields (a fenced write's ``expected`` and
``actual`` sequences), here (:func:`failure`, :func:`domain_error`,
:func:`answered_error`, on ``dagnats.core.grpcutil``) and nowhere else,
whichever transport carried it: a gRPC call (``grpc.aio.AioRpcError``), the
local socket or a Session stream (``TransportError``). No SDK user ever sees
either: the retry rules (``dagnats.sdk._rpc``) read their status.

    BaseException
    ├── RunCancelled                  the run was cancelled; the handler must stop
    │                                 (the journal refuses its writes with it)
    ├── ApprovalPending               a tool call waits for approval; the worker
    │                                 ends the iteration and the step waits for it
    ├── JournalSignal                 the task is settled or lost; return at once
    │   ├── Stale                     a late redelivery: a later dispatch exists
    │   ├── Committed                 this dispatch was committed before a crash
    │   ├── RestartLimit              too many deliveries without progress; the step failed
    │   └── Fenced                    a successor holds the step; write nothing
    └── Exception
        ├── DagnatsError              root of everything dagnats raises on purpose
        │   ├── InvalidArgument       bad input; names the field
        │   ├── NotFound              unknown workflow, run, step, ...
        │   ├── Conflict              the request contradicts current state
        │   ├── Unavailable           the engine could not be reached (after retries)
        │   ├── DeadlineExceeded      an operation ran out of time
        │   ├── Unauthenticated       the engine found no valid credential
        │   ├── PermissionDenied      the credential's role may not make the call
        │   ├── ReplayMismatch        a different call at a recorded position
        │   ├── BudgetExceeded        the run spent its budget: a model call refused
        │   ├── InputsQueued          continue_(until_input=True) with inputs queued
        │   ├── RunFailed             Client.run: the run failed or was cancelled
        │   └── TaskAlreadySettled    a second continue_/complete/fail/pause on one task
        ├── ConcurrentJournalUse      two asyncio tasks used one journal handle
        └── PermanentError            raised by a handler: fail the step, no retry

``RunCancelled`` and the journal signals derive from ``BaseException`` so that
an ``except Exception:`` in handler code cannot swallow them: they always reach
the worker, which has settled the task already (or, for ``Fenced``, must leave
it alone: acknowledging would take the task from its successor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
import grpc.aio

from dagnats.core.errors import (
    BudgetExceeded,
    Conflict,
    DagnatsError,
    DeadlineExceeded,
    Fenced,
    InvalidArgument,
    JournalSignal,
    NotFound,
    PermissionDenied,
    ReplayMismatch,
    RunCancelled,
    Unauthenticated,
    Unavailable,
)
from dagnats.core.frames import TransportError
from dagnats.core.grpcutil import (
    WireError,
    error_code,
    error_from_rpc,
    error_from_status,
    status_code,
)
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.journal.v1 import journal_pb2 as jpb

__all__ = [
    "ApprovalPending",
    "BudgetExceeded",
    "Committed",
    "ConcurrentJournalUse",
    "Conflict",
    "DagnatsError",
    "DeadlineExceeded",
    "Fenced",
    "InputsQueued",
    "InvalidArgument",
    "JournalSignal",
    "NotFound",
    "PermanentError",
    "PermissionDenied",
    "ReplayMismatch",
    "RestartLimit",
    "RunCancelled",
    "RunFailed",
    "Stale",
    "TaskAlreadySettled",
    "Unauthenticated",
    "Unavailable",
]


class ApprovalPending(BaseException):
    """A tool call declared ``approval=True`` waits for an approval: its intent
    and digest are stored, and the tool did not run.

    Raised through the handler to the worker, which ends the iteration with a
    continue that waits for an input (holding no worker); the approval input
    wakes the step, and the next iteration makes the call again and finds it.
    A handler that settles the task itself (after saving its state) may catch it.

    Attributes:
        key: The waiting call's idempotency key (an approval names it).
        digest: The digest of its name and arguments (an approval names it too).
        name: The tool.
        input: Its arguments (JSON-decoded).
        waiting: Every call that waits, this one first: more than one for a
            parallel group (``Journal.tools``) with several calls needing one.
        results: For a parallel group, its results in the order of its calls
            (``ToolResult``; the waiting ones ``awaiting_approval``), all
            stored before this was raised; empty for a call alone.
    """

    def __init__(
        self,
        *,
        key: str,
        digest: str,
        name: str,
        input: object,
        others: Sequence[ApprovalPending] = (),
        results: Sequence[Any] = (),
    ) -> None:
        super().__init__(f"tool call {key} ({name}) waits for approval of digest {digest}")
        self.key = key
        self.digest = digest
        self.name = name
        self.input = input
        self.waiting: tuple[ApprovalPending, ...] = (self, *others)
        self.results: tuple[Any, ...] = tuple(results)


class PermanentError(Exception):
    """Raised by a handler to fail its step without a retry.

    Any other exception fails the attempt and lets the step's retry policy
    decide; this one tells the engine that trying again cannot help.

    Attributes:
        message: What went wrong.
        reason: A machine-readable reason, such as ``"bad_input"`` (may be empty).
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class TaskAlreadySettled(DagnatsError):
    """A task was settled twice (``continue_``, ``complete``, ``fail`` or ``pause``).

    Attributes:
        run_id: The run of the task.
        step_id: The step of the task.
        settled_as: The outcome the task was already settled with (``"complete"``, ...).
    """

    code = "task_already_settled"

    def __init__(self, *, run_id: str, step_id: str, settled_as: str) -> None:
        super().__init__(
            f"task of step {step_id!r} of run {run_id} was already settled with {settled_as}"
        )
        self.run_id = run_id
        self.step_id = step_id
        self.settled_as = settled_as


class Stale(JournalSignal):
    """A late redelivery: the journal is past this dispatch. Nothing ran."""


class Committed(JournalSignal):
    """This dispatch was committed by a holder that crashed before its event
    was published; the outcome was reported again and the turn is not repeated."""


class RestartLimit(JournalSignal):
    """The iteration was delivered ``restart_limit`` times in a row without
    progress; the failure was committed and reported, and the retry policy
    applies."""


class ConcurrentJournalUse(RuntimeError):
    """Two asyncio tasks used one journal handle at once. Calls are replayed by
    position, so they must be made one at a time; the tool calls of one model
    response run at once through ``Journal.tools`` (a parallel group)."""


class InputsQueued(DagnatsError):
    """``continue_(until_input=True)`` found inputs already queued: place them
    and run another turn instead of waiting. Nothing was settled."""

    code = "inputs_queued"


class RunFailed(DagnatsError):
    """A run that :meth:`Client.run` waited for failed or was cancelled.

    Attributes:
        run_id: The run.
        status: ``"failed"`` or ``"cancelled"``.
        error: The run's error: the failed step's, or the cancel's reason.
        run: The run as it ended.
    """

    code = "run_failed"

    def __init__(self, run: epb.Run) -> None:
        status = "cancelled" if run.status == epb.RUN_STATUS_CANCELLED else "failed"
        what = "was cancelled" if status == "cancelled" else "failed"
        super().__init__(f"run {run.run_id} of {run.workflow} {what}: {run.error or 'no error'}")
        self.run_id = run.run_id
        self.status = status
        self.error = run.error
        self.run = run


# ---- the one place a failed call becomes an error -----------------------------------

# A call that failed on its way: gRPC's, or the local transport's (and a
# Session stream's) own.
CallFailure = grpc.aio.AioRpcError | TransportError
# The domain errors a call is answered with (``WireError``), to catch.
ANSWERED = (DagnatsError, Fenced, RunCancelled)


class Failure(NamedTuple):
    """What the retry rules read of a failed call."""

    status: grpc.StatusCode
    details: str
    code: str  # the dagnats error code the server sent; empty when none


def failure(err: BaseException) -> Failure | None:
    """The status of a call that failed on its way; None for any other exception."""
    if isinstance(err, grpc.aio.AioRpcError):
        return Failure(err.code(), err.details() or "", error_code(err))
    if isinstance(err, TransportError):
        return Failure(err.code, err.message, "")
    return None


def domain_error(err: CallFailure) -> WireError:
    """The domain error a failed call stands for, as the service raised it."""
    if isinstance(err, grpc.aio.AioRpcError):
        return error_from_rpc(err)
    return error_from_status(err.code, err.message, "", "")


def answered_error(error: jpb.SessionError) -> WireError:
    """The domain error a call on a Session stream or the local socket was
    answered with, as its own RPC would have raised it."""
    status = status_code(error.status)
    return error_from_status(status, error.message, error.code, error.field, dict(error.details))
