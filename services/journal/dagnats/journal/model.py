"""Journal records as plain values, one class per kind, for the pure rules
(:mod:`dagnats.journal.replay`, :mod:`dagnats.journal.audit`).
:mod:`dagnats.journal.convert` builds them from the stored protobuf records.

An entry is what the rules read; a stored record holds one entry, or more: a
model response or a tool result stored in the same message as the intent or
commit after it (``Record.leading``: a leading entry), and the claim of a dispatch
handed over with the commit before it (``Record.leading_claim``: the hand-over),
ahead of both. Every entry of such a record has its ``seq``; all but the last
are marked ``leading``, in the order stored."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dagnats.core.statechain import StoredDelta
from dagnats.core.usage import Usage


class Action(enum.Enum):
    CONTINUE = "continue"
    COMPLETE = "complete"
    FAIL = "fail"
    FAIL_PERMANENT = "fail_permanent"
    PAUSE = "pause"


# A commit with one of these actions ends its iteration: no attempt of that
# iteration runs again. A retriable failure or a pause ends only its attempt.
ENDS_ITERATION = frozenset({Action.CONTINUE, Action.COMPLETE, Action.FAIL_PERMANENT})


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """Fields every record has. ``seq`` is its stream sequence; ``leading``
    marks the entry stored ahead of another in the same record."""

    seq: int
    iteration: int
    attempt: int
    writer: str
    expected_seq: int = 0
    base_seq: int = 0
    leading: bool = False

    @property
    def dispatch(self) -> tuple[int, int]:
        return (self.iteration, self.attempt)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimEntry(Entry):
    delivery: int = 0
    worker_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelEntry(Entry):
    position: int
    response: bytes
    usage: Usage | None = None  # what the call spent, when reported


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalMark:
    """An approver's decision carried by the intent it lets run (or denies):
    the waiting call they named (``call``), the digest they saw, who, when."""

    call: str
    digest: str
    approved: bool
    approver: str = ""
    reason: str = ""
    decided_at: float = 0.0
    request_id: str = ""
    edited: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentEntry(Entry):
    """A tool intent. ``digest``: of a tool that needs approval (its name and
    input); ``approval``: the decision it runs under, None while it asks."""

    position: int
    name: str
    input: bytes
    safe: bool
    honours_seq: int = 0
    honours_index: int = 0
    index: int = 0
    group_size: int = 0
    group_position: int = 0
    digest: str = ""
    approval: ApprovalMark | None = None

    @property
    def ref(self) -> tuple[int, int]:
        """The intent's identity: its record's sequence, and its index in that
        record (a parallel group's record holds several; 0 otherwise)."""
        return (self.seq, self.index)

    @property
    def in_group(self) -> bool:
        """Part of a parallel group (``group_size`` calls from ``group_position``)."""
        return self.group_size > 0

    @property
    def asks_approval(self) -> bool:
        """Whether this intent asks for an approval and waits (it runs nothing)."""
        return bool(self.digest) and self.approval is None


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputEntry(Entry):
    intent_seq: int
    chunk: str
    intent_index: int = 0

    @property
    def intent_ref(self) -> tuple[int, int]:
        return (self.intent_seq, self.intent_index)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultEntry(Entry):
    intent_seq: int
    output: bytes = b""
    error: str = ""
    interrupted: bool = False
    partial: str = ""
    intent_index: int = 0
    awaiting_approval: bool = False

    @property
    def intent_ref(self) -> tuple[int, int]:
        """The intent it answers (see ``IntentEntry.ref``)."""
        return (self.intent_seq, self.intent_index)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitEntry(Entry):
    action: Action
    state: bytes = b""
    has_state: bool = False
    # With has_state: the state as a delta against the base commit's (the state chain).
    state_delta: StoredDelta | None = None
    output: bytes = b""
    error: str = ""
    reason: str = ""
    pause: float = 0.0

    @property
    def ends_iteration(self) -> bool:
        return self.action in ENDS_ITERATION


@dataclass(frozen=True, slots=True, kw_only=True)
class InputEntry(Entry):
    position: int
    request_id: str
    mode: int
    content: bytes
    carried: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelEntry(Entry):
    """The run was cancelled (or ended). The engine's own has no writer, and
    was appended whatever the tail; a holder's (its writer's) carries, ahead
    of it, the result of a tool call the holder started before the cancel."""

    reason: str = ""

    @property
    def by_engine(self) -> bool:
        return not self.writer


@dataclass(frozen=True, slots=True, kw_only=True)
class ForkEntry(Entry):
    """The end of a fork's copied prefix: the records before it are copies of
    ``source_run``'s records of ``source_step`` through ``at_seq``
    (``copied`` of them, whose digest is ``digest``). Written by the fork, no
    writer's: it fences nothing, and its dispatch is the one the step resumes
    at."""

    source_run: str
    source_step: str
    at_seq: int
    copied: int
    digest: str


AnyEntry = (
    ClaimEntry
    | ModelEntry
    | IntentEntry
    | OutputEntry
    | ResultEntry
    | CommitEntry
    | InputEntry
    | CancelEntry
    | ForkEntry
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A tool call as the handler issues it."""

    name: str
    input: bytes
    safe: bool
    digest: str = ""
    approval_id: str = ""
    """The request id of the approval the call runs under; empty for a call
    that asks for one, or needs none."""

    def same_as(self, intent: IntentEntry) -> bool:
        """Whether ``intent`` records this call: the same tool and input, and
        the same approval (a call that asks for one, a call under one)."""
        approval_id = intent.approval.request_id if intent.approval is not None else ""
        return (intent.name, intent.input, intent.digest, approval_id) == (
            self.name,
            self.input,
            self.digest,
            self.approval_id,
        )
