"""The dagnats Python SDK.

``Client`` registers workflows and starts and watches runs; ``JournalClient``
reads and audits a run's journal; ``Worker`` polls
the engine and runs ``async def handler(tc: TaskContext) -> None`` for each
task. ``dagnats.sdk.testing`` has a scripted model for tests.
"""

from dagnats.sdk._client import Client, run_output
from dagnats.sdk._context import TaskContext
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._errors import (
    ApprovalPending,
    BudgetExceeded,
    Committed,
    ConcurrentJournalUse,
    Conflict,
    DagnatsError,
    DeadlineExceeded,
    Fenced,
    InputsQueued,
    InvalidArgument,
    JournalSignal,
    NotFound,
    PermanentError,
    PermissionDenied,
    ReplayMismatch,
    RestartLimit,
    RunCancelled,
    RunFailed,
    Stale,
    TaskAlreadySettled,
    Unauthenticated,
    Unavailable,
)
from dagnats.sdk._journal import (
    InputMode,
    Journal,
    PlacedInput,
    Replay,
    ToolCall,
    ToolResult,
    ToolRun,
)
from dagnats.sdk._journal_client import JournalClient
from dagnats.sdk._stream import TokenStream
from dagnats.sdk._usage import Budget, Usage, WithUsage
from dagnats.sdk._worker import Handler, Worker

__all__ = [
    "ApprovalPending",
    "Budget",
    "BudgetExceeded",
    "Client",
    "Committed",
    "ConcurrentJournalUse",
    "Conflict",
    "Credentials",
    "DagnatsError",
    "DeadlineExceeded",
    "Fenced",
    "Handler",
    "InputMode",
    "InputsQueued",
    "InvalidArgument",
    "Journal",
    "JournalClient",
    "JournalSignal",
    "NotFound",
    "PermanentError",
    "PermissionDenied",
    "PlacedInput",
    "Replay",
    "ReplayMismatch",
    "RestartLimit",
    "RunCancelled",
    "RunFailed",
    "Stale",
    "TaskAlreadySettled",
    "TaskContext",
    "TokenStream",
    "ToolCall",
    "ToolResult",
    "ToolRun",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "WithUsage",
    "Worker",
    "run_output",
]
