"""The worker crash-point matrix again, on a 3-node loopback cluster with R3
streams: R3 checks a Msg-Id before the expected sequence and answers a
retried append differently from R1, so every case must hold there too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from dagnats.core.jetstream import Topology
from dagnats.engine.server import EngineServer, start_engine
from tests.matrix import MATRIX
from tests.test_crash_matrix import test_crash_point

__all__ = ["test_crash_point"]


@pytest.fixture(scope="module")
def where() -> str:
    return "3-node cluster"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_cluster: Any) -> AsyncIterator[EngineServer]:
    server = await start_engine(nats_cluster.url, config=MATRIX, topology=Topology(replicas=3))
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def second_engine(nats_cluster: Any, engine: EngineServer) -> AsyncIterator[EngineServer]:
    server = await start_engine(nats_cluster.url, config=MATRIX, topology=Topology(replicas=3))
    yield server
    await server.stop()
