"""Engine settings, with defaults a single-machine install can run on."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in {"0", "false", "no", "off", ""}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine runs.

    Attributes:
        task_ack_wait: a task's lease; a worker that neither heartbeats nor
            reports within it loses the task to a redelivery.
        history_ack_wait: how long an engine may take to apply one event
            before another engine gets it.
        legacy_step_events: accept step reports without a dispatch identity
            (``DAGNATS_LEGACY_STEP_EVENTS``, default true).
        loop_state_max_bytes: largest checkpoint of a non-journal step.
        reconcile_interval: how often the engine looks for stranded work.
        outbox_grace: how old an unpublished outbox must be before the
            reconciler publishes it on the writer's behalf.
    """

    task_ack_wait: float = 30.0
    history_ack_wait: float = 30.0
    legacy_step_events: bool = True
    loop_state_max_bytes: int = 1 << 20
    reconcile_interval: float = 10.0
    outbox_grace: float = 5.0
    history_batch: int = 64
    dead_letter_after: int = 10

    @classmethod
    def from_env(cls, **overrides: object) -> EngineConfig:
        """Defaults, then ``DAGNATS_*`` variables, then explicit overrides."""
        values: dict[str, object] = {
            "legacy_step_events": _env_bool("DAGNATS_LEGACY_STEP_EVENTS", True),
        }
        for field, env in (
            ("task_ack_wait", "DAGNATS_TASK_ACK_WAIT"),
            ("reconcile_interval", "DAGNATS_RECONCILE_INTERVAL"),
        ):
            if env in os.environ:
                values[field] = float(os.environ[env])
        if "DAGNATS_LOOP_STATE_MAX_BYTES" in os.environ:
            values["loop_state_max_bytes"] = int(os.environ["DAGNATS_LOOP_STATE_MAX_BYTES"])
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
