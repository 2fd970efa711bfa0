"""Domain errors shared by every dagnats component.

Services raise these; the one table of ``dagnats.core.grpcutil`` maps each to
a gRPC status with its code, field and typed fields in the trailers (or in a
``SessionError`` on the journal's Session stream), and ``grpcutil`` rebuilds
the same error from them on the way back, so no caller outside that module
sees a ``grpc.RpcError`` and a client gets the fields the service raised
(a fenced write's expected and actual sequences).

    BaseException
    ├── RunCancelled                  the run was cancelled (or ended): stop, write nothing
    ├── JournalSignal                 the journal decided the task's fate (the SDK's
    │   │                             Stale, Committed and RestartLimit too)
    │   └── Fenced                    a successor holds the step; write nothing more
    └── Exception
        └── DagnatsError              root of every error raised on purpose
            ├── InvalidArgument       bad input; names the field
            │   └── RecordTooLarge    a journal record over the documented maximum
            │       └── StateTooLarge a step's state past the state size setting
            ├── NotFound              unknown workflow, run, step, ...
            ├── Conflict              the request contradicts current state
            ├── Unavailable           transport or backend trouble; retriable
            │   └── NotProvisioned    a stream or bucket the call needs is missing
            ├── DeadlineExceeded      an operation ran out of time
            ├── Unauthenticated       the call carried no valid credential
            ├── PermissionDenied      the credential's role may not make the call
            ├── ReplayMismatch        the handler made a different call at a
            │                         recorded position; nothing was written
            └── BudgetExceeded        the run spent its budget: a model call is
                                      refused; deterministic, never retried

``Fenced`` is a ``BaseException``, as the other journal signals are, so that an
``except Exception:`` in a handler cannot swallow it: a fenced holder must stop
(its acknowledgement would take the task from its successor). Services raise
and answer it like any domain error. So is ``RunCancelled``: the journal
refuses a cancelled run's writes with it, and a handler must stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class DagnatsError(Exception):
    """Root of every error dagnats raises on purpose."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def details(self) -> dict[str, str]:
        """The error's typed fields, as text, for the wire (none here)."""
        return {}

    @classmethod
    def from_wire(cls, message: str, field: str | None, details: Mapping[str, str]) -> DagnatsError:
        """The error a service raised, from what its status carried."""
        return cls(message, field=field)


class InvalidArgument(DagnatsError):
    """The request is malformed; ``field`` names the offending field when known."""

    code = "invalid_argument"


class RecordTooLarge(InvalidArgument):
    """A journal record would be larger than the journal stores; nothing was written."""

    code = "record_too_large"


class StateTooLarge(RecordTooLarge):
    """A step's state is past the state size setting (``DAGNATS_STATE_MAX_BYTES``);
    nothing was written."""

    code = "state_too_large"


class NotFound(DagnatsError):
    """The named object does not exist."""

    code = "not_found"


class Conflict(DagnatsError):
    """The request contradicts the current state (e.g. purging a running run)."""

    code = "conflict"


class Unavailable(DagnatsError):
    """The backend could not be reached; the call may be retried."""

    code = "unavailable"


class NotProvisioned(Unavailable):
    """A stream or bucket the call needs does not exist: the install was not
    provisioned (or was damaged). Retrying does not help until it is."""

    code = "not_provisioned"


class DeadlineExceeded(DagnatsError):
    """The operation did not finish in time."""

    code = "deadline_exceeded"


class Unauthenticated(DagnatsError):
    """The call carried no valid credential (a bearer token or a client
    certificate the server maps to a role)."""

    code = "unauthenticated"


class PermissionDenied(DagnatsError):
    """The caller's credential is valid, but its role may not make this call."""

    code = "permission_denied"


class ReplayMismatch(DagnatsError):
    """The call at a position differs from the one the journal recorded there."""

    code = "replay_mismatch"


class BudgetExceeded(DagnatsError):
    """The run spent its budget: the journal refuses a new model call. As
    deterministic as a replay mismatch: a retry would be refused the same way,
    so the step fails, or waits for an input that raises the budget (the
    run's budget policy).

    Attributes:
        run_id: The run.
        step_id: The step whose model call was refused.
        tokens: Tokens the run spent (input and output).
        cost_micros: What the run spent, in millionths of the price table's currency.
        budget_tokens: The token budget, raises included (0: none).
        budget_cost_micros: The cost budget, raises included (0: none).
    """

    code = "budget_exceeded"

    def __init__(
        self,
        run_id: str,
        *,
        step_id: str = "",
        tokens: int = 0,
        cost_micros: int = 0,
        budget_tokens: int = 0,
        budget_cost_micros: int = 0,
        detail: str = "",
    ) -> None:
        super().__init__(detail or f"run {run_id} spent its budget")
        self.run_id = run_id
        self.step_id = step_id
        self.tokens = tokens
        self.cost_micros = cost_micros
        self.budget_tokens = budget_tokens
        self.budget_cost_micros = budget_cost_micros

    def details(self) -> dict[str, str]:
        return {
            "run_id": self.run_id,
            "step_id": self.step_id,
            "tokens": str(self.tokens),
            "cost_micros": str(self.cost_micros),
            "budget_tokens": str(self.budget_tokens),
            "budget_cost_micros": str(self.budget_cost_micros),
        }

    @classmethod
    def from_wire(
        cls, message: str, field: str | None, details: Mapping[str, str]
    ) -> BudgetExceeded:
        def number(key: str) -> int:
            try:
                return int(details.get(key, "0"))
            except ValueError:
                return 0

        return cls(
            details.get("run_id", ""),
            step_id=details.get("step_id", ""),
            tokens=number("tokens"),
            cost_micros=number("cost_micros"),
            budget_tokens=number("budget_tokens"),
            budget_cost_micros=number("budget_cost_micros"),
            detail=message,
        )


class JournalSignal(BaseException):
    """The journal decided this task's fate; the handler must return at once.

    Attributes:
        run_id: The run.
        step_id: The step.
        detail: What the journal found.
    """

    code: ClassVar[str] = "journal_signal"
    field: str | None = None

    def __init__(self, run_id: str, step_id: str, detail: str = "") -> None:
        super().__init__(detail or type(self).__name__)
        self.run_id = run_id
        self.step_id = step_id
        self.detail = detail

    @property
    def message(self) -> str:
        return self.detail or type(self).__name__


class Fenced(JournalSignal):
    """A successor claimed the step: this holder must write nothing more and
    must not settle the task.

    Attributes:
        run_id: The run.
        step_id: The step.
        expected: The tail the holder knew: the sequence of the last record it
            saw on the step's journal (0 when the call named none).
        actual: The tail the journal found instead (0 when not known, as for
            the engine's refusal of a fenced holder's report).
    """

    code: ClassVar[str] = "fenced"

    def __init__(
        self, run_id: str, step_id: str, *, expected: int = 0, actual: int = 0, detail: str = ""
    ) -> None:
        detail = detail or f"fenced: expected tail {expected}, found {actual}"
        super().__init__(run_id, step_id, detail)
        self.expected = expected
        self.actual = actual

    def details(self) -> dict[str, str]:
        return {
            "run_id": self.run_id,
            "step_id": self.step_id,
            "expected": str(self.expected),
            "actual": str(self.actual),
        }

    @classmethod
    def from_wire(cls, message: str, field: str | None, details: Mapping[str, str]) -> Fenced:
        return cls(
            details.get("run_id", ""),
            details.get("step_id", ""),
            expected=_number(details.get("expected")),
            actual=_number(details.get("actual")),
            detail=message,
        )


class RunCancelled(BaseException):
    """The run was cancelled (or ended), so the handler must stop. The journal
    refuses the run's new model calls, tool intents and claims with it and
    stores nothing; the SDK also raises it from ``TaskContext.heartbeat``.

    Attributes:
        run_id: The cancelled run.
        step_id: The step whose journal refused the write (empty when the
            engine said it).
    """

    code: ClassVar[str] = "cancelled"
    field: str | None = None

    def __init__(self, run_id: str, message: str = "", *, step_id: str = "") -> None:
        self.run_id = run_id
        self.step_id = step_id
        self.message = message or f"run {run_id} was cancelled"
        super().__init__(self.message)

    def details(self) -> dict[str, str]:
        return {"run_id": self.run_id, "step_id": self.step_id}

    @classmethod
    def from_wire(cls, message: str, field: str | None, details: Mapping[str, str]) -> RunCancelled:
        return cls(details.get("run_id", ""), message, step_id=details.get("step_id", ""))


def _number(text: str | None) -> int:
    """A sequence from the wire; 0 when it is missing or not a number."""
    return int(text) if text is not None and text.isdigit() else 0
