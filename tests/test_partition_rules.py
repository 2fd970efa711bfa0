"""Partitions and slots, and the rule that shares partitions among replicas: pure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dagnats.core.errors import InvalidArgument
from dagnats.core.partitions import SLOTS, check_partitions, partition_of, slot_of, slots_of


def test_slot_is_stable_across_processes() -> None:
    ids = [f"run{i:029d}" for i in range(5)]
    here = [slot_of(i) for i in ids]
    code = f"from dagnats.core.partitions import slot_of; print([slot_of(i) for i in {ids!r}])"
    there = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout
    assert there.strip() == str(here)
    assert all(0 <= s < SLOTS for s in here)


def test_slots_spread_over_run_ids() -> None:
    seen = {slot_of(f"{i:032x}") for i in range(2000)}
    assert seen == set(range(SLOTS))


@pytest.mark.parametrize("partitions", [1, 2, 3, 6, 7, 64])
def test_every_slot_in_exactly_one_partition(partitions: int) -> None:
    covered = [s for k in range(partitions) for s in slots_of(k, partitions)]
    assert sorted(covered) == list(range(SLOTS))
    for k in range(partitions):
        assert all(s % partitions == k for s in slots_of(k, partitions))


def test_partition_of_is_the_slot_modulo_partitions() -> None:
    run = "0123456789abcdef0123456789abcdef"
    assert partition_of(run, 1) == 0
    assert partition_of(run, 6) == slot_of(run) % 6
    assert slot_of(run) in slots_of(partition_of(run, 6), 6)


@pytest.mark.parametrize("bad", [0, -1, 65, 1000, True, 2.0, "3"])
def test_bad_partition_counts_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_partitions(bad)  # type: ignore[arg-type]
    assert caught.value.field == "partitions"
    assert "from 1 to 64" in caught.value.message


def test_good_partition_counts_pass() -> None:
    assert [check_partitions(n) for n in (1, 6, 64)] == [1, 6, 64]


def test_partition_beyond_count_refused() -> None:
    with pytest.raises(InvalidArgument) as caught:
        slots_of(6, 6)
    assert caught.value.field == "partition"
