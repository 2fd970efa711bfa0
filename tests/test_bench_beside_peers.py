"""``make bench-peers``' script refuses what it cannot run before it starts
anything: a folder that is not the peer benchmarks, bad knobs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "beside_peers.sh"
PEER_FILES = ("run_all.sh", "bench_restate.py", "bench_nats.py", "bench_dbos.py", "summarize.py")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=30,
    )


def test_a_missing_folder_is_refused_with_the_usage(tmp_path: Path) -> None:
    done = run(str(tmp_path / "nope"))
    assert done.returncode == 2
    assert "usage: beside_peers.sh <the peer benchmarks' folder>" in done.stderr


def test_a_folder_that_is_not_the_peer_benchmarks_is_refused(tmp_path: Path) -> None:
    done = run(str(tmp_path))
    assert done.returncode == 2
    assert f"{tmp_path} has no run_all.sh: not the peer benchmarks" in done.stderr


@pytest.mark.parametrize(
    ("knob", "value", "said"),
    [
        ("PASSES", "0", "PASSES must be a whole number from 1, got '0'"),
        ("PASSES", "two", "PASSES must be a whole number from 1, got 'two'"),
        ("SETTLE_MAX", "-1", "SETTLE_MAX must be whole seconds, got '-1'"),
        ("SETTLE_LOAD", "low", "SETTLE_LOAD must be a load such as 0.6, got 'low'"),
    ],
)
def test_a_bad_knob_is_named_and_nothing_is_written(
    tmp_path: Path, knob: str, value: str, said: str
) -> None:
    peers = tmp_path / "peers"
    peers.mkdir()
    for name in PEER_FILES:
        (peers / name).write_text("exit 99\n")  # never run: the knob is refused first
    out = tmp_path / "out"
    done = run(str(peers), env={knob: value, "BENCH_OUT": str(out)})
    assert done.returncode == 2
    assert said in done.stderr
    assert not out.exists()


def test_every_deployment_of_the_turn_bench_is_a_row() -> None:
    from bench.bench_turn import DEPLOYMENTS

    line = next(x for x in SCRIPT.read_text().splitlines() if x.startswith("systems=("))
    systems = line.removeprefix("systems=(").removesuffix(")").split()
    assert {s.removeprefix("dagnats-") for s in systems if s.startswith("dagnats-")} == set(
        DEPLOYMENTS
    )
    assert {"restate", "nats-always", "dbos-sqlite"} <= set(systems)
