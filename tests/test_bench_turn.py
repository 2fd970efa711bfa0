"""The pure parts of ``bench/bench_turn.py``: its knobs, its summaries in the
peers' format, the strace table it reads and the side-by-side table it
prints. No server and no timing: the bench itself is run by ``make bench``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_turn as bt

STRACE_OUTPUT = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 99.10    0.512345         226      2260           fsync
  0.90    0.004000          40       100         3 fdatasync
------ ----------- ----------- --------- --------- ----------------
100.00    0.516345         218      2360         3 total
"""


def test_strace_summary_counts_calls_by_syscall() -> None:
    counts = bt.parse_strace_summary(STRACE_OUTPUT)
    assert counts == {"fsync": 2260, "fdatasync": 100}
    assert bt.sync_calls({**counts, "write": 7}) == 2360


def test_strace_summary_of_no_calls_is_empty() -> None:
    header = STRACE_OUTPUT.splitlines()[:2]
    assert bt.parse_strace_summary("\n".join(header)) == {}


def test_summaries_are_the_peers_nearest_rank() -> None:
    xs = [float(x) for x in range(1, 21)]  # 1..20
    s = bt.summarize(xs)
    assert (s["n"], s["median"], s["p90"], s["min"], s["max"]) == (20, 10.5, 18.0, 1.0, 20.0)
    seq = bt.seq_result([1.0, 2.0, 3.0], k=50)  # seconds per run of 50 iterations
    assert seq["per_iter_ms"]["median"] == 40.0
    assert seq["per_step_ms"]["median"] == 20.0
    thr = bt.thr_result([2.0, 4.0], c=20, k=50)
    assert thr["steps_per_round"] == 2000
    assert thr["steps_per_s"]["median"] == 750.0


def test_cpu_per_step_per_process_and_total() -> None:
    before, after = {"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 4.0}
    assert bt.cpu_per_step(before, after, steps=1000) == {"a": 0.5, "b": 2.0, "total": 2.5}


def test_stream_appends_per_iteration() -> None:
    jsz = {
        "account_details": [
            {
                "stream_detail": [
                    {"name": "TASKS", "state": {"last_seq": 150}},
                    {"name": "KV_RUNS", "state": {"last_seq": 90}},
                ]
            }
        ]
    }
    after = bt.stream_seqs(jsz)
    assert after == {"TASKS": 150, "KV_RUNS": 90}
    before = {"TASKS": 100, "KV_RUNS": 90}
    assert bt.per_iteration(before, {**after, "NEW": 25}, 50) == {"NEW": 0.5, "TASKS": 1.0}


def test_knobs_from_the_environment() -> None:
    p = bt.Params.from_env({"BENCH_K": "5", "BENCH_RUNS": "3", "BENCH_STRACE": "0"})
    assert (p.k, p.runs, p.c, p.strace) == (5, 3, 20, False)
    assert p.peers()["K"] == 5
    with pytest.raises(SystemExit, match="BENCH_K must be a whole number"):
        bt.Params.from_env({"BENCH_K": "fifty"})
    with pytest.raises(SystemExit, match="BENCH_RUNS must be at least 2"):
        bt.Params.from_env({"BENCH_RUNS": "1"})


def test_the_table_puts_dagnats_beside_the_floor() -> None:
    p = bt.Params(k=2, c=1, runs=2, thr_rounds=1, start_runs=2)
    ours = bt.Measured(seq=[0.02, 0.02], thr=[0.01], start=[0.01, 0.01], cpu={"total": 3.0})
    floor = bt.Measured(seq=[0.004, 0.004], thr=[0.002], start=[0.002, 0.002], cpu={"total": 0.5})
    rec = bt.record("dagnats", "dev", bt.results_of(ours, p), p, {})
    base = bt.record("nats-raw", "floor", bt.results_of(floor, p), p, {})
    assert rec["params"] == {
        "K": 2,
        "C": 1,
        "seq_runs": 2,
        "warmup": 3,
        "start_runs": 2,
        "thr_rounds": 1,
    }
    table = {row.label: row for row in bt.rows(rec, base)}
    step = table["seq: ms per journaled step, median"]
    assert (step.ours, step.floor) == (5.0, 1.0)
    text = bt.format_table(list(table.values()))
    assert "5.00x" in text  # 5 ms against 1 ms a step
    assert "0.20x" in text  # steps/s: 400 against 2000
    assert "n/a" in text  # no strace in either record


RAW_PROFILE = """\
<module> (cli/main.py);run (asyncio/runners.py);publish (nats/aio/client.py) 30
<module> (cli/main.py);run (asyncio/runners.py);append (journal/writer.py) 10
<module> (cli/main.py);apply (dagnats/engine/processor.py);dumps (json/__init__.py) 10
thread_run (libpython3.11.so.1.0);epoll_wait (libc.so.6) 500
"""


def test_profiles_count_own_and_stack_samples_and_leave_waits_out() -> None:
    stacks = bt.parse_raw_profile(RAW_PROFILE)
    total, own, anywhere = bt.top_functions(stacks, 2)
    assert total == 50
    assert own == [("publish (nats/aio/client.py)", 30), ("append (journal/writer.py)", 10)]
    assert anywhere[0] == ("<module> (cli/main.py)", 50)
    assert dict(bt.by_package(stacks)) == {"nats": 30, "dagnats.journal": 10, "json": 10}


def test_the_split_deployment_is_a_knob_and_a_variant_of_its_own() -> None:
    p = bt.Params.from_env({"BENCH_DEPLOY": "split"})
    assert (p.deploy, p.variant) == ("split", "split-services")
    assert len(set(bt.VARIANTS.values())) == len(bt.DEPLOYMENTS)
    with pytest.raises(SystemExit, match="worker, grpc, services, split"):
        bt.Params.from_env({"BENCH_DEPLOY": "compose"})


def test_the_routes_are_read_from_the_services_metrics_page() -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from prometheus_client import CollectorRegistry, generate_latest

    from dagnats.engine.metrics import ServicesCollector

    engine = SimpleNamespace(counters={"kept_unwritten": 12, "direct_applied": 20})
    sockets = SimpleNamespace(accepted=3, polled=40, watched=2, connections=[object()])
    server = SimpleNamespace(engine=engine, journal=None, local_socket=sockets)
    registry = CollectorRegistry()
    registry.register(ServicesCollector(cast(Any, server)))
    page = generate_latest(registry).decode()
    # The counters, the engine's by their event; not the gauge of open connections.
    assert bt.parse_metrics(page) == {
        "kept_unwritten": 12.0,
        "direct_applied": 20.0,
        "dagnats_local_socket_connections": 3.0,
        "dagnats_local_socket_polls": 40.0,
        "dagnats_local_socket_watches": 2.0,
    }
    before = bt.parse_metrics(page)
    engine.counters["kept_unwritten"] = 22
    after = bt.parse_metrics(generate_latest(registry).decode())
    assert bt.per_iteration(before, after, 20) == {"kept_unwritten": 0.5}
    assert bt.per_iteration(before, {**after, "guess_missed": 1}, 300, 3) == {
        "guess_missed": 0.003,
        "kept_unwritten": 0.033,
    }


def test_each_phase_reports_its_routes_per_iteration() -> None:
    p = bt.Params(k=10, c=4, runs=5, warmup=1, thr_rounds=2, start_runs=7)
    assert bt.phase_iterations(p, "seq") == 60  # warm-up included
    assert bt.phase_iterations(p, "thr") == 120  # the warm-up round included
    assert bt.phase_iterations(p, "start") == 10
    rec = {
        "routes_per_iteration": {"seq": {"kept_unwritten": 0.9}, "start": {}},
        "strace": {
            "routes_per_iteration": {"guess_missed": 0.5},
            "concurrent": {"routes_per_iteration": {"direct_applied": 1.0}},
        },
    }
    text = bt.format_routes(rec)
    assert "seq                 kept_unwritten 0.9" in text
    assert "start               none counted" in text
    assert "fsyncs, sequential  guess_missed 0.5" in text
    assert "fsyncs, C at once   direct_applied 1" in text


def test_a_still_store_neither_stores_nor_removes() -> None:
    def jsz(last_seq: int, messages: int) -> dict[str, object]:
        state = {"last_seq": last_seq, "messages": messages}
        return {"account_details": [{"stream_detail": [{"name": "TASKS", "state": state}]}]}

    assert bt.stream_states(jsz(10, 3)) == {"TASKS": (10, 3)}
    # A work queue's acknowledgement removes a message and stores none.
    assert bt.stream_states(jsz(10, 2)) != bt.stream_states(jsz(10, 3))


STRACE_CALLS = """\
7051  fsync(21</tmp/d/nats/jetstream/$G/streams/SLEEP_TIMERS/obs/engine-timers/o.dat>) = 0
7023  fsync(22</tmp/d/nats/jetstream/$G/streams/HISTORY/obs/engine/o.dat>) = 0
7023  fsync(19</tmp/d/nats/jetstream/$G/streams/KV_ACTIVE_RUNS/msgs/1.blk>) = 0
7051  fdatasync(19</tmp/d/nats/jetstream/$G/streams/KV_ACTIVE_RUNS/msgs/1.blk>) = 0
7052  --- SIGURG {si_signo=SIGURG, si_code=SI_TKILL, si_pid=7023, si_uid=0} ---
"""


def test_idle_fsyncs_are_told_by_the_file_they_sync() -> None:
    calls, files = bt.parse_strace_calls(STRACE_CALLS)
    assert calls == {"fsync": 3, "fdatasync": 1}
    assert files == {
        "SLEEP_TIMERS/obs/engine-timers": 1,
        "HISTORY/obs/engine": 1,
        "KV_ACTIVE_RUNS/msgs": 2,
    }


async def test_the_split_deployment_runs_the_workload_with_each_event_sent_to_an_engine(
    tmp_path: Path,
) -> None:
    """The bench's split stack, for real: three ``dagnats serve`` processes
    on a nats-server of its own, the worker on gRPC to them; each commit's
    event reaches the engine over core NATS, never by a call in a process."""
    from dagnats.sdk import Client
    from tests.stack import loop_workflow

    p = bt.Params(k=3, c=1, deploy="split")
    stack = await bt.start_split(tmp_path, p)
    try:
        assert set(stack.processes()) == {"engine", "journal", "inputs", "worker"}
        assert set(stack.metrics) == {"engine", "journal"}
        async with Client(stack.engine) as client:
            await client.register_workflow(loop_workflow(bt.TASK, bt.TASK, max_iterations=10))
            before = stack.routes()
            assert await client.run(bt.TASK, {"k": 3}, timeout=60) == bt.tool_output({"n": 2})
            routes = bt.per_iteration(before, stack.routes(), 3)
        assert routes.get("direct_applied") == 1.0, routes
        assert "local_applied" not in routes
        assert all(proc.poll() is None for proc in stack.processes().values())
    finally:
        bt.stop_stack(stack)
        await stack.nats.stop()
