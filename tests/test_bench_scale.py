"""The pure parts of ``bench/bench_scale.py`` (``make bench-scale``): its
knobs, an iteration's period from journal records, wake latencies, what a
process holds, and the table of figures beside their baselines. No server
and no timing: the bench itself is run by ``make bench-scale``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import bench_scale as bs
from bench import bench_turn as bt
from bench import harness
from dagnats.journal.v1 import journal_pb2 as jpb


def test_knobs_scale_down_and_refuse_what_cannot_be_measured() -> None:
    assert bs.Knobs.from_env({}) == bs.Knobs()
    small = bs.Knobs.from_env({"BENCH_WAITERS": "500", "BENCH_LONG_K": "20", "BENCH_CLUSTER": "0"})
    assert (small.waiters, small.long_k, small.window, small.cluster) == (500, 20, 9, False)
    assert (small.turn.k, small.turn.c, small.turn.thr_rounds) == (50, 20, 3)  # the bench's K, C
    for env, named in (
        ({"BENCH_WAITERS": "0"}, "at least 1"),
        ({"BENCH_WAKES": "many"}, "whole number"),
        ({"BENCH_LONG_K": "100", "BENCH_WINDOW": "50"}, "BENCH_WINDOW"),
    ):
        with pytest.raises(SystemExit, match=named):
            bs.Knobs.from_env(env)


def record(iteration: int, at_ms: float, kind: str) -> jpb.Record:
    r = jpb.Record(iteration=iteration)
    r.time.FromNanoseconds(round(at_ms * 1e6))
    getattr(r, kind).SetInParent()
    return r


def journal(periods_ms: list[float], journal_ms: float) -> list[jpb.Record]:
    """A step's records: iteration i claims at the sum of the periods before
    it, writes a model record, and commits ``journal_ms`` after its claim."""
    records, at = [], 1_000.0
    for i, period in enumerate(periods_ms):
        records.append(record(i, at, "claim"))
        records.append(record(i, at + journal_ms / 2, "model"))
        records.append(record(i, at + journal_ms, "commit"))
        at += period
    return records


def test_an_iteration_is_timed_from_its_first_record_to_the_next_one() -> None:
    # 10 iterations: 5 ms each at first, 6 ms each at the end.
    first, commit = bs.iteration_times(journal([5.0] * 5 + [6.0] * 5, journal_ms=2.0))
    assert sorted(first) == list(range(10)) and sorted(commit) == list(range(10))
    found = bs.windows(first, commit, k=10, w=3)
    assert (found["first"]["from"], found["first"]["to"]) == (1, 3)
    assert (found["last"]["from"], found["last"]["to"]) == (6, 8)  # 9 has no next one
    assert found["first"]["period_ms"] == pytest.approx(5.0)
    assert found["last"]["period_ms"] == pytest.approx(6.0)
    assert found["last"]["journal_ms"] == pytest.approx(2.0)
    assert found["last"]["after_commit_ms"] == pytest.approx(4.0)
    assert found["ratio"] == pytest.approx(1.2)


def test_the_floor_is_timed_from_when_its_iterations_began() -> None:
    stamps = dict(enumerate([0.0, 0.004, 0.008, 0.012, 0.020, 0.028]))
    found = bs.windows(stamps, {}, k=6, w=2)
    assert found["first"]["period_ms"] == pytest.approx(4.0)
    assert found["last"]["period_ms"] == pytest.approx(8.0)
    assert "journal_ms" not in found["last"]


def test_a_window_with_no_timed_iteration_stops_the_bench() -> None:
    with pytest.raises(SystemExit, match="no iteration"):
        bs.window({0: 0.0}, {}, 0, 1)


def test_wake_latencies_are_percentiles_in_ms_with_the_first_wake() -> None:
    # 98 wakes of 1 ms to the handler's start, then two of 50 ms; the first bounced.
    wakes = [{"began": 0.001, "placed": 0.002, "seen": 0.003, "delivery": 1} for _ in range(98)]
    wakes += [{"began": 0.050, "placed": 0.051, "seen": 0.052, "delivery": 1}] * 2
    wakes[0] = {**wakes[0], "began": 0.004, "delivery": 7}
    got = bs.latencies(wakes)
    assert got["n"] == 100 and got["deliveries"][:2] == [7, 1]
    assert (got["began"]["p50"], got["began"]["p99"], got["began"]["first"]) == (1, 50, 4)
    assert (got["seen"]["p50"], got["seen"]["p99"]) == (3, 52)


def test_what_a_process_and_a_store_hold(tmp_path: Path) -> None:
    assert harness.rss_bytes(os.getpid()) > 1 << 20
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y")
    assert bs.disk_bytes(tmp_path) >= 10_001
    jsz = {
        "account_details": [
            {"stream_detail": [{"name": "KV_RUNS", "state": {"bytes": 300, "messages": 2}}]}
        ]
    }
    assert bt.stream_field(jsz, "bytes") == {"KV_RUNS": 300}


def thr(steps_per_s: float, cpu: float = 4.0) -> dict[str, Any]:
    return {"steps_per_s": steps_per_s, "cpu_ms_per_step": {"total": cpu}}


def one_server() -> dict[str, Any]:
    wake = {part: {"p50": 10.0, "p99": 20.0, "first": 10.0} for part in ("began", "placed", "seen")}
    window = {"from": 1, "to": 50, "period_ms": 20.0, "journal_ms": 9.0, "after_commit_ms": 11.0}
    mib = 1 << 20
    return {
        "floor": thr(1000.0),
        "one_engine": thr(210.0),
        "one_engine_again": thr(190.0),
        "one_engines": thr(200.0),
        "two_engines": thr(150.0, cpu=6.0),
        "while_waiting": thr(190.0),
        "messages_one": {"server": {"in_msgs": 20.0, "out_msgs": 17.0}},
        "messages_two": {"server": {"in_msgs": 22.0, "out_msgs": 19.0}},
        "long": {
            "first": window,
            "last": {**window, "from": 949, "to": 998, "period_ms": 22.0},
            "twin_first": window,
            "twin_last": {**window, "period_ms": 21.0},
        },
        "long_floor": {"first": window, "last": window, "twin_first": window, "twin_last": window},
        "wake_idle": {**wake, "deliveries": [1, 1]},
        "wake_parked": {**wake, "deliveries": [1, 1]},
        "wake_after_round": {**wake, "deliveries": [40, 1]},
        "before": {"rss": {"services": 80 * mib}, "store_disk": mib, "streams": {"KV_RUNS": 0}},
        "parked": {
            "rss": {"services": 100 * mib},
            "store_disk": 3 * mib,
            "streams": {"KV_RUNS": 1000, "TASKS": 0},
        },
        "idle_cpu_before": {"services": 0.001},
        "idle_cpu_parked": {"services": 0.5},
    }


def test_pooled_rounds_are_one_measure() -> None:
    a = {"rounds_steps_per_s": [100.0, 300.0], "cpu_ms_per_step": {"total": 4.0}}
    b = {"rounds_steps_per_s": [200.0], "cpu_ms_per_step": {"total": 6.0}}
    pooled = {"steps_per_s": 200.0, "rounds": 3, "cpu_ms_per_step": {"total": 5.0}}
    assert harness.pooled(a, b) == pooled


def test_the_table_puts_each_figure_beside_its_baseline() -> None:
    knobs = bs.Knobs(waiters=1000)
    table = {row.label: row for row in bs.rows({"one": one_server()}, knobs)}
    assert not any(label.startswith("cluster") for label in table)  # BENCH_CLUSTER=0
    two = table["thr steps/s: two engines / one (both times)"]  # one engine: its two turns
    assert (two.ours, two.floor) == (150.0, 200.0)
    two = table["thr CPU ms a step: two engines / one (both times)"]
    assert (two.ours, two.floor) == (6.0, 4.0)
    assert table["nats-server in_msgs an iteration: two engines / one"].ours == 22.0
    long = table["long: ms an iteration, 949-998 / 1-50"]
    assert (long.ours, long.floor) == (22.0, 20.0)
    long = table["long: 949-998 / a new run's 1-50 beside it"]
    assert (long.ours, long.floor) == (22.0, 21.0)
    rss = table["RSS MiB, services: 1000 waiting / none"]
    assert (rss.ours, rss.floor) == (100.0, 80.0)
    cpu = table["idle CPU % of a core, services: 1000 waiting / none"]
    assert cpu.ours == pytest.approx(50.0)
    bounced = table["wake after a round: the first's deliveries / most"]
    assert (bounced.ours, bounced.floor) == (40, 1)
    names = ("floor", "one_engine", "one_engine_again", "one_engines", "two_engines")
    cluster = {name: thr(100.0) for name in names}
    with_cluster = bs.rows({"one": one_server(), "cluster": cluster}, knobs)
    assert len(with_cluster) == len(table) + 7  # five throughputs, two CPU
    assert bs.per_waiter(one_server(), knobs) == {
        "rss services": round(20 * 1024 * 1024 / 1000),
        "store on disk": round(2 * 1024 * 1024 / 1000),
        "stream KV_RUNS": 1,
    }


def test_the_record_is_json_with_the_knobs() -> None:
    got = {"one": one_server()}
    rec = json.loads(json.dumps(bs.scale_record(got, bs.Knobs(), "abc1234", (1.0, 2.0, 3.0))))
    assert rec["knobs"]["waiters"] == 10_000 and rec["knobs"]["turn"]["c"] == 20
    assert rec["results"]["one"]["two_engines"]["steps_per_s"] == 150.0
