"""Every NATS subject the product uses, and the names tied to them.

A run and step id reach a subject only after ``dagnats.core.ids`` checked them
(one token each), so no request makes a wildcard. The streams and buckets
these subjects belong to are configured in ``dagnats.core.jetstream``.

| subject | stream or kind |
|---|---|
| ``tasks.<lane>.<slot>.<run>.<step>`` | ``TASKS`` (work queue), a consumer per lane and partition |
| ``history.<slot>.<run>`` | ``HISTORY``: a run's lifecycle events, one consumer per partition |
| ``timers.<slot>.<run>.<step>`` | ``SLEEP_TIMERS`` (work queue), one consumer per partition |
| ``timers.<slot>.<run>`` | ``SLEEP_TIMERS``: an ended run's purge, its retention after its end |
| ``journal.<run>.<step>`` | ``AGENT_JOURNAL``: a step's journal, fenced on this exact subject |
| ``journal.<run>.<step>.spent`` | ``AGENT_JOURNAL``: usage of a step's fenced model calls |
| ``created.<run>`` | ``RUNS_CREATED``: a run's entry in the runs by creation time |
| ``dead.<subject>`` | ``DEAD_LETTERS``: a message the engine gave up on |
| ``$KV.<bucket>.<key>`` | a key of a KV bucket |
| ``dagnats.cancel.<run>`` | core NATS: a run was cancelled (at most once) |
| ``dagnats.stream.<run>.<step>`` | core NATS: the live token preview of a step |
| ``dagnats.engine.commit-events.<slot>`` | core NATS, queue ``engines``: a journal commit's event |
| ``api.inputs.{submit,get,withdraw}`` | core NATS request-reply: the inputs endpoints |

A task's lane (``task_lane``) is its type, for a task any worker may take,
or its type at a build (``<type>@<build>``), for a step pinned to a build.

``<slot>`` is the run's slot (``dagnats.core.partitions.slot_of``), computed
here from the run id: a replica's consumers filter on the slots of the
partitions it owns (``partition_filters``), or on the one wildcard when there
is one partition. The consumers are named per partition: ``tasks-<lane>-<k>``,
``history-<k>``, ``timers-<k>``.
"""

from __future__ import annotations

from dagnats.core.partitions import slot_of, slots_of

INPUTS_SUBMIT = "api.inputs.submit"
INPUTS_GET = "api.inputs.get"
INPUTS_WITHDRAW = "api.inputs.withdraw"
LIVE_STREAM = "dagnats.stream"
# A journal commit's event, sent to one engine over core NATS (ADR 33) on
# its run's slot (``commit_event_subject``); nothing of a request reaches the
# subject but the slot, a number.
COMMIT_EVENTS = "dagnats.engine.commit-events"
DIRECT_QUEUE = "engines"


BUILD_MARK = "@"
# The first token of the history's and the timers' subjects.
HISTORY_SUBJECTS = "history"
TIMER_SUBJECTS = "timers"


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
    return f"tasks.{task_lane(task_type, build)}.{slot_of(run_id)}.{run_id}.{step_id}"


def is_task_subject(subject: str) -> bool:
    """Whether ``subject`` is a task's (``task_subject``)."""
    return subject.startswith("tasks.")


def lane_prefix(task_type: str, build: str = "") -> str:
    """Every task of one lane is under this prefix (``partition_filters``)."""
    return f"tasks.{task_lane(task_type, build)}"


def partition_filters(
    prefix: str, partition: int, partitions: int, *, last: bool = False
) -> list[str]:
    """The ``filter_subjects`` of a consumer of one partition of the subjects
    under ``prefix`` (a lane's, ``history``, ``timers``, ``COMMIT_EVENTS``):
    one filter per slot of the partition, or the one wildcard when there is
    one partition (the consumer costs what it did before partitions).
    ``last``: the slot is the subject's last token (commit events)."""
    if partitions == 1:
        return [f"{prefix}.*" if last else f"{prefix}.>"]
    return [
        f"{prefix}.{slot}" if last else f"{prefix}.{slot}.>"
        for slot in slots_of(partition, partitions)
    ]


def run_tasks(run_id: str) -> str:
    """Every task of a run, of any type and lane."""
    return f"tasks.*.{slot_of(run_id)}.{run_id}.>"


def task_consumer(task_type: str, build: str = "", partition: int = 0) -> str:
    """The durable consumer of one lane's partition (the lease names it)."""
    return f"tasks-{task_lane(task_type, build)}-{partition}"


def history_consumer(partition: int) -> str:
    """The durable consumer of one partition of the history."""
    return f"history-{partition}"


def timer_consumer(partition: int) -> str:
    """The durable consumer of one partition of the timers."""
    return f"timers-{partition}"


def history_subject(run_id: str) -> str:
    return f"{HISTORY_SUBJECTS}.{slot_of(run_id)}.{run_id}"


def timer_subject(run_id: str, step_id: str) -> str:
    return f"{TIMER_SUBJECTS}.{slot_of(run_id)}.{run_id}.{step_id}"


def run_timers(run_id: str) -> str:
    """Every step's timers of a run (not its purge: ``purge_timer_subject``)."""
    return f"{TIMER_SUBJECTS}.{slot_of(run_id)}.{run_id}.>"


def purge_timer_subject(run_id: str) -> str:
    """An ended run's purge timer: one token shorter than a step's timers, so
    no step id can name it and purging the run's step timers leaves it."""
    return f"{TIMER_SUBJECTS}.{slot_of(run_id)}.{run_id}"


def commit_event_subject(run_id: str) -> str:
    """Where a journal commit's event for the run goes: its slot, which the
    engines owning its partition serve (queue ``DIRECT_QUEUE``)."""
    return f"{COMMIT_EVENTS}.{slot_of(run_id)}"


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
