"""Every NATS subject the product uses, and the names tied to them.

A run and step id reach a subject only after ``dagnats.core.ids`` checked them
(one token each), so no request makes a wildcard. The streams and buckets
these subjects belong to are configured in ``dagnats.core.jetstream``.

| subject | stream or kind |
|---|---|
| ``tasks.<lane>.<run>.<step>`` | ``TASKS`` (work queue), one durable consumer per lane |
| ``history.<run>`` | ``HISTORY``: a run's lifecycle events |
| ``timers.<run>.<step>`` | ``SLEEP_TIMERS`` (work queue) |
| ``timers.<run>`` | ``SLEEP_TIMERS``: an ended run's purge, its retention after its end |
| ``journal.<run>.<step>`` | ``AGENT_JOURNAL``: a step's journal, fenced on this exact subject |
| ``journal.<run>.<step>.spent`` | ``AGENT_JOURNAL``: usage of a step's fenced model calls |
| ``created.<run>`` | ``RUNS_CREATED``: a run's entry in the runs by creation time |
| ``dead.<subject>`` | ``DEAD_LETTERS``: a message the engine gave up on |
| ``$KV.<bucket>.<key>`` | a key of a KV bucket |
| ``dagnats.cancel.<run>`` | core NATS: a run was cancelled (at most once) |
| ``dagnats.stream.<run>.<step>`` | core NATS: the live token preview of a step |
| ``dagnats.engine.commit-events`` | core NATS, queue ``engines``: a journal commit's event |
| ``api.inputs.{submit,get,withdraw}`` | core NATS request-reply: the inputs endpoints |

A task's lane (``task_lane``) is its type, for a task any worker may take,
or its type at a build (``<type>@<build>``), for a step pinned to a build.
"""

from __future__ import annotations

INPUTS_SUBMIT = "api.inputs.submit"
INPUTS_GET = "api.inputs.get"
INPUTS_WITHDRAW = "api.inputs.withdraw"
LIVE_STREAM = "dagnats.stream"
# A journal commit's event, sent to one engine over core
# NATS (ADR 33); a constant, so nothing of a request reaches the subject.
COMMIT_EVENTS = "dagnats.engine.commit-events"
DIRECT_QUEUE = "engines"


BUILD_MARK = "@"


def task_lane(task_type: str, build: str = "") -> str:
    """The token of a task's subject that its consumer filters on: the task
    type, for a task any worker may take; the type at a build
    (``<type>@<build>``), for a step pinned to that build. ``@`` is in no
    token (``dagnats.core.ids``), so the two lanes never overlap, and every
    other part of a task's subject is the same on both."""
    return f"{task_type}{BUILD_MARK}{build}" if build else task_type


def lane_build(subject: str) -> str:
    """The build a task's subject is pinned to ("": the unpinned lane)."""
    lane = subject.split(".", 2)[1]
    return lane.partition(BUILD_MARK)[2]


def task_subject(task_type: str, run_id: str, step_id: str, build: str = "") -> str:
    """The subject of a step's tasks on one lane: one per step and lane, so
    the stream's last message on it says whether a task of the step is in
    flight there."""
    return f"tasks.{task_lane(task_type, build)}.{run_id}.{step_id}"


def is_task_subject(subject: str) -> bool:
    """Whether ``subject`` is a task's (``task_subject``)."""
    return subject.startswith("tasks.")


def task_filter(task_type: str, build: str = "") -> str:
    """Every task of one lane: the filter of its consumer."""
    return f"tasks.{task_lane(task_type, build)}.>"


def run_tasks(run_id: str) -> str:
    """Every task of a run, of any type and lane."""
    return f"tasks.*.{run_id}.>"


def task_consumer(task_type: str, build: str = "") -> str:
    """The durable consumer of one lane (the lease names it)."""
    return f"tasks-{task_lane(task_type, build)}"


def history_subject(run_id: str) -> str:
    return f"history.{run_id}"


def timer_subject(run_id: str, step_id: str) -> str:
    return f"timers.{run_id}.{step_id}"


def run_timers(run_id: str) -> str:
    """Every step's timers of a run (not its purge: ``purge_timer_subject``)."""
    return f"timers.{run_id}.>"


def purge_timer_subject(run_id: str) -> str:
    """An ended run's purge timer: one token shorter than a step's timers, so
    no step id can name it and purging the run's step timers leaves it."""
    return f"timers.{run_id}"


def journal_subject(run_id: str, step_id: str) -> str:
    """A step's journal: its appends are fenced on this exact subject."""
    return f"journal.{run_id}.{step_id}"


def spent_subject(run_id: str, step_id: str) -> str:
    """What the model calls of a step's fenced holders spent (the usage
    ledger): a subject of its own in the journal's stream, so the fence of the
    step's subject does not refuse it, and the run's retention and purge
    (``run_journal``) cover it."""
    return f"journal.{run_id}.{step_id}.spent"


SPENT = ".spent"


def run_journal(run_id: str) -> str:
    """Every step's journal of a run."""
    return f"journal.{run_id}.>"


def dead_letter(subject: str) -> str:
    return f"dead.{subject}"


def kv_key(bucket: str, key: str) -> str:
    """The subject a KV bucket stores ``key`` under."""
    return f"$KV.{bucket}.{key}"


def cancel_subject(run_id: str) -> str:
    return f"dagnats.cancel.{run_id}"


ALL_CANCELS = cancel_subject("*")


def cancelled_run(subject: str) -> str:
    """The run a ``dagnats.cancel.<run>`` subject announces."""
    return subject.removeprefix(cancel_subject(""))


def live_stream_subject(run_id: str, step_id: str) -> str:
    return f"{LIVE_STREAM}.{run_id}.{step_id}"


def is_inbox(subject: str) -> bool:
    """Whether ``subject`` is one literal reply inbox: ``_INBOX.`` then tokens,
    no wildcard, no empty token (a notice goes to nothing broader)."""
    tokens = subject.split(".")
    return (
        len(tokens) >= 2
        and tokens[0] == "_INBOX"
        and all(t and t not in ("*", ">") and not any(c.isspace() for c in t) for t in tokens)
    )


CREATED_PREFIX = "created."


def created_subject(run_id: str) -> str:
    """A run's entry in ``RUNS_CREATED``, the runs by creation time."""
    return CREATED_PREFIX + run_id
