"""The paired bench's arithmetic and how it finds a checkout's code."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_pair import counts, paired, source_roots, table, turn_module

ROOT = Path(__file__).resolve().parent.parent


def test_each_component_of_a_checkout_is_a_source_root() -> None:
    roots = {p.relative_to(ROOT).as_posix() for p in source_roots(ROOT)}
    assert {"core", "cli", "sdk", "services/engine", "services/journal"} <= roots
    assert all((ROOT / r / "dagnats").is_dir() for r in roots)


def test_pairs_give_each_sides_median_and_the_median_ratio() -> None:
    base = [2.0, 4.0, 3.0, 10.0]
    this = [1.0, 4.4, 2.7, 5.0]
    row = paired("seq", base, this, lower=True)
    assert row.base == 3.5 and row.this == pytest.approx(3.55)
    assert row.ratio == pytest.approx((0.5 + 0.9) / 2)  # of 0.5, 1.1, 0.9, 0.5
    assert (row.better, row.pairs) == (3, 4)
    faster = paired("thr", base, this, lower=False)
    assert faster.better == 1
    assert "3.500" in table([row], "a", "b")


def test_a_bad_pair_count_stops_naming_it() -> None:
    assert counts({"BENCH_PAIRS_THR": "0"})["thr"] == 0
    with pytest.raises(SystemExit, match="BENCH_PAIRS_SEQ"):
        counts({"BENCH_PAIRS_SEQ": "x"})


def test_the_turn_bench_is_found_where_a_checkout_keeps_it(tmp_path: Path) -> None:
    assert turn_module(ROOT) == "bench.bench_turn"
    older = tmp_path / "older"
    (older / "tests").mkdir(parents=True)
    (older / "tests" / "bench_turn.py").write_text("")
    assert turn_module(older) == "tests.bench_turn"
    assert turn_module(tmp_path) is None
