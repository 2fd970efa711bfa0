"""The dagnats Python SDK.

``Client`` registers workflows and starts and watches runs; ``Worker`` polls
the engine and runs ``async def handler(tc: TaskContext) -> None`` for each
task. ``dagnats.sdk.testing`` has a scripted model for tests.
"""

from dagnats.sdk._client import Client, run_output
from dagnats.sdk._context import TaskContext
from dagnats.sdk._errors import (
    Conflict,
    DagnatsError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermanentError,
    RunCancelled,
    TaskAlreadySettled,
    Unavailable,
)
from dagnats.sdk._worker import Handler, Worker

__all__ = [
    "Client",
    "Conflict",
    "DagnatsError",
    "DeadlineExceeded",
    "Handler",
    "InvalidArgument",
    "NotFound",
    "PermanentError",
    "RunCancelled",
    "TaskAlreadySettled",
    "TaskContext",
    "Unavailable",
    "Worker",
    "run_output",
]
