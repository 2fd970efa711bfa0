"""The state of record at a commit, read from the journal: the state chain.

A commit carries its state whole (a snapshot) or as a delta against the
state of the commit that ended the iteration before it (the record's
``base_seq``). The state at a commit is its last snapshot with the deltas
after it applied, in order (``dagnats.core.statechain.rebuild``): this reads
them, walking back along ``base_seq`` to the snapshot, one record each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from dagnats.core import errors, statechain
from dagnats.journal import convert
from dagnats.journal.store import JournalStore
from dagnats.journal.v1 import journal_pb2 as pb

# A state read with ReadState comes in chunks of this many bytes.
CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StateAt:
    """The state at a commit, and where it stands in its chain."""

    state: bytes
    chain: pb.StateChain


def chain_of(commit: pb.Commit) -> pb.StateChain:
    """Where ``commit``'s state stands in its chain (a commit with a state)."""
    if commit.HasField("state_delta"):
        d = commit.state_delta
        return pb.StateChain(size=d.size, depth=d.depth, chain_bytes=d.chain_bytes)
    return pb.StateChain(size=len(commit.state))


async def state_at(store: JournalStore, record: pb.Record) -> StateAt | None:
    """The state of the commit ``record``, rebuilt from its chain; None when
    it carried none.

    Raises:
        Conflict: the chain is broken (a delta's base is missing or carries no
            state, or a delta does not apply).
    """
    if not record.HasField("commit") or not record.commit.has_state:
        return None
    deltas: list[pb.Record] = []
    at = record
    while at.commit.HasField("state_delta"):
        deltas.append(at)
        base = await store.get(at.base_seq) if at.base_seq else None
        if base is None or not base.HasField("commit") or not base.commit.has_state:
            raise errors.Conflict(
                f"the state of commit {record.seq} cannot be rebuilt: the commit "
                f"{at.seq} is a delta on {at.base_seq}, which holds no state"
            )
        at = base
    result = statechain.rebuild(
        at.commit.state, [convert.stored_delta(r.commit) for r in reversed(deltas)]
    )
    match result:
        case statechain.Rebuilt(state=state):
            return StateAt(state, chain_of(record.commit))
        case statechain.ChainBroken():
            raise errors.Conflict(
                f"the state of commit {record.seq} cannot be rebuilt from the snapshot at "
                f"{at.seq}: {statechain.describe(result)}"
            )


def chunks(found: StateAt, commit_seq: int) -> Iterator[pb.ReadStateResponse]:
    """``found`` as ReadState's answers, one chunk each (one answer for an
    empty state)."""
    size = len(found.state)
    for start in range(0, max(size, 1), CHUNK_BYTES):
        yield pb.ReadStateResponse(
            chunk=found.state[start : start + CHUNK_BYTES],
            size=size,
            commit_seq=commit_seq,
            chain=found.chain,
            has_state=True,
        )
