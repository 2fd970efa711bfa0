"""Partitions and slots, and the rule that shares partitions among replicas: pure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dagnats.core.errors import InvalidArgument
from dagnats.core.partitions import SLOTS, check_partitions, partition_of, slot_of, slots_of
from dagnats.engine.partition_rules import (
    GiveUp,
    Owner,
    Take,
    View,
    decide,
    owned,
    release,
)


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


# ---- the rule that shares partitions among replicas -------------------------------


def view(me: str, replicas: set[str], owners: dict[int, str | None], partitions: int = 6) -> View:
    return View(
        me=me,
        partitions=partitions,
        replicas=frozenset(replicas),
        owners={k: Owner(replica=r, revision=10 + k) for k, r in owners.items()},
    )


def settle(replicas: list[str], partitions: int, owners: dict[int, str | None]) -> dict[int, str]:
    """Apply every replica's decisions, one replica at a time, until none acts."""
    owners = dict(owners)
    for _ in range(4 * partitions):
        acted = False
        for me in replicas:
            for action in decide(view(me, set(replicas), owners, partitions)):
                acted = True
                match action:
                    case Take(k, _):
                        owners[k] = me
                    case GiveUp(k, _):
                        owners[k] = None
        if not acted:
            return {k: r for k, r in owners.items() if r is not None}
    raise AssertionError(f"no agreement: {owners}")


def test_shares_add_up_and_differ_by_one_at_most() -> None:
    for partitions in (1, 5, 6, 7, 64):
        for n in (1, 2, 3, 4):
            ids = [f"r{i}" for i in range(n)]
            final = settle(ids, partitions, {})
            assert sorted(final) == list(range(partitions))
            shares = [list(final.values()).count(r) for r in ids]
            assert max(shares) - min(shares) <= 1


def test_replicas_joining_one_at_a_time_reach_even_shares() -> None:
    for partitions in (1, 2, 4, 6, 7, 12):
        owners: dict[int, str | None] = {}
        ids: list[str] = []
        for joining in ("d", "b", "c", "a"):  # ids not in order of arrival
            ids.append(joining)
            owners = dict(settle(ids, partitions, owners))
            shares = [list(owners.values()).count(r) for r in ids]
            assert sum(shares) == partitions and max(shares) - min(shares) <= 1


def test_a_newcomer_takes_nothing_from_owners_when_there_are_fewer_partitions() -> None:
    # One partition, owned by b: a joins and sorts first, yet nothing moves.
    owners: dict[int, str | None] = {0: "b"}
    assert decide(view("a", {"a", "b"}, owners, 1)) == ()
    assert decide(view("b", {"a", "b"}, owners, 1)) == ()
    # Four partitions over three: 2/2 stays put but for the one c needs.
    owners = {0: "a", 1: "a", 2: "b", 3: "b"}
    final = settle(["a", "b", "c"], 4, owners)
    assert sorted(list(final.values()).count(r) for r in "abc") == [1, 1, 2]
    assert sum(final[k] != owners[k] for k in range(4)) == 1  # one move only


def test_a_lone_replica_takes_every_partition_at_the_revision_it_saw() -> None:
    actions = decide(view("a", {"a"}, {0: None}))
    assert sorted(actions, key=lambda a: a.partition) == [
        Take(0, 10),
        *[Take(k, 0) for k in range(1, 6)],
    ]


def test_three_replicas_split_six_two_each() -> None:
    final = settle(["a", "b", "c"], 6, {})
    assert sorted(final) == list(range(6))
    assert sorted(list(final.values()).count(r) for r in "abc") == [2, 2, 2]


def test_an_expired_replicas_partitions_are_taken() -> None:
    # c's presence key expired: its two partitions go to a and b, the rest stay.
    owners: dict[int, str | None] = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    assert decide(view("a", {"a", "b"}, owners)) == (Take(4, 14),)
    final = settle(["a", "b"], 6, owners)
    assert {k: final[k] for k in range(4)} == {0: "a", 1: "a", 2: "b", 3: "b"}
    assert sorted(final.values()) == ["a", "a", "a", "b", "b", "b"]


def test_a_joining_replica_gets_its_share_from_those_over_theirs() -> None:
    owners: dict[int, str | None] = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    assert decide(view("a", {"a", "b", "c"}, owners)) == (GiveUp(2, 12),)
    assert decide(view("c", {"a", "b", "c"}, owners)) == ()  # nothing free yet
    final = settle(["a", "b", "c"], 6, owners)
    assert sorted(list(final.values()).count(r) for r in "abc") == [2, 2, 2]
    assert final[0] == final[1] == "a" and final[3] == final[4] == "b"  # no needless moves


def test_owned_is_what_the_owner_keys_name() -> None:
    v = view("b", {"a", "b"}, {0: "a", 1: "b", 2: None, 3: "b"})
    assert owned(v) == frozenset({1, 3})


def test_a_stopping_replica_gives_up_only_the_keys_that_name_it() -> None:
    # Partition 1 was taken by c since b last published what it owns, and
    # partition 4's key is not seen yet (b's watch of the bucket started over):
    # b gives up 3 and 5 at the revisions it saw, deletes none of c's, and
    # leaves 4 to its lease.
    v = view("b", {"a", "b", "c"}, {0: "a", 1: "c", 2: None, 3: "b", 5: "b"})
    assert release(v) == (GiveUp(3, 13), GiveUp(5, 15))
    assert release(view("b", {"b"}, {})) == ()


def test_a_replica_at_its_share_does_nothing() -> None:
    owners: dict[int, str | None] = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    assert decide(view("a", {"a", "b"}, owners)) == ()
