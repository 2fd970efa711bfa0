"""Engine settings, with defaults a single-machine install can run on.

Every setting can be given in the environment (``DAGNATS_*``, listed in
``ENV`` and in ``dagnats.core.catalogue``, which the settings reference is
generated from); a value that does not parse is
refused at start-up, naming the variable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
from dataclasses import dataclass

from dagnats.core.errors import InvalidArgument
from dagnats.core.ids import check_token
from dagnats.core.partitions import check_partitions
from dagnats.core.settings import env_bool, env_int, env_seconds
from dagnats.engine.model import RuleOptions

log = logging.getLogger(__name__)

DAY = 24 * 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine runs.

    Attributes:
        task_ack_wait: a task's lease; a worker that neither heartbeats nor
            reports within it loses the task to a redelivery.
        history_ack_wait: how long an engine may take to apply one event
            before another engine gets it.
        timer_ack_wait: the same for a timer that fired.
        loop_state_max_bytes: largest checkpoint of a non-journal step.
        reconcile_interval: how often the engine looks for stranded work: an
            outbox left unpublished, a task that vanished, or an event that an
            engine took and did not apply (it died), which the reconciler then
            applies itself, so that a run is not left idle for
            ``history_ack_wait``. It reads only the runs in motion: a run
            parked for an input or a timer is out of its index (a parked run),
            and such an event of it waits out ``history_ack_wait``.
        outbox_grace: how old a running run's outbox must be before the
            reconciler publishes it on the writer's behalf (unless this engine
            did) and clears it; the engine's own writes leave it for the next
            write. An ended run's is published by the pass that reads its end
            (unless its engine did), and never cleared.
        history_batch: most events one fetch takes from the history.
        dead_letter_after: deliveries of an event that keeps failing before it
            is moved to the dead letters.
        kept_write_batch: the run of a journaled loop whose task its holder
            keeps (the kept task) is written at least once every this many
            iterations (at most one fewer go unwritten: the deferred write): the
            journal's commits hold them meanwhile, and every reader of the run
            now catches up from them (the catch-up). 1 writes the run at every iteration.
        kept_write_delay: how long such decided iterations may wait for the
            run's write at most: the runs bucket, which ``ListRuns`` and the
            console's list show, is at most this far behind the journal.
        clock_skew: the most an engine's clock may be ahead of nats-server's.
            ``ListRuns`` orders runs by their creation on an engine's clock
            and reads the runs bucket back from its newest writes until what
            is left was stored, by nats-server's clock, this much before the
            page's oldest run was created.
        run_retention: how long an ended run is kept after its end: then
            the engine purges it and everything of it (its journal, inputs,
            history, checkpoints, idempotency key), by a durable timer set
            when it ends. Nothing of a live run expires, however long it waits.
        input_dedupe_window: how long a repeat of an input's request_id is
            promised the original, and how long an input may wait queued: one
            queued longer is never placed and ends ``expired``.
    """

    task_ack_wait: float = 30.0
    history_ack_wait: float = 30.0
    timer_ack_wait: float = 30.0
    loop_state_max_bytes: int = 1 << 20
    reconcile_interval: float = 10.0
    outbox_grace: float = 5.0
    history_batch: int = 64
    dead_letter_after: int = 10
    kept_write_batch: int = 16
    kept_write_delay: float = 0.2
    clock_skew: float = 5.0
    run_retention: float = 30 * DAY
    input_dedupe_window: float = 7 * DAY

    @classmethod
    def from_env(cls, base: EngineConfig | None = None, **overrides: object) -> EngineConfig:
        """``base`` (the defaults when None), then ``DAGNATS_*`` variables, then
        explicit overrides.

        Raises:
            InvalidArgument: a variable is set to a value out of range.
        """
        base = base or cls()
        values: dict[str, object] = {}
        for field, (env, kind) in ENV.items():
            default = getattr(base, field)
            if kind == "seconds":
                values[field] = env_seconds(env, default)
            elif kind == "count":
                values[field] = env_int(env, default)
            else:
                values[field] = env_bool(env, default)
        values.update(overrides)
        return dataclasses.replace(base, **values)  # type: ignore[arg-type]

    def rule_options(self) -> RuleOptions:
        """The settings the engine's rules depend on."""
        return RuleOptions(run_retention=self.run_retention)


# Each setting's variable, and how it is read: seconds (a positive number),
# count (an integer >= 1) or flag.
ENV: dict[str, tuple[str, str]] = {
    "task_ack_wait": ("DAGNATS_TASK_ACK_WAIT", "seconds"),
    "history_ack_wait": ("DAGNATS_HISTORY_ACK_WAIT", "seconds"),
    "timer_ack_wait": ("DAGNATS_TIMER_ACK_WAIT", "seconds"),
    "loop_state_max_bytes": ("DAGNATS_LOOP_STATE_MAX_BYTES", "count"),
    "reconcile_interval": ("DAGNATS_RECONCILE_INTERVAL", "seconds"),
    "outbox_grace": ("DAGNATS_OUTBOX_GRACE", "seconds"),
    "history_batch": ("DAGNATS_HISTORY_BATCH", "count"),
    "dead_letter_after": ("DAGNATS_DEAD_LETTER_AFTER", "count"),
    "kept_write_batch": ("DAGNATS_KEPT_WRITE_BATCH", "count"),
    "kept_write_delay": ("DAGNATS_KEPT_WRITE_DELAY", "seconds"),
    "clock_skew": ("DAGNATS_CLOCK_SKEW", "seconds"),
    "run_retention": ("DAGNATS_RUN_RETENTION", "seconds"),
    "input_dedupe_window": ("DAGNATS_INPUT_DEDUPE_WINDOW", "seconds"),
}


DEFAULT_LEASE = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaConfig:
    """How a replica (a process that serves the engine) shares the partitions.

    Attributes:
        partitions: the number of partitions asked for (``DAGNATS_PARTITIONS``):
            recorded by the first process to provision, and refused by any
            later one when it differs; None takes the recorded number (1 at
            the first provisioning).
        lease: the partition lease, in whole seconds, at least 1: a replica
            not heard beating for this long loses its partitions to the
            others (it beats every third of it).
        replica_id: this replica's id, a NATS token; random by default.
    """

    partitions: int | None = None
    lease: float = DEFAULT_LEASE
    replica_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))

    @classmethod
    def from_env(cls, **overrides: object) -> ReplicaConfig:
        """``DAGNATS_PARTITIONS``, ``DAGNATS_PARTITION_LEASE`` and
        ``DAGNATS_REPLICA_ID``, then explicit overrides (None: not given).

        Raises:
            InvalidArgument: a value out of range, naming its variable.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        raw = os.environ.get("DAGNATS_PARTITIONS")
        partitions = given.get("partitions", None if raw is None else _whole(raw))
        lease = given.get("lease", env_seconds("DAGNATS_PARTITION_LEASE", DEFAULT_LEASE))
        replica_id = given.get("replica_id", os.environ.get("DAGNATS_REPLICA_ID"))
        config = cls(
            partitions=partitions,  # type: ignore[arg-type]
            lease=lease,  # type: ignore[arg-type]
            **({} if replica_id is None else {"replica_id": replica_id}),  # type: ignore[arg-type]
        )
        config.check()
        return config

    def check(self) -> None:
        """Raises InvalidArgument for a value out of range, naming its variable."""
        if self.partitions is not None:
            check_partitions(self.partitions, field="DAGNATS_PARTITIONS")
        if not (math.isfinite(self.lease) and self.lease >= 1 and self.lease == int(self.lease)):
            raise InvalidArgument(
                f"DAGNATS_PARTITION_LEASE must be a whole number of seconds, at least 1, "
                f"got {self.lease!r}",
                field="DAGNATS_PARTITION_LEASE",
            )
        check_token(self.replica_id, field="DAGNATS_REPLICA_ID")


def _whole(raw: str) -> int | str:
    """An int when ``raw`` reads as one, else ``raw`` (refused by the check)."""
    try:
        return int(raw)
    except ValueError:
        return raw
