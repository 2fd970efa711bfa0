"""``bench/bench_replicas.py`` (``make bench-replicas``): its knobs, a row
from the snapshots around its rounds, the tables and the issue's bars, the
failover's percentiles and the worker's account of the runs it runs; the
instructions part's counts (``bench/replica_instructions.py``), from a real
callgrind; and the bench itself, tiny, on one nats-server with 1 and 2
replicas. No timed assertion: the bench is run whole by ``make
bench-replicas``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import bench_replicas as br
from bench import replica_instructions as ri


def test_knobs_scale_down_and_refuse_what_cannot_be_measured() -> None:
    assert br.Knobs.from_env({}) == br.Knobs()
    assert br.Knobs().replicas == (1, 2, 3) and br.Knobs().partitions == 6
    small = br.Knobs.from_env(
        {"BENCH_TOPOLOGIES": "server", "BENCH_REPLICAS": "1,2", "BENCH_KILLS": "0"}
    )
    assert (small.topologies, small.replicas, small.kills) == (("server",), (1, 2), 0)
    assert br.Knobs.from_env({"BENCH_MODEL_MS": "250"}).paces == (250,)
    assert br.Knobs.from_env({"BENCH_INSTRUCTIONS": "0"}).instructions == 0  # no such part
    for env, named in (
        ({"BENCH_TOPOLOGIES": "server,moon"}, "BENCH_TOPOLOGIES"),
        ({"BENCH_REPLICAS": "2,3"}, "rise from 1"),
        ({"BENCH_REPLICAS": "1,3,2"}, "rise from 1"),
        ({"BENCH_REPLICAS": "one"}, "counts like"),
        ({"BENCH_PARTITIONS": "65"}, "at most 64"),
        ({"BENCH_ACK_WAIT": "0"}, "at least 1"),
        ({"BENCH_MODEL_MS": "0,fast"}, "milliseconds like"),
        ({"BENCH_MODEL_MS": "100,100"}, "distinct"),
        ({"BENCH_MODEL_MS": "-5"}, "up to 60000"),
        ({"BENCH_INSTRUCTIONS": "-1"}, "BENCH_INSTRUCTIONS must be at least 0"),
        ({"BENCH_C_COUNTED": "0"}, "BENCH_C_COUNTED must be at least 1"),
        ({"BENCH_MODEL_MS_COUNTED": "60001"}, "at most 60000"),
    ):
        with pytest.raises(SystemExit, match=named):
            br.Knobs.from_env(env)


def snap(cpu: dict[str, float], in_msgs: int, missed: float) -> dict[str, Any]:
    return {"cpu": cpu, "in_msgs": in_msgs, "counters": {"guess_missed": missed}}


def test_a_row_is_per_iteration_of_the_timed_rounds() -> None:
    k = br.Knobs(k=10, c=5)  # 50 iterations a round
    names = ("nats-server 1", "services r1", "worker r1", "client")
    before = snap(dict.fromkeys(names, 1.0), 1_000, 3)
    after = snap(
        {"nats-server 1": 1.1, "services r1": 1.3, "worker r1": 1.1, "client": 2.0}, 1_500, 8
    )
    before["route_msgs"], after["route_msgs"] = 200, 500  # members' messages, of in_msgs
    row = br.row_result(1, [0.5, 0.25], before, after, k)  # 100 iterations
    assert row["iterations_per_s"] == 150.0  # the median of 100 and 200
    assert row["rounds_iterations_per_s"] == [100.0, 200.0]
    assert row["in_msgs_per_iteration"] == 5.0
    assert row["route_msgs_per_iteration"] == 3.0
    assert row["cpu_ms_all"] == pytest.approx(5.0)  # the client left out
    assert row["cpu_ms_services"] == pytest.approx(3.0)
    assert row["guess_missed_per_iteration"] == 0.05


def test_a_row_carries_c_runs_for_each_replica_only_while_the_model_sets_the_pace() -> None:
    assert [br.runs_at_once(20, n, 100) for n in (1, 2, 3)] == [20, 40, 60]
    assert [br.runs_at_once(20, n, 0) for n in (1, 2, 3)] == [20, 20, 20]


KINDS = [
    ("journal.r1.s1", "_INBOX.x.1", "append JOURNAL"),
    ("$KV.RUNS.r1", "_INBOX.x.2", "write RUNS"),
    ("$JS.API.STREAM.MSG.GET.KV_RUNS", "_INBOX.x.3", "get KV_RUNS"),
    ("$JS.API.DIRECT.GET.AGENT_JOURNAL", "_INBOX.x.4", "get AGENT_JOURNAL"),
    ("$JS.API.CONSUMER.MSG.NEXT.TASKS.tasks-t-0", "_INBOX.x.5", "pull TASKS"),
    ("$JS.ACK.TASKS.tasks-t-0.1.2.3.4.5", "", "ack TASKS"),
    ("$JS.API.CONSUMER.CREATE.KV_RUNS", "_INBOX.x.6", "api CONSUMER.CREATE"),
    ("dagnats.stream.r1.s1", "", "publish dagnats.stream"),
    ("tasks.t.3.r1.s1", "", "publish TASKS"),
    ("created.r1", "", "publish RUNS_CREATED"),
    # What nats-server sends out: replies, deliveries, advisories.
    ("_INBOX.x.1", "", "out reply"),
    ("$KV.RUNS.r1", "$JS.ACK.KV_RUNS.watch.1.2.3.4.0", "out delivered KV_RUNS"),
    ("$JS.EVENT.ADVISORY.CONSUMER.CREATED.KV_RUNS.x", "", "out advisory"),
]


@pytest.mark.parametrize(("subject", "reply", "expected"), KINDS)
def test_a_message_is_counted_by_what_it_does(subject: str, reply: str, expected: str) -> None:
    from bench.message_kinds import kind

    assert kind(subject, reply) == expected


def test_kinds_are_counted_an_iteration_between_two_snapshots() -> None:
    from bench.message_kinds import per_iteration

    assert per_iteration({"a": 10, "b": 4}, {"a": 30, "b": 4, "c": 5}, 10) == {"a": 2.0, "c": 0.5}


def row(n: int, its: float, msgs: float, cpu: float, **extra: Any) -> dict[str, Any]:
    return {
        "replicas": n,
        "runs_at_once": 20 * n,
        "iterations_per_s": its,
        "in_msgs_per_iteration": msgs,
        "cpu_ms_all": cpu,
        "cpu_ms_services": cpu / 2,
        "guess_missed_per_iteration": 0.0,
        "slowest_round_s": 1.5,
        "runs_finished": 120 * n,
        **extra,
    }


def test_each_count_is_the_median_of_its_passes_beside_one_replicas() -> None:
    rows = {
        "server": [
            row(1, 100, 9.0, 9.0, warm_up=True),  # in no summary
            row(1, 800, 5.0, 2.0),
            row(2, 770, 5.4, 2.1),
            row(3, 790, 5.6, 2.5),
            row(1, 760, 5.0, 2.2),
            row(2, 800, 5.4, 2.3, slowest_round_s=31.0),  # a round that waited out a lease
            row(3, 700, 5.6, 2.8),
            row(1, 780, 5.0, 2.1),
            row(2, 790, 5.6, 2.2),
            row(3, 760, 5.5, 2.6),
        ]
    }
    table = br.thr_table(rows).splitlines()
    assert len(table) == 2 + 3
    # 1 replica: medians 780, 5.0, 2.1; 2 replicas: 790, 5.4, 2.2.
    assert table[3].startswith(
        "| one nats-server | 2 | 40 | 790 | 1.01x | 5.40 | 1.08x | 0.00 | n/a | 2.200 | 1.05x "
        "| 1.100 | 1.05x | 2.100-2.300 | 0.000 | 31.0 | 720 |"
    )
    got = dict(br.bars(rows))
    two, three = "one nats-server, 2 replicas:", "one nats-server, 3 replicas:"
    assert got[f"{two} iterations/s 1.01x of 1's (>= 1)"] is True
    assert got[f"{two} messages into nats-server /it 1.08x of 1's (<= 1.1)"] is True
    assert got[f"{three} messages into nats-server /it 1.12x of 1's (<= 1.1)"] is False
    assert len(got) == 3  # messages for 2 and for 3 replicas, the throughput of 2


def test_failover_is_percentiles_over_every_stopped_run() -> None:
    stops = [
        {"held": 3, "moved_s": [5.0, 5.1, 5.2], "not_moved": 0, "record_s": [5.0], "exited_s": 0.1},
        {"held": 3, "moved_s": [5.3, 9.0], "not_moved": 1, "record_s": [6.0], "exited_s": 0.3},
    ]
    got = br.stops_result(stops)
    assert (got["stops"], got["runs"], got["not_moved"]) == (2, 6, 1)
    assert (got["p50_s"], got["p99_s"], got["max_s"]) == (5.2, 9.0, 9.0)
    assert (got["exited_p50_s"], got["record_p50_s"]) == (0.3, 6.0)  # nearest rank
    table = br.failover_table({"cluster": {"kill": got}}, br.Knobs()).splitlines()
    assert table[2] == (
        "| 3-node cluster, R3 | kill -9 | 2 | 6 | 5.20 | 9.00 | 9.00 | 1 | 0.30 | 6.00 |"
    )


def test_the_data_is_kept_when_the_bench_stops_on_a_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with br.kept_on_failure("bench-replicas-test-") as fine:
        Path(fine, "r1.err").write_text("served")
    assert not Path(fine).exists()
    with pytest.raises(SystemExit), br.kept_on_failure("bench-replicas-test-") as failed:
        Path(failed, "r1.err").write_text("stopped answering")
        raise SystemExit("replica r1's worker ran none of the runs in 30 s")
    assert Path(failed, "r1.err").read_text() == "stopped answering"
    assert failed in capsys.readouterr().err
    shutil.rmtree(failed)


async def test_a_worker_tells_when_each_iteration_of_a_run_began(tmp_path: Path) -> None:
    held = br.Held(tmp_path / "held")

    async def handler(tc: Any) -> None:
        pass

    tracked = held.track(handler)
    start = time.monotonic()
    await tracked(SimpleNamespace(run_id="a", iteration=0, input={"k": 3}))
    await tracked(SimpleNamespace(run_id="a", iteration=1, input={"k": 3}))
    held.began["b"] = [start - 5]  # an iteration long ago: it has moved on
    held.write()
    told = json.loads((tmp_path / "held").read_text())
    assert len(told["began"]["a"]) == 2 and told["now"] >= told["began"]["a"][1] >= start
    assert br.running(told, {"a", "b", "c"}) == ["a"]
    after = br.resumed(told, {"a", "b"}, t0=start - 1)  # "b" began nothing since
    assert set(after) == {"a"} and 1 <= after["a"] < 2


async def test_the_bench_on_one_server_with_one_and_two_replicas() -> None:
    k = br.Knobs(
        topologies=("server",),
        replicas=(1, 2),
        k=3,
        c=2,
        rounds=1,
        repeats=2,
        kills=0,
        paces=(0, 20),  # the model answering at once, and in 20 ms
        instructions=0,  # callgrind's start alone takes a minute
        kinds=1,
    )
    got = await br.measure(k)
    assert list(got["thr"]) == ["server", "server/20"]  # a deployment for each answer time
    rows = got["thr"]["server"]
    assert [(r["replicas"], r.get("warm_up", False), r.get("repeat")) for r in rows] == [
        (1, True, None),
        (1, False, 1),
        (2, False, 1),
        (1, False, 2),
        (2, False, 2),
    ]
    # At once, C runs in all; paced, C runs for each replica; every run answered.
    paced = got["thr"]["server/20"]
    assert all(r["runs_at_once"] == k.c for r in rows)
    assert all(r["runs_at_once"] == k.c * r["replicas"] for r in paced)
    for r in [*rows, *paced]:
        assert r["runs_finished"] == (k.rounds + 1) * r["runs_at_once"]
        assert r["in_msgs_per_iteration"] > 0 and r["cpu_ms_all"] > 0
    assert set(rows[2]["cpu_ms_per_iteration"]) >= {"services r1", "services r2", "worker r2"}
    report = br.report(got, k)
    for replicas, runs in (("1", "2"), ("2", "4")):
        assert f"| one nats-server | {replicas} | 2 |" in report
        assert f"| one nats-server, model 20 ms | {replicas} | {runs} |" in report
    assert "one nats-server, 2 replicas: iterations/s" in report
    assert "failover" not in report
    # Every iteration appends its tool call's intent and its commit to the
    # journal, and a run at most one record more (a claim that rode no record).
    for r in [*rows, *paced]:
        assert 2.0 <= r["kinds_per_iteration"]["append JOURNAL"] <= 2.0 + 1 / k.k
    assert "| append JOURNAL | 2." in report


def counted(n: int, services: float, worker: float) -> dict[str, Any]:
    return {
        "replicas": n,
        "iterations_per_s": 5.0,
        "instructions_per_iteration": {"services": services, "worker": worker},
        "in_msgs_per_iteration": 7.0,
    }


def test_instructions_are_the_median_of_the_passes_beside_one_replicas() -> None:
    rows = {
        "cluster": [
            counted(1, 5.0e6, 1.4e6),
            counted(3, 5.6e6, 1.4e6),
            counted(1, 5.2e6, 1.5e6),
            counted(3, 5.5e6, 1.5e6),
            counted(1, 5.4e6, 1.6e6),
            counted(3, 6.9e6, 1.6e6),  # a pass beside a partition's move
        ]
    }
    table = ri.table(rows).splitlines()
    assert table[2:] == [
        "| 3-node cluster, R3 | 1 | 5.0 | 5.20 | 1.00x | 5.00-5.40 | 1.50 | 1.00x | 7.00 | 1.00x |",
        "| 3-node cluster, R3 | 3 | 5.0 | 5.60 | 1.08x | 5.50-6.90 | 1.50 | 1.00x | 7.00 | 1.00x |",
    ]
    # Both processes of the replica: (5.6 + 1.5) / (5.2 + 1.5).
    assert ri.bars(rows) == [
        (
            "3-node cluster, R3, 3 replicas: instructions /it of the replicas' processes "
            "1.06x of 1's (<= 1.1)",
            True,
        )
    ]


def test_an_iteration_is_counted_in_the_window_it_began_in() -> None:
    told = {"now": 30.0, "began": {"a": [1.0, 10.0, 19.9], "b": [20.0, 25.0], "c": [5.0]}}
    assert ri.began_within(told, 10.0, 20.0) == 2  # a's at 10 and 19.9; b's at 20 is after


WORK = """
import sys
for line in sys.stdin:
    total = 0
    for i in range(int(line)):
        total += i * i
    print(total, flush=True)
"""


def test_callgrind_counts_what_a_process_executed_since_its_last_dump(tmp_path: Path) -> None:
    under = ri.callgrind(tmp_path)("r1", "worker")
    proc = subprocess.Popen(
        [*under, sys.executable, "-c", WORK],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    prefix = tmp_path / "r1-worker"

    def work(n: int) -> int:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{n}\n")
        proc.stdin.flush()
        return int(proc.stdout.readline())

    with proc:
        work(1)  # the interpreter has started
        ri.dumped(proc.pid, prefix)  # what the start executed, left out
        assert work(20_000) == sum(i * i for i in range(20_000))
        small = ri.dumped(proc.pid, prefix)
        work(200_000)
        large = ri.dumped(proc.pid, prefix)
        # Ten times the loop, about ten times the instructions, whatever
        # else the machine does meanwhile.
        assert 8 * small < large < 12 * small
        with pytest.raises(SystemExit, match="no callgrind dump of process"):
            ri.dumped(proc.pid, tmp_path / "elsewhere")  # its dumps are not there
        proc.kill()
