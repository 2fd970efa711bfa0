"""A client given several replicas' addresses: with ``DAGNATS_GRPC_BALANCE``
its calls go to each of them in turn; without, all to the first that answers.

Two services processes on two NATS servers of their own stand in for the
replicas here, so which one answered shows in the answer: a workflow is
registered on the first alone, and a list of workflows includes it only
when the first process answered it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from dagnats.core.natsserver import NatsServer
from dagnats.engine.server import EngineServer, start_engine
from dagnats.sdk import Client
from tests.secured import suite_security
from tests.stack import FAST, loop_workflow, unique

CALLS = 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[EngineServer, EngineServer, str]]:
    other = await NatsServer.start(tmp_path_factory.mktemp("other"), security=suite_security())
    first = await start_engine(nats_server.url, config=FAST)
    second = await start_engine(other.url, config=FAST)
    marker = unique("only-on-the-first")
    try:
        async with Client(first.target) as client:
            await client.register_workflow(loop_workflow(marker, unique("task")))
        yield first, second, marker
    finally:
        await first.stop()
        await second.stop()
        await other.stop()


async def answered_by(target: str, marker: str) -> Counter[str]:
    """Which process answered each of ``CALLS`` lists of workflows."""
    seen: Counter[str] = Counter()
    async with Client(target) as client:
        for _ in range(CALLS):
            names = {w.name for w in await client.list_workflows()}
            seen["first" if marker in names else "second"] += 1
    return seen


@pytest.mark.parametrize("balance", ["1", None])
async def test_a_balanced_target_reaches_every_replica(
    two: tuple[EngineServer, EngineServer, str], monkeypatch: Any, balance: str | None
) -> None:
    first, second, marker = two
    if balance is None:
        monkeypatch.delenv("DAGNATS_GRPC_BALANCE", raising=False)
    else:
        monkeypatch.setenv("DAGNATS_GRPC_BALANCE", balance)
    seen = await answered_by(f"ipv4:{first.target},{second.target}", marker)
    if balance:
        assert seen["first"] >= 1 and seen["second"] >= 1, seen
    else:
        assert seen == {"first": CALLS}, "without balancing the first address takes every call"
