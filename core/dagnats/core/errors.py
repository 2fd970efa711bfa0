"""Domain errors shared by every dagnats component.

Services raise these; each service maps them to a gRPC status in one table
(``dagnats.core.grpcutil.STATUS_OF``) and the SDK maps statuses back in one
place, so no caller outside those two modules sees a ``grpc.RpcError``.

    DagnatsError                      root of everything raised on purpose
    ├── InvalidArgument               bad input; names the field
    │   └── RecordTooLarge            a journal record over the documented maximum
    ├── NotFound                      unknown workflow, run, step, ...
    ├── Conflict                      the request contradicts current state
    ├── Unavailable                   transport or backend trouble; retriable
    │   └── NotProvisioned            a stream or bucket the call needs is missing
    ├── DeadlineExceeded              an operation ran out of time
    ├── Unauthenticated               the call carried no valid credential
    ├── PermissionDenied              the credential's role may not make the call
    ├── Fenced                        a successor holds the step; stop writing
    └── ReplayMismatch                the handler made a different call at a
                                      recorded position; nothing was written
"""

from __future__ import annotations


class DagnatsError(Exception):
    """Root of every error dagnats raises on purpose."""

    code = "internal"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgument(DagnatsError):
    """The request is malformed; ``field`` names the offending field when known."""

    code = "invalid_argument"


class RecordTooLarge(InvalidArgument):
    """A journal record would be larger than the journal stores; nothing was written."""

    code = "record_too_large"


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


class Fenced(DagnatsError):
    """A journal write found a tail other than the writer's: a successor claimed."""

    code = "fenced"

    def __init__(
        self, message: str, *, field: str | None = None, expected: int = 0, actual: int = 0
    ) -> None:
        super().__init__(message, field=field)
        self.expected = expected
        self.actual = actual


class ReplayMismatch(DagnatsError):
    """The call at a position differs from the one the journal recorded there."""

    code = "replay_mismatch"
