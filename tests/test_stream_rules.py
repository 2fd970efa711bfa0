"""The live preview's rules and a watcher's queue, with no server: a watcher
started from the journal's tail drops another writer's chunks from the first
one on, a claim published late does not undo that, a dispatch handed over
with a commit is its next holder's, and a watcher that falls behind gets a
gap in place of the chunks it lost and keeps every marker."""

from __future__ import annotations

import json
from typing import Any

from dagnats.journal.stream import StreamRules, WatchQueue
from dagnats.journal.v1 import journal_pb2 as pb

ZOMBIE, HOLDER = "a" * 16, "b" * 16


def chunk(writer: str, seq: int, position: int = 0, iteration: int = 0) -> dict[str, Any]:
    head = {"run": "r1", "step": "agent", "iteration": iteration, "attempt": 1, "writer": writer}
    return head | {"position": position, "type": "token", "seq": seq, "text": f"t{seq}"}


def claim(writer: str, record_seq: int, iteration: int = 0) -> dict[str, Any]:
    head = {"run": "r1", "step": "agent", "iteration": iteration, "attempt": 2, "writer": writer}
    return head | {"position": -1, "type": "claim", "record_seq": record_seq}


def commit(writer: str, seq: int, iteration: int = 0) -> pb.Record:
    action = pb.Commit(action=pb.ACTION_CONTINUE)
    return pb.Record(writer=writer, seq=seq, iteration=iteration, attempt=1, commit=action)


def marker(kind: str, writer: str) -> dict[str, Any]:
    return chunk(writer, 0) | {"type": kind, "seq": None}


def test_a_watcher_started_at_the_tail_drops_other_writers_from_the_first_chunk() -> None:
    rules = StreamRules.after(pb.Record(writer=HOLDER, seq=7))
    assert rules.apply(chunk(ZOMBIE, 1)) == []
    assert [e.id for e in rules.apply(chunk(HOLDER, 1))] == [f"{HOLDER}.0.1"]
    assert [e.type for e in StreamRules.after(None).apply(chunk(ZOMBIE, 1))] == ["token"]


def test_a_claim_published_late_does_not_undo_the_tail() -> None:
    rules = StreamRules.after(pb.Record(writer=HOLDER, seq=7))
    assert rules.apply(claim(ZOMBIE, 5)) == []  # the zombie's own, older claim
    assert rules.apply(chunk(ZOMBIE, 1)) == []
    rules.apply(chunk(HOLDER, 1))
    # A claim after the tail is news: the holder's open stream is abandoned.
    assert [(e.type, e.data["reason"]) for e in rules.apply(claim(ZOMBIE, 9))] == [
        ("abandoned", "superseded")
    ]
    assert [e.type for e in rules.apply(chunk(ZOMBIE, 1, position=1))] == ["token"]


NEXT = "c" * 16


def test_a_hand_over_at_the_commit_names_the_next_holder() -> None:
    # Watching since iteration 0's claim: its commit (seq 9) hands iteration 1
    # over, and the hand-over's marker is fenced on that commit.
    rules = StreamRules.after(pb.Record(writer=HOLDER, seq=7))
    assert [e.type for e in rules.apply(chunk(HOLDER, 1))] == ["token"]
    assert [e.type for e in rules.apply(marker("committed", HOLDER))] == ["committed"]
    assert rules.apply(claim(NEXT, 9, iteration=1)) == []  # nothing open to abandon
    assert [e.data["writer"] for e in rules.apply(chunk(NEXT, 1, iteration=1))] == [NEXT]
    assert rules.apply(chunk(HOLDER, 2)) == [], "the committed holder's chunk"


def test_a_watcher_started_at_a_commit_shows_the_next_dispatch_until_a_claim() -> None:
    rules = StreamRules.after(commit(HOLDER, 9))
    assert rules.apply(chunk(HOLDER, 1)) == [], "a chunk of the committed dispatch"
    assert rules.apply(chunk(ZOMBIE, 1)) == [], "a chunk of an earlier holder of it"
    assert [e.data["writer"] for e in rules.apply(chunk(NEXT, 1, iteration=1))] == [NEXT]
    # The hand-over's own marker, at the commit's sequence, names the holder:
    # any other writer of the next dispatch is then a fenced one's.
    rules.apply(claim(NEXT, 9, iteration=1))
    assert rules.apply(chunk(ZOMBIE, 1, position=1, iteration=1)) == []
    # A redelivery's claim after the commit supersedes the handed holder.
    assert [e.type for e in rules.apply(claim(ZOMBIE, 10, iteration=1))] == ["abandoned"]
    assert [e.data["writer"] for e in rules.apply(chunk(ZOMBIE, 2, iteration=1))] == [ZOMBIE]


def put(queue: WatchQueue, event: dict[str, Any]) -> None:
    queue.put(json.dumps(event).encode())


async def drain(queue: WatchQueue, count: int) -> list[dict[str, Any]]:
    return [await queue.get() for _ in range(count)]


async def test_a_full_queue_drops_chunks_into_a_gap_and_keeps_every_marker() -> None:
    queue = WatchQueue(limit=2)
    for seq in range(1, 6):
        put(queue, chunk(HOLDER, seq))
    put(queue, marker("abandoned", ZOMBIE))
    put(queue, chunk(HOLDER, 6))
    put(queue, marker("committed", HOLDER))
    got = await drain(queue, 6)
    assert [(e["type"], e.get("first_seq"), e.get("last_seq")) for e in got] == [
        ("token", None, None),
        ("token", None, None),
        ("gap", 3, 5),
        ("abandoned", None, None),
        ("gap", 6, 6),  # after the marker it followed
        ("committed", None, None),
    ]
    assert [e["seq"] for e in got[:2]] == [1, 2]
    assert [e["dropped"] for e in (got[2], got[4])] == [3, 1]
    assert got[2]["stream"] == f"{HOLDER}.0"
    # Room again: chunks queue as before, and a new drop gets a gap of its own.
    for seq in range(7, 10):
        put(queue, chunk(HOLDER, seq))
    got = await drain(queue, 3)
    assert [(e["type"], e.get("seq"), e.get("first_seq")) for e in got] == [
        ("token", 7, None),
        ("token", 8, None),
        ("gap", None, 9),
    ]


async def test_a_gap_the_rules_see_is_shown_with_the_id_of_its_last_chunk() -> None:
    queue = WatchQueue(limit=1)
    for seq in (1, 2, 3):
        put(queue, chunk(HOLDER, seq))
    rules = StreamRules.after(pb.Record(writer=HOLDER, seq=7))
    shown = [e for event in await drain(queue, 2) for e in rules.apply(event)]
    assert [(e.type, e.id) for e in shown] == [("token", f"{HOLDER}.0.1"), ("gap", f"{HOLDER}.0.3")]
    assert "event: gap\n" in shown[1].sse()
    fenced = WatchQueue(limit=0)
    put(fenced, chunk(ZOMBIE, 1))
    assert rules.apply(await fenced.get()) == [], "a fenced holder's gap is not current"
