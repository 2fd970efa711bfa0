"""An idle deployment writes nothing: once its runs have ended and what they
left behind is written (a kept iteration's deferred run write, the index's
mark), no stream and no bucket of the server stores a message, however many
times the reconciler passes, the workers poll and the engines watch.

Both topologies, each as its own processes on a nats-server of its own with
``sync_interval: always`` (where every stored message is an fsync): the
services in one process (``dagnats serve all``) and the services apart as
docker-compose runs them (``dagnats serve engine``, ``serve journal``,
``serve inputs``), a worker dialling them on gRPC. The reconciler runs every
0.2 s, so an idle window of 2 s holds ten of its passes. What is asserted is
the server's own count, the last sequence and the messages held of every
stream (``/jsz``): nothing stored, nothing removed; never a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import bench_turn as bt
from dagnats.core.natsserver import NatsServer
from dagnats.sdk import Client, TaskContext, Worker
from tests.helpers import wait_for
from tests.matrix import child_env
from tests.stack import loop_workflow, unique

# The reconciler every 0.2 s and a kept run's deferred write after 0.1 s: the
# work an idle engine does on a timer, many times over in the window.
SETTINGS = {"DAGNATS_RECONCILE_INTERVAL": "0.2", "DAGNATS_KEPT_WRITE_DELAY": "0.1"}
IDLE = 2.0  # seconds the store must stay as it is
TOPOLOGIES = {"one process": ("all",), "apart": ("engine", "journal", "inputs")}


def stream_states(monitor: str) -> dict[str, tuple[int, int]]:
    """The last sequence and the messages held of every stream of the server
    (KV buckets included): a message stored moves the one, a message removed
    (a work queue's acknowledgement, a purge) the other."""
    with urllib.request.urlopen(f"{monitor}/jsz?streams=true", timeout=10) as answer:
        jsz: dict[str, Any] = json.loads(answer.read())
    return {
        stream["name"]: (int(stream["state"]["last_seq"]), int(stream["state"]["messages"]))
        for account in jsz.get("account_details", [])
        for stream in account.get("stream_detail", [])
    }


@contextlib.contextmanager
def serving(service: str, nats: NatsServer, logs: Path) -> Iterator[str]:
    """``dagnats serve SERVICE`` in its own process on a free port, as the
    bench's split deployment starts it (with the settings above); its address."""
    proc, target, _ = bt.serve_one(service, nats, logs, metrics=False, env=child_env(**SETTINGS))
    try:
        yield target
    finally:
        bt.stop_process(proc)


@contextlib.asynccontextmanager
async def deployment(
    services: tuple[str, ...], tmp: Path
) -> AsyncIterator[tuple[NatsServer, dict[str, str]]]:
    nats = await NatsServer.start(tmp / "nats")
    try:
        with contextlib.ExitStack() as started:
            targets = {s: started.enter_context(serving(s, nats, tmp)) for s in services}
            yield nats, targets
    finally:
        await nats.stop()


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
async def test_an_idle_deployment_stores_nothing(topology: str, tmp_path: Path) -> None:
    async with deployment(TOPOLOGIES[topology], tmp_path) as (nats, targets):
        engine = targets.get("engine", targets.get("all"))
        assert engine is not None
        task, name = unique("idle"), unique("idlewf")

        async def handler(tc: TaskContext) -> None:
            j = await tc.journal()
            await j.model(lambda: _answer(tc.iteration))
            if tc.iteration < 5:
                await tc.continue_()
            else:
                await tc.complete({"iterations": tc.iteration + 1})

        async with (
            Client(engine) as client,
            Worker(
                engine,
                handlers={task: handler},
                local_socket="off",
                journal_target=targets.get("journal"),
                inputs_target=targets.get("inputs"),
            ),
        ):
            await client.register_workflow(loop_workflow(name, task))
            # Kept iterations, their run writes deferred, then the end.
            assert await client.run(name, {}, timeout=60) == {"iterations": 6}

            # What the run left behind lands; then, with the worker polling
            # and the reconciler passing every 0.2 s, nothing more is stored.
            last: dict[str, tuple[int, int]] = {}
            still_since = [0.0]
            loop = asyncio.get_running_loop()

            def settled() -> bool:
                now = stream_states(nats.monitor_url)
                if now != last:
                    last.clear()
                    last.update(now)
                    still_since[0] = loop.time()
                return loop.time() - still_since[0] >= IDLE

            await wait_for(
                settled, timeout=60, interval=0.1, message="no stream stores or removes a message"
            )
            # A second window, every poll of it checked: ten more reconciler
            # passes and the worker's polls store and remove nothing.
            before, since = dict(last), loop.time()

            def held_still() -> bool:
                assert stream_states(nats.monitor_url) == before
                return loop.time() - since >= IDLE

            await wait_for(held_still, timeout=IDLE + 30, interval=0.1)


async def _answer(i: int) -> dict[str, int]:
    return {"i": i}
