"""The fencing tests again, on a 3-node loopback cluster with R3 streams: R3
checks a Msg-Id before the expected sequence, so fencing must hold there too,
and so must a cancelled run's refusals (a retried result after the cancel
comes back from R3 as a duplicate of another record's body)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio

from dagnats.core.jetstream import Topology
from dagnats.engine.server import EngineServer, start_engine
from tests.stack import FAST, socket_dir
from tests.test_cancel import (
    test_the_journal_refuses_every_new_call_of_a_cancelled_run_and_writes_nothing,
)
from tests.test_journal import (
    test_crash_after_commit_republishes,
    test_crash_after_unsafe_intent_records_interrupted,
    test_restart_limit_fails_the_attempt_and_the_retry_resumes,
    test_zombie_is_fenced_and_writes_nothing_after_its_successor,
)

__all__ = [
    "test_crash_after_commit_republishes",
    "test_crash_after_unsafe_intent_records_interrupted",
    "test_restart_limit_fails_the_attempt_and_the_retry_resumes",
    "test_the_journal_refuses_every_new_call_of_a_cancelled_run_and_writes_nothing",
    "test_zombie_is_fenced_and_writes_nothing_after_its_successor",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_cluster: Any) -> AsyncIterator[EngineServer]:
    """As the suite's engine fixture, with R3 streams: a local socket too."""
    with socket_dir() as sockets:
        server = await start_engine(
            nats_cluster.url,
            config=FAST,
            topology=Topology(replicas=3),
            local_socket=sockets / "local.sock",
        )
        yield server
        await server.stop()
