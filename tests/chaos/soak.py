"""The chaos soak: many runs of the scripted agent at once, under a seeded
random schedule of faults, on one server or on a 3-node cluster with R3
streams.

The services run as replicas over ``partitions`` partitions (P = 6). In the
short soak of the suite, two replicas (engine, journal and inputs services
each) run in this process; with ``replica_processes`` (``make test-chaos``:
three), each replica is a process of its own (``tests/chaos/replica.py``, the
services as ``dagnats serve all`` runs them), which the nemesis kills, freezes
and stops. Worker processes (``tests/chaos/worker.py``) dial every replica,
each preferring one. The first replica also serves a local socket, as
``dagnats dev`` does: workers whose polls it answers find it and move their
journal calls and polls there, and the drivers on its client start and watch
their runs there; the rest stay on gRPC. Faults:

* ``worker-kill``: SIGKILL a worker; a fresh one starts a moment later.
* ``worker-stall``: SIGSTOP a worker past its leases, then SIGCONT: its
  holders wake as zombies.
* ``duplicate-delivery``: publish a second copy of a run's task in flight.
* ``lost-ack``: a journal append or an engine publish lands and its ack is
  lost, so the same Msg-Id is sent again (see :mod:`tests.chaos.faults`).
* cluster only: ``stepdown`` (a stream's leader steps down) and
  ``leader-kill`` (SIGKILL the node leading a stream, restarted a moment later).
* replica processes only, while another replica serves: ``replica-kill`` (SIGKILL,
  restarted a moment later: the others take its partitions once its
  partition lease lapses), ``replica-stall`` (SIGSTOP past its partition
  lease, then SIGCONT: it wakes to find its partitions taken by the others) and
  ``replica-restart`` (SIGTERM: it hands its partitions over at once, and
  starts again a moment later). The summary counts them, and the partition
  moves seen in the ``PARTITIONS`` bucket (an owner key taken by another
  replica).

The seed fixes the schedule (which fault, when, against which target); the
interleavings it meets still vary, so a replay repeats the pressure, not
every instant. After each run: the answer, ``journal check``, the iteration
count, at most one start of the unsafe tool, and every input placed once or
answered as unanswered. Alongside them, within the same faults, one
conversation of ``conversation_turns`` turns: each turn appends a message to
the step's state through the state chain; after it, the state holds every
turn's message once, in order, and ``journal check`` (the chain's rule
included) is clean. At the end, over the whole ``AGENT_JOURNAL`` stream:
no Msg-Id stored twice, every record the journal store acknowledged stored
at its sequence, and each record's expected sequence equal to the previous
record's sequence on its subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc.aio
import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from dagnats.core import errors
from dagnats.core import jetstream as jsx
from dagnats.core.grpcutil import error_code, retriable
from dagnats.core.natsserver import NatsCluster, NatsServer
from dagnats.core.partitions import slot_of
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.inputs.v1 import inputs_pb2 as ipb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.journal.v1 import journal_pb2_grpc as jgrpc
from dagnats.sdk import Client, JournalClient, run_output
from tests.chaos import replica as chaos_replica
from tests.chaos import worker as chaos_worker
from tests.chaos.faults import Ack, JournalTap, LossyPublish, instrumented_journal
from tests.chaos.replica import SOAK, lossy_services
from tests.helpers import wait_for
from tests.matrix import EngineProcess, child_env
from tests.secured import suite_security
from tests.stack import loop_workflow, socket_dir, steps_by_id
from tests.workers import agent

T = TypeVar("T")

LEASE = SOAK.task_ack_wait
STREAMS = (jsx.JOURNAL, jsx.TASKS, jsx.HISTORY, f"KV_{jsx.KV_RUNS}", f"KV_{jsx.KV_INPUTS}")
WEIGHTS = {"worker-kill": 3, "worker-stall": 3, "duplicate-delivery": 3}
CLUSTER_WEIGHTS = {"stepdown": 2, "leader-kill": 1}
REPLICA_WEIGHTS = {"replica-kill": 2, "replica-stall": 2, "replica-restart": 2}
# A worker that spreads its polls over every replica, on gRPC alone.
BALANCED = {"DAGNATS_GRPC_BALANCE": "1", "DAGNATS_LOCAL_SOCKET": "off"}
OWNERS = "PARTITIONS"  # the bucket whose owner.<k> keys name each partition's owner
REPORTS: list[Report] = []  # printed by conftest.pytest_terminal_summary


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SoakConfig:
    seed: int
    seconds: float
    topology: str  # "server" or "cluster"
    runs_in_flight: int = 12
    workers: int = 4
    concurrency: int = 6
    lost_ack_rate: float = 0.03
    fault_gap: tuple[float, float] = (0.3, 1.2)
    run_deadline: float = 120.0
    conversation_turns: int = 2000
    replica_processes: int = 0  # 0: two replicas in this process
    partitions: int = 6
    partition_lease: float = 2.0

    @property
    def stream_replicas(self) -> int:
        """The streams' replicas (R3 on the cluster)."""
        return 3 if self.topology == "cluster" else 1

    @property
    def services(self) -> str:
        """Where the services' replicas run."""
        if self.replica_processes:
            return f"{self.replica_processes} replica processes"
        return "2 replicas in the test process"

    def weights(self) -> dict[str, int]:
        return {
            **WEIGHTS,
            **(CLUSTER_WEIGHTS if self.topology == "cluster" else {}),
            **(REPLICA_WEIGHTS if self.replica_processes else {}),
        }


@dataclasses.dataclass
class Report:
    config: SoakConfig
    runs: int = 0
    records: int = 0
    acks: int = 0
    seconds: float = 0.0
    faults: Counter[str] = dataclasses.field(default_factory=Counter)
    missed: Counter[str] = dataclasses.field(default_factory=Counter)
    unacknowledged: Counter[str] = dataclasses.field(default_factory=Counter)
    inputs: Counter[str] = dataclasses.field(default_factory=Counter)
    engine: Counter[str] = dataclasses.field(default_factory=Counter)
    socket: Counter[str] = dataclasses.field(default_factory=Counter)
    moves: int = 0  # partitions whose owner changed to another replica
    conversation: Conversation | None = None
    violations: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        c = self.config
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        inputs = ", ".join(f"{k} {v}" for k, v in sorted(self.inputs.items())) or "none"
        engine = ", ".join(f"{k} {v}" for k, v in sorted(self.engine.items())) or "none"
        missed = ", ".join(f"{k} {v}" for k, v in sorted(self.missed.items())) or "none"
        unacked = ", ".join(f"{k} {v}" for k, v in sorted(self.unacknowledged.items())) or "none"
        socket = ", ".join(f"{k} {v}" for k, v in sorted(self.socket.items())) or "none"
        return [
            f"seed {c.seed}, {c.topology} (R{c.stream_replicas}), {c.seconds:g}s of faults, "
            f"{self.seconds:.0f}s in all",
            f"services: {c.services}, {c.partitions} partitions; replicas killed "
            f"{self.faults['replica-kill']}, frozen {self.faults['replica-stall']}, "
            f"stopped (SIGTERM) {self.faults['replica-restart']}, each started again; "
            f"partition moves: {self.moves}",
            f"runs checked: {self.runs}; journal records scanned: {self.records}; "
            f"acknowledged appends checked: {self.acks}",
            f"faults injected: {faults}",
            f"faults not injected (the cluster did not answer the nemesis): {missed}",
            f"records stored whose append returned no sequence, by how it ended: {unacked}",
            f"inputs: {inputs}",
            f"engine counters: {engine}",
            f"the first replica's local socket carried: {socket}",
            *([self.conversation.line()] if self.conversation else []),
            f"violations: {len(self.violations)}",
            *(f"  {v}" for v in self.violations[:50]),
        ]


@dataclasses.dataclass
class Conversation:
    """The soak's long conversation: how far it got, and what it went through."""

    turns: int = 0
    run_id: str = ""
    claims: int = 0  # its turns that rebuilt the state from the chain
    ended: bool = False
    state_bytes: int = 0
    seconds: float = 0.0
    faults: Counter[str] = dataclasses.field(default_factory=Counter)
    # Worker faults that hit the process running its turns, copies of its
    # task, and the acks lost on its own writes.
    aimed: Counter[str] = dataclasses.field(default_factory=Counter)

    def line(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        aimed = ", ".join(f"{k} {v}" for k, v in sorted(self.aimed.items())) or "none"
        return (
            f"conversation: {self.turns} turns in {self.seconds:.0f}s, {self.claims} claims, "
            f"final state {self.state_bytes} bytes; faults "
            f"during it: {faults}; on its worker or its writes: {aimed}"
        )


class Soak:
    def __init__(self, config: SoakConfig, base: Path) -> None:
        self.config = config
        self.base = base
        self.state = base / "tools"
        self.state.mkdir(parents=True, exist_ok=True)
        seed = config.seed
        self.schedule = random.Random(f"{seed}/schedule")
        self.choices = random.Random(f"{seed}/runs")
        self.report = Report(config)
        self.faults = self.report.faults
        self.stop = asyncio.Event()  # no new runs, no new faults
        self.healing = asyncio.Event()  # undo every pending fault now
        self.workers: list[subprocess.Popen[bytes]] = []
        self.stalled: set[int] = set()
        self.node_down: int | None = None
        self.in_flight: dict[str, str] = {}  # run -> its step's task
        self.pending: set[asyncio.Task[None]] = set()
        self.task = f"chaos-{seed}"
        self.workflow = f"chaos-{seed}"
        self.targets: list[str] = []
        self.worker_logs = 0
        self.preferences: dict[int, int] = {}  # worker pid -> its preference
        self.lossy: list[LossyPublish] = []
        self.replicas: list[ReplicaProcess] = []
        self.replicas_down: set[str] = set()  # killed, frozen or stopped, not yet back

    # ---- the whole soak ------------------------------------------------------------

    async def run(self) -> Report:
        c = self.config
        print(
            f"chaos soak: seed {c.seed} ({c.topology}, {c.seconds:g}s); replay with make "
            f"test-chaos SEED={c.seed} CHAOS_TOPOLOGY={c.topology} CHAOS_SECONDS={c.seconds:g}",
            flush=True,
        )
        began = time.monotonic()
        nats_dir = self.base / "nats"
        security = suite_security()  # DAGNATS_TEST_NATS_AUTH: accounts and TLS
        self.nats: NatsServer | NatsCluster = await (
            NatsCluster.start(nats_dir, security=security)
            if c.topology == "cluster"
            else NatsServer.start(nats_dir, security=security)
        )
        try:
            acks_rng = random.Random(f"{c.seed}/acks")
            with (
                instrumented_journal(acks_rng, self.faults, c.lost_ack_rate) as tap,
                socket_dir() as short,  # a socket's path must fit 107 bytes
            ):
                await self._soak(tap, short / "local.sock")
        finally:
            await self.nats.stop()
        self.report.seconds = time.monotonic() - began
        REPORTS.append(self.report)
        for line in self.report.lines():
            print(f"chaos soak: {line}", flush=True)
        return self.report

    async def _soak(self, tap: JournalTap, sessions: Path) -> None:
        c = self.config
        engines: list[EngineServer] = []
        clients: list[Client] = []
        lossy: list[LossyPublish] = []
        self.nc = await jsx.connect(self.nats.url, name="chaos-soak")
        watching = asyncio.create_task(self._watch_owners())
        try:
            if c.replica_processes:
                await self._start_replicas(sessions)
                dials = [self._dial(i) for i in range(len(self.targets))]
            else:
                engines = await self._start_engines(sessions)
                lossy = [
                    publisher
                    for i, engine in enumerate(engines)
                    for publisher in lossy_services(
                        engine,
                        random.Random(f"{c.seed}/engine-acks/{i}"),
                        random.Random(f"{c.seed}/input-acks/{i}"),
                        self.faults,
                        c.lost_ack_rate / 2,
                    )
                ]
                self.lossy = [*lossy, *tap.publishers]
                self.targets = dials = [e.target for e in engines]
            clients = [Client(t) for t in dials]
            await clients[0].register_workflow(loop_workflow(self.workflow, self.task))
            talk = loop_workflow(
                chaos_worker.conversation_task(self.workflow),
                chaos_worker.conversation_task(self.task),
                max_iterations=c.conversation_turns + 5,
            )
            await clients[0].register_workflow(talk)
            for i in range(c.workers):
                self._spawn_worker(i)
            await wait_for(self._all_ready, timeout=60, message="chaos workers polling")
            n = len(clients)
            drivers = [
                asyncio.create_task(self._driver(i, clients[i % n], dials[i % n]))
                for i in range(c.runs_in_flight)
            ]
            drivers.append(asyncio.create_task(self._conversation(clients[1], dials[1])))
            nemesis = asyncio.create_task(self._nemesis())
            await asyncio.sleep(c.seconds)  # the soak's length, not a synchronisation
            self.stop.set()
            await nemesis
            await self._heal()
            tap.lose_acks(False)
            for publisher in lossy:
                publisher.active = False
            for replica in self.replicas:
                replica.heal()
            await asyncio.gather(*drivers)
            if self.replicas:
                for replica in self.replicas:
                    await self._stop_replica(replica)  # its last counters written
                tap = self._replicas_tap()
                self._count_replicas()
            else:
                for engine in engines:
                    self.report.engine.update(engine.engine.counters)
                self._count_socket(engines[0])
            await self._scan(tap)
            if self.report.engine["dead_letters"]:
                self.report.violations.append(
                    f"{self.report.engine['dead_letters']} history event(s) moved to dead letters"
                )
        finally:
            self.healing.set()
            self.stop.set()
            watching.cancel()
            for proc in self.workers:
                _reap(proc)
            for client in clients:
                await client.close()
            for engine in engines:
                await engine.stop()
            for replica in self.replicas:
                replica.kill()
            await self.nc.close()

    # ---- the replicas ------------------------------------------------------------------

    def _partitioned(self, name: str) -> dict[str, str]:
        """A replica's settings: the soak's partitions and lease, and its name."""
        c = self.config
        return {
            "DAGNATS_PARTITIONS": str(c.partitions),
            "DAGNATS_PARTITION_LEASE": f"{c.partition_lease:g}",
            "DAGNATS_REPLICA_ID": name,
        }

    async def _start_engines(self, sessions: Path) -> list[EngineServer]:
        """Two replicas in this process, the first with the local socket."""
        topology = jsx.Topology(replicas=self.config.stream_replicas)
        engines = []
        for i, socket in enumerate((sessions, None)):
            with _environment(self._partitioned(f"replica-{i + 1}")):
                engines.append(
                    await start_engine(
                        self.nats.url, config=SOAK, topology=topology, local_socket=socket
                    )
                )
        return engines

    async def _start_replicas(self, sessions: Path) -> None:
        """Replica processes, the first with the local socket."""
        c = self.config
        for i in range(c.replica_processes):
            name = f"replica-{i + 1}"
            self.replicas.append(
                ReplicaProcess(
                    self.nats.url,
                    self.base,
                    name,
                    seed=c.seed,
                    stream_replicas=c.stream_replicas,
                    lost_ack_rate=c.lost_ack_rate,
                    socket=sessions if i == 0 else None,
                    env=self._partitioned(name),
                )
            )
        for replica in self.replicas:
            await replica.start(within=60)
        self.targets = [r.target for r in self.replicas]

    def _dial(self, preference: int) -> str:
        """Every replica, the preferred one first: a call goes to the next
        while one is down."""
        n = len(self.targets)
        order = [self.targets[(preference + k) % n] for k in range(n)]
        return "ipv4:" + ",".join(order)

    def _summaries(self, name: str = "") -> list[dict[str, Any]]:
        """What each replica process (``name``'s alone, when given) wrote of itself."""
        pattern = f"{name or 'replica-*'}-*.json"
        return [json.loads(path.read_text()) for path in sorted(self.base.glob(pattern))]

    def _replicas_tap(self) -> JournalTap:
        """The acks the replica processes' journal stores logged."""
        tap = JournalTap()
        for path in sorted(self.base.glob("replica-*.acks")):
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the last line of a process killed mid-write
                if "ack" in entry:
                    subject, msg_id, kind, seq = entry["ack"]
                    tap.acks.append(Ack(subject, msg_id, kind, seq))
                else:
                    msg_id, ended = entry["failed"]
                    tap.failed[msg_id] = ended
        return tap

    def _count_replicas(self) -> None:
        """The replica processes' engine counters and lost acks, and what the
        first one's local socket carried."""
        for summary in self._summaries():
            self.report.engine.update(summary.get("engine", {}))
            self.faults.update(summary.get("faults", {}))
        carried: Counter[str] = Counter()
        for summary in self._summaries(self.replicas[0].name):
            carried.update(summary.get("socket", {}))
        self._carried(carried)

    def _lost_subjects(self) -> Counter[str]:
        """The acks lost so far, by subject, in this process and the replicas."""
        lost: Counter[str] = Counter()
        for publisher in self.lossy:
            lost.update(publisher.subjects)
        for summary in self._summaries():
            lost.update(summary.get("lost", {}))
        return lost

    def _count_socket(self, engine: EngineServer) -> None:
        sockets = engine.local_socket
        assert sockets is not None
        self._carried(
            Counter(connections=sockets.accepted, polls=sockets.polled, watches=sockets.watched)
        )

    def _carried(self, carried: Counter[str]) -> None:
        """What the first replica's local socket carried: a soak whose socket
        carried none would test gRPC alone."""
        self.report.socket.update(carried)
        for kind in ("connections", "polls", "watches"):
            if not carried[kind]:
                self.report.violations.append(f"the local socket carried no {kind}")

    async def _watch_owners(self) -> None:
        """Count the partition moves: an owner key put naming another replica
        than it last named (after a release, a lapsed lease or a rebalance)."""
        js = self.nc.jetstream(timeout=5)
        owners: dict[str, bytes] = {}
        while True:
            try:
                kv = await js.key_value(OWNERS)
                watcher = await kv.watch("owner.*")
            except (nats.errors.Error, nats.js.errors.Error, OSError):
                await asyncio.sleep(1.0)  # not provisioned yet, or the cluster is down
                continue
            try:
                while True:
                    try:
                        entry = await watcher.updates(timeout=5)
                    except nats.errors.TimeoutError:
                        continue
                    if entry is None or entry.operation is not None or not entry.value:
                        continue  # the end of the initial values, or a release
                    last = owners.get(entry.key)
                    if last is not None and last != entry.value:
                        self.report.moves += 1
                    owners[entry.key] = entry.value
            except (nats.errors.Error, nats.js.errors.Error, OSError):
                await asyncio.sleep(1.0)  # watch again
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

    # ---- runs ------------------------------------------------------------------------

    async def _driver(self, index: int, client: Client, target: str) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            journal = jgrpc.JournalServiceStub(channel)
            n = 0
            while not self.stop.is_set():
                label = f"{index}-{n}"
                try:
                    await self._one_run(client, journal, label)
                except Exception as err:  # reported with the rest, the soak goes on
                    self.report.violations.append(f"run {label}: {type(err).__name__}: {err}")
                    # Where it was raised, for the reader of the soak's output.
                    traceback.print_exc(file=sys.stderr)
                n += 1

    async def _one_run(self, client: Client, journal: Any, label: str) -> None:
        key = f"{self.config.seed}-{label}"
        run = await _retry(
            lambda: client.start_run(self.workflow, {"run": label}, idempotency_key=key)
        )
        run_id = run.run_id
        self.in_flight[run_id] = self.task
        submitted: list[str] = []
        count = self.choices.choice((0, 0, 1, 2))
        delays = [self.choices.uniform(0, 0.5) for _ in range(count)]
        inputs = asyncio.create_task(self._submit(client, run_id, delays, submitted))
        try:
            done = await self._finished(client, run_id)
        finally:
            await inputs
            self.in_flight.pop(run_id, None)
        problems = await self._check(client, journal, run_id, done, submitted)
        self.report.runs += 1
        self.report.violations.extend(f"run {run_id} ({label}): {p}" for p in problems)

    async def _conversation(self, client: Client, target: str) -> None:
        """One conversation of ``conversation_turns`` turns through the faults,
        then its checks: the state every turn appended, once each and in order."""
        turns = self.config.conversation_turns
        talk = Conversation()
        self.report.conversation = talk
        began, before = time.monotonic(), Counter(self.faults)
        workflow = chaos_worker.conversation_task(self.workflow)
        key = f"{self.config.seed}-conversation"
        try:
            run = await _retry(
                lambda: client.start_run(workflow, {"turns": turns}, idempotency_key=key)
            )
            talk.run_id = run.run_id
            self.in_flight[run.run_id] = chaos_worker.conversation_task(self.task)
            try:
                deadline = self.config.seconds + self.config.run_deadline
                done = await client.wait_for_run(run.run_id, timeout=deadline)
            finally:
                self.in_flight.pop(run.run_id, None)
            talk.seconds, talk.ended = time.monotonic() - began, True
            talk.faults.update(Counter(self.faults) - before)
            talk.aimed["lost-ack"] = sum(
                n for subject, n in self._lost_subjects().items() if run.run_id in subject
            )
            problems = await self._check_conversation(talk, target, done, turns)
        except Exception as err:  # reported with the rest
            problems = [f"{type(err).__name__}: {err}"]
        self.report.violations.extend(f"the conversation: {p}" for p in problems)

    async def _check_conversation(
        self, talk: Conversation, target: str, done: pb.Run, turns: int
    ) -> list[str]:
        problems = []
        if done.status != pb.RUN_STATUS_COMPLETED or run_output(done) != {"turns": turns}:
            status = pb.RunStatus.Name(done.status)
            problems.append(f"{status} with output {done.output!r}, error {done.error!r}")
        iterations = steps_by_id(done)["agent"].iterations  # the continues
        talk.turns = iterations + 1
        if talk.turns != turns:
            problems.append(f"the engine counted {iterations} iterations")
        async with grpc.aio.insecure_channel(target) as channel:
            journal = jgrpc.JournalServiceStub(channel)
            check = await _retry(lambda: journal.Check(jpb.CheckRequest(run_id=done.run_id)))
            request = jpb.ReadRequest(run_id=done.run_id, step_id="agent")
            records = await _retry(lambda: _read_all(journal, request))
        problems += [f"journal check: {v.rule} at {v.seq}: {v.message}" for v in check.violations]
        talk.claims = sum(1 for r in records if r.HasField("claim") or r.HasField("leading_claim"))
        async with JournalClient(target) as reader:
            raw = await _retry(lambda: reader.state(done.run_id, "agent")) or b""
        talk.state_bytes = len(raw)
        state = json.loads(raw or b"{}")
        want = [chaos_worker.conversation_message(n, n) for n in range(turns)]
        got = state.get("messages", [])
        if got != want or state.get("turns") != turns:
            pairs = enumerate(zip(got, want, strict=False))
            wrong = next((n for n, (a, b) in pairs if a != b), min(len(got), turns))
            problems.append(
                f"the final state holds {len(got)} messages (turns {state.get('turns')}); "
                f"the first out of place is turn {wrong}"
            )
        return problems

    async def _submit(
        self, client: Client, run_id: str, delays: list[float], submitted: list[str]
    ) -> None:
        for k, delay in enumerate(delays):
            await asyncio.sleep(delay)  # when the person types, not a synchronisation
            request_id = f"in-{k}"
            try:
                submit = functools.partial(
                    client.submit_input, run_id, "agent", request_id, {"k": k}
                )
                await _retry(submit)
            except errors.Conflict:
                continue  # the step finished first
            submitted.append(request_id)

    async def _finished(self, client: Client, run_id: str) -> pb.Run | None:
        """The run once it has ended, or None after the deadline: a watch, as a
        user waits (on the first engine's local socket once its client has
        found it); it rides out what the faults do to its engine and stream."""
        try:
            return await client.wait_for_run(run_id, timeout=self.config.run_deadline)
        except errors.DeadlineExceeded:
            return None

    async def _check(
        self, client: Client, journal: Any, run_id: str, done: pb.Run | None, inputs: list[str]
    ) -> list[str]:
        if done is None:
            where = await self._where_stuck(client, journal, run_id)
            return [f"not finished after {self.config.run_deadline:g}s: {where}"]
        problems = []
        status = pb.RunStatus.Name(done.status)
        if done.status != pb.RUN_STATUS_COMPLETED or run_output(done) != agent.ANSWER:
            problems.append(f"{status} with output {done.output!r}, error {done.error!r}")
        iterations = steps_by_id(done)["agent"].iterations
        if iterations != agent.ITERATIONS:
            problems.append(f"the engine counted {iterations} iterations")
        check = await _retry(lambda: journal.Check(jpb.CheckRequest(run_id=run_id)))
        problems += [f"journal check: {v.rule} at {v.seq}: {v.message}" for v in check.violations]
        tools = self.state / f"{run_id}.tools"
        lines = tools.read_text().splitlines() if tools.exists() else []
        sends = sum(1 for line in lines if line.startswith("start send "))
        if sends > 1:
            problems.append(f"the unsafe tool started {sends} times")
        problems += await self._check_inputs(client, journal, run_id, inputs)
        return problems

    async def _where_stuck(self, client: Client, journal: Any, run_id: str) -> str:
        """The unfinished run's step and its journal's last records, to start
        the search for why it stands."""
        run = await _retry(lambda: client.get_run(run_id))
        step = steps_by_id(run)["agent"]
        request = jpb.ReadRequest(run_id=run_id, step_id="agent")
        records = await _retry(lambda: _read_all(journal, request))
        tail = ", ".join(
            f"{r.seq} {r.WhichOneof('kind')} ({r.iteration}, {r.attempt})" for r in records[-4:]
        )
        return (
            f"step {pb.StepStatus.Name(step.status)} at ({step.iteration}, {step.attempt}), "
            f"{step.iterations} iterations, {len(records)} records, the last: {tail or 'none'}"
        )

    async def _check_inputs(
        self, client: Client, journal: Any, run_id: str, inputs: list[str]
    ) -> list[str]:
        if not inputs:
            return []
        request = jpb.ReadRequest(run_id=run_id, step_id="agent")
        records = await _retry(lambda: _read_all(journal, request))
        placed = Counter(
            r.input_placed.request_id
            for r in records
            if r.HasField("input_placed") and not r.input_placed.carried
        )
        problems = []
        for request_id in inputs:
            got = await self._settled_input(client, run_id, request_id)
            self.report.inputs[ipb.Status.Name(got.status).removeprefix("STATUS_").lower()] += 1
            expected = 1 if got.status == ipb.STATUS_DONE else 0
            if got.status not in (ipb.STATUS_DONE, ipb.STATUS_UNANSWERED):
                problems.append(f"input {request_id} is {ipb.Status.Name(got.status)}")
            elif placed[request_id] != expected:
                problems.append(
                    f"input {request_id} reads {ipb.Status.Name(got.status)} "
                    f"with {placed[request_id]} input.placed record(s)"
                )
        return problems

    async def _settled_input(self, client: Client, run_id: str, request_id: str) -> ipb.Input:
        """The input once the finished step settled it (a queued one is closed as
        unanswered shortly after the step ends); the last state seen otherwise."""
        last: list[ipb.Input] = []

        async def settled() -> bool:
            last[:] = [await _retry(lambda: client.get_input(run_id, "agent", request_id))]
            return last[0].status in (ipb.STATUS_DONE, ipb.STATUS_UNANSWERED)

        with contextlib.suppress(AssertionError):
            await wait_for(settled, timeout=30, interval=0.2)
        return last[0]

    # ---- workers ---------------------------------------------------------------------

    def _spawn_worker(self, preference: int) -> None:
        """Worker ``preference``: an even one dials every replica, its
        preferred one first, and moves to the local socket when the first
        replica's polls name it; an odd one stays on gRPC and spreads its
        polls over every replica (``DAGNATS_GRPC_BALANCE``). A replica hands
        out only the tasks of the partitions it owns, so the odd ones keep
        every partition's tasks handed out wherever the even ones went."""
        env = {} if preference % 2 == 0 else BALANCED
        target = self._dial(preference % len(self.targets))
        args = [sys.executable, chaos_worker.__file__, target, self.task, str(self.state)]
        args.append(str(self.config.concurrency))
        self.worker_logs += 1
        with open(self.base / f"worker-{self.worker_logs}.log", "wb") as out:
            proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=child_env(**env)
            )
        self.workers.append(proc)
        self.preferences[proc.pid] = preference

    def _all_ready(self) -> bool:
        return all((self.state / f"ready-{p.pid}").exists() for p in self.workers)

    def _healthy(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.workers if p.poll() is None and p.pid not in self.stalled]

    def _victim(
        self, kind: str, healthy: list[subprocess.Popen[bytes]], pick: float
    ) -> subprocess.Popen[bytes]:
        """The worker a kill or stall hits: one in four picks hits the process
        running the conversation's turns, while it runs them, so the
        conversation meets these faults too; the others fall where they may."""
        talk = self.report.conversation
        holder = self.state / "conversation.holder"
        running = talk is not None and not talk.ended and holder.exists()
        pid = int(holder.read_text() or 0) if running else 0
        held = [p for p in healthy if p.pid == pid]
        victim = held[0] if held and pick < 0.25 else healthy[int(pick * len(healthy))]
        if talk is not None and victim.pid == pid:
            talk.aimed[kind] += 1
        return victim

    # ---- the nemesis -------------------------------------------------------------------

    async def _nemesis(self) -> None:
        weights = self.config.weights()
        kinds, shares = list(weights), list(weights.values())
        while not self.stop.is_set():
            gap = self.schedule.uniform(*self.config.fault_gap)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), gap)
                return
            kind = self.schedule.choices(kinds, shares)[0]
            pick = self.schedule.random()  # which target: fixed by the seed, not the moment
            delay = self.schedule.uniform(0.0, 1.0)
            try:
                await getattr(self, "_" + kind.replace("-", "_"))(pick, delay)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as err:
                self.report.missed[f"{kind} ({type(err).__name__})"] += 1

    async def _worker_kill(self, pick: float, delay: float) -> None:
        healthy = self._healthy()
        if len(healthy) < 2:
            return
        victim = self._victim("worker-kill", healthy, pick)
        _reap(victim)
        self.workers.remove(victim)
        self.faults["worker-kill"] += 1
        preference = self.preferences.pop(victim.pid)  # its like takes its place
        self._later(0.2 + 1.5 * delay, lambda: self._spawn_worker(preference))

    async def _worker_stall(self, pick: float, delay: float) -> None:
        healthy = self._healthy()
        if len(healthy) < 2:
            return
        victim = self._victim("worker-stall", healthy, pick)
        victim.send_signal(signal.SIGSTOP)
        self.stalled.add(victim.pid)
        self.faults["worker-stall"] += 1

        def thaw() -> None:
            self.stalled.discard(victim.pid)
            if victim.poll() is None:
                victim.send_signal(signal.SIGCONT)

        self._later(LEASE + 0.5 + (LEASE + 1.0) * delay, thaw)

    async def _duplicate_delivery(self, pick: float, delay: float) -> None:
        if not self.in_flight:
            return
        runs = sorted(self.in_flight)
        run_id = runs[int(pick * len(runs))]
        subject = f"tasks.{self.in_flight[run_id]}.{slot_of(run_id)}.{run_id}.agent"
        js = self.nc.jetstream()
        try:
            task = await js.get_last_msg(jsx.TASKS, subject)
        except nats.js.errors.NotFoundError:
            return  # between two dispatches
        self.faults["duplicate-delivery"] += 1
        talk = self.report.conversation
        if talk is not None and run_id == talk.run_id:
            talk.aimed["duplicate-delivery"] += 1
        headers = dict(task.headers or {})
        headers["Nats-Msg-Id"] = f"{headers.get('Nats-Msg-Id', subject)}.dup{int(pick * 1e9)}"
        await js.publish(subject, task.data or b"", headers=headers)

    async def _stepdown(self, pick: float, delay: float) -> None:
        stream = STREAMS[int(pick * len(STREAMS))]
        reply = await self.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        if "error" not in json.loads(reply.data):
            self.faults["stepdown"] += 1

    async def _leader_kill(self, pick: float, delay: float) -> None:
        cluster = self.nats
        if not isinstance(cluster, NatsCluster) or self.node_down is not None:
            return
        stream = STREAMS[int(pick * len(STREAMS))]
        info = await self.nc.jetstream(timeout=5).stream_info(stream)
        leader = info.cluster.leader if info.cluster else None
        if not leader:
            return
        index = int(leader.removeprefix("n")) - 1
        cluster.kill(index)
        self.node_down = index
        self.faults["leader-kill"] += 1

        async def restart() -> None:
            await cluster.restart(index)
            self.node_down = None

        self._later(0.5 + 2.5 * delay, restart)

    async def _hit_replica(
        self,
        kind: str,
        pick: float,
        hit: Callable[[ReplicaProcess], Awaitable[None] | None],
        back_after: float,
    ) -> None:
        """Hit one replica, as long as another still serves, and start it
        again, or thaw it, ``back_after`` seconds later."""
        steady = [r for r in self.replicas if r.name not in self.replicas_down]
        if len(steady) < 2:
            return
        replica = steady[int(pick * len(steady))]
        self.replicas_down.add(replica.name)
        result = hit(replica)
        if result is not None:
            await result
        self.faults[kind] += 1

        async def back() -> None:
            await replica.ensure_serving()
            self.replicas_down.discard(replica.name)

        self._later(back_after, back)

    async def _replica_kill(self, pick: float, delay: float) -> None:
        await self._hit_replica("replica-kill", pick, ReplicaProcess.kill, 0.5 + 2.5 * delay)

    async def _replica_stall(self, pick: float, delay: float) -> None:
        """Frozen past its partition lease: the others take its partitions
        meanwhile, and it wakes as a zombie."""
        lease = self.config.partition_lease
        thaw = lease + 0.5 + (lease + 1.0) * delay
        await self._hit_replica("replica-stall", pick, ReplicaProcess.freeze, thaw)

    async def _replica_restart(self, pick: float, delay: float) -> None:
        """SIGTERM: it hands its partitions over at once; it starts again later."""
        await self._hit_replica("replica-restart", pick, self._stop_replica, 0.2 + 1.5 * delay)

    async def _stop_replica(self, replica: ReplicaProcess) -> None:
        """SIGTERM, and the exit it must make: 0, or SIGKILL's after the grace
        when its stop takes longer. Any other code is a stop that failed, which
        may have left its gRPC server to end open calls with CANCELLED."""
        await replica.stop()
        code = replica.proc.returncode if replica.proc is not None else 0
        if code not in (0, -signal.SIGKILL):
            self.report.violations.append(
                f"{replica.name} exited with {code} on SIGTERM:\n{replica.log_tail(30)}"
            )

    def _later(self, seconds: float, undo: Callable[[], Awaitable[None] | None]) -> None:
        """Undo a fault after ``seconds``, or as soon as the soak heals."""

        async def run() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.healing.wait(), seconds)
            result = undo()
            if result is not None:
                await result

        task = asyncio.create_task(run())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _heal(self) -> None:
        """Undo every fault: thaw, restart, and bring the workers back to strength."""
        self.healing.set()
        while self.pending:
            await asyncio.gather(*list(self.pending))
        alive = {self.preferences[p.pid] for p in self.workers if p.poll() is None}
        for preference in range(self.config.workers):
            if preference not in alive:
                self._spawn_worker(preference)
        if isinstance(self.nats, NatsCluster):
            await self.nats.wait_for_meta_leader()

    # ---- the whole journal -------------------------------------------------------------

    async def _scan(self, tap: JournalTap) -> None:
        """Read every record's headers once and check the journal as a whole."""
        js = self.nc.jetstream(timeout=10)
        stored = await _headers_by_seq(js)
        self.report.records = len(stored)
        self.report.acks = len(tap.acks)
        violations = self.report.violations
        ids = Counter(h.get("Nats-Msg-Id", "") for _, h in stored.values())
        violations += [f"Msg-Id {i} stored {n} times" for i, n in ids.items() if n > 1]
        for msg_id in ids.keys() - {a.msg_id for a in tap.acks}:
            # Stored, yet its append returned no sequence: an outcome left
            # unknown (cancelled, unavailable) is fine; a refusal is a lie.
            ended = tap.failed.get(msg_id, "never returned")
            self.report.unacknowledged[ended] += 1
            if ended in ("Fenced", "InvalidArgument"):
                violations.append(f"{msg_id} is stored, but its append raised {ended}")
        for ack in tap.acks:
            found = stored.get(ack.seq)
            want = (ack.subject, ack.msg_id, ack.kind)
            got = None
            if found is not None:
                subject, headers = found
                got = (subject, headers.get("Nats-Msg-Id"), headers.get("Dagnats-Kind"))
            if got != want:
                violations.append(f"acknowledged {want} at {ack.seq}, stored there: {got}")
        previous: dict[str, int] = defaultdict(int)
        for seq in sorted(stored):
            subject, headers = stored[seq]
            expected = int(headers.get("Nats-Expected-Last-Subject-Sequence", "-1"))
            if expected != previous[subject]:
                violations.append(
                    f"{subject} record {seq} expected {expected}, follows {previous[subject]}"
                )
            previous[subject] = seq


class ReplicaProcess(EngineProcess):
    """A replica process of the soak (``tests/chaos/replica.py``), started
    again on its port after a kill or a stop."""

    def __init__(
        self,
        nats_url: str,
        base: Path,
        name: str,
        *,
        seed: int,
        stream_replicas: int,
        lost_ack_rate: float,
        socket: Path | None,
        env: dict[str, str],
    ) -> None:
        super().__init__(nats_url, base, name, stream_replicas=stream_replicas, env=env)
        self.seed = seed
        self.lost_ack_rate = lost_ack_rate
        self.socket = socket
        self.healed = False

    def _spawn(self) -> Path:
        ready = self.state / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        rate = 0.0 if self.healed else self.lost_ack_rate
        args = [sys.executable, chaos_replica.__file__, self.nats_url, str(self.port)]
        args += [str(ready), str(self.state / self.name), str(self.seed)]
        args += [str(self.stream_replicas), str(rate)]
        if self.socket is not None:
            args.append(str(self.socket))
        with open(self.state / f"{self.name}.log", "ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=child_env(**self.env)
            )
        self.starts += 1
        return ready

    def heal(self) -> None:
        """No more lost acks, in this process and any started after."""
        self.healed = True
        if self.running:
            os.kill(self.pid, signal.SIGUSR1)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _headers_by_seq(js: JetStreamContext) -> dict[int, tuple[str, dict[str, str]]]:
    info = await js.stream_info(jsx.JOURNAL)
    count = info.state.messages
    stored: dict[int, tuple[str, dict[str, str]]] = {}
    if not count:
        return stored
    config = ConsumerConfig(headers_only=True)
    sub = await js.subscribe("journal.>", ordered_consumer=True, config=config)
    try:
        while len(stored) < count:
            msg = await sub.next_msg(timeout=30)
            stored[msg.metadata.sequence.stream] = (msg.subject, dict(msg.headers or {}))
    finally:
        await sub.unsubscribe()
    return stored


async def _read_all(journal: Any, request: jpb.ReadRequest) -> list[jpb.Record]:
    return [r.record async for r in journal.Read(request)]


async def _retry(call: Callable[[], Awaitable[T]], *, within: float = 60.0) -> T:
    """Repeat a call that failed in transit (the soak's own reads and writes
    meet the same faults); domain answers pass through."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    delay = 0.05
    while True:
        try:
            return await call()
        except (errors.Unavailable, errors.DeadlineExceeded, grpc.aio.AioRpcError) as err:
            # The clients' rule for a read (safe to repeat), and UNKNOWN besides.
            transient = (
                not isinstance(err, grpc.aio.AioRpcError)
                or retriable(err.code(), error_code(err), idempotent=True)
                or err.code() == grpc.StatusCode.UNKNOWN
            )
            if not transient or loop.time() > deadline:
                raise
        except errors.DagnatsError as err:
            if type(err) is not errors.DagnatsError or loop.time() > deadline:
                raise  # a domain answer, not a transport failure
        await asyncio.sleep(delay)  # backoff before the same call again
        delay = min(delay * 2, 1.0)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
