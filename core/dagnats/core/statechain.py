"""The state chain: a step's state of record stored as what each turn adds.

A commit that ends an iteration carries the state (JSON bytes) in one of two
forms: a *snapshot* (the whole state, ``Commit.state``) or a *delta* against
the state of the commit before it (``Commit.state_delta``): the first
``keep`` bytes of that state, then ``tail``. A conversation that appends a
message keeps everything but its closing bytes, so a turn stores what it
added, not the history again. Every ``snapshot_every`` deltas, or once the
deltas since the last snapshot add up to ``snapshot_bytes``, the next commit
stores a snapshot instead, while the state fits one record; past that the
chain goes on in deltas (their bytes add up to about the state's, so a claim
reads about as much as a snapshot). A claim rebuilds the state from one
snapshot and the deltas after it; a worker that keeps its task holds the state
in memory and reads nothing.

Pure: the rules below decide and rebuild, and no I/O happens here. Both the
SDK (which writes commits) and the journal service (which rebuilds the state
for a claim and audits the chain) use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

# What a commit's state may grow to, by default: past it the commit is refused
# with the state's size, the same on every delivery.
STATE_MAX_BYTES = 256 * 1024 * 1024
# A snapshot every this many deltas, or once the deltas since the last one add
# up to this many bytes, whichever comes first.
SNAPSHOT_EVERY = 64
SNAPSHOT_BYTES = 1024 * 1024
# Bytes a delta's tail is compared by when the state is diffed: the common
# prefix is found a block at a time, in C, then byte by byte in one block.
_BLOCK = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainSettings:
    """When a commit stores a snapshot, and how large a state may grow."""

    snapshot_every: int = SNAPSHOT_EVERY
    snapshot_bytes: int = SNAPSHOT_BYTES
    state_max_bytes: int = STATE_MAX_BYTES
    # The largest snapshot a commit carries: a state larger goes on in deltas.
    snapshot_max_bytes: int = 2 * 1024 * 1024 - 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """Where the state of the last commit stands in its chain: its size, and
    the deltas (and their tails' bytes) stored since its snapshot."""

    size: int
    depth: int = 0
    delta_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """A state as a change of the state before: its first ``keep`` bytes,
    then ``tail``."""

    keep: int
    tail: bytes

    @property
    def size(self) -> int:
        return self.keep + len(self.tail)


# The decision of what a commit stores (plan_state).


@dataclass(frozen=True, slots=True)
class WriteSnapshot:
    """Store the whole state; the chain starts again from it."""

    chain: Chain


@dataclass(frozen=True, slots=True)
class WriteDelta:
    """Store ``delta`` against the previous commit's state."""

    delta: Delta
    chain: Chain


@dataclass(frozen=True, slots=True)
class StateOverLimit:
    """The state is past the size setting: refused, the same on every delivery."""

    size: int
    limit: int

    def message(self) -> str:
        return f"the state is {self.size:,} bytes; the state is at most {self.limit:,} bytes"


StatePlan = WriteSnapshot | WriteDelta | StateOverLimit


def plan_state(previous: Chain | None, delta: Delta, settings: ChainSettings) -> StatePlan:
    """What the commit of a state stores: ``delta`` is the state against the
    previous commit's (whose place in the chain is ``previous``; None when
    no commit before it carried a state, and then ``delta.keep`` is 0)."""
    size = delta.size
    if size > settings.state_max_bytes:
        return StateOverLimit(size, settings.state_max_bytes)
    if previous is None:
        return WriteSnapshot(Chain(size=size))
    depth = previous.depth + 1
    added = previous.delta_bytes + len(delta.tail)
    due = depth >= settings.snapshot_every or added >= settings.snapshot_bytes
    if due and size <= settings.snapshot_max_bytes:
        return WriteSnapshot(Chain(size=size))
    if size <= len(delta.tail) and size <= settings.snapshot_max_bytes:
        return WriteSnapshot(Chain(size=size))  # nothing kept: the delta is the state
    return WriteDelta(delta, Chain(size=size, depth=depth, delta_bytes=added))


def diff(previous: bytes, state: bytes) -> Delta:
    """``state`` as a delta against ``previous``: their common prefix kept, the
    rest of ``state`` as the tail."""
    n = min(len(previous), len(state))
    keep = 0
    while keep < n:
        end = min(keep + _BLOCK, n)
        if previous[keep:end] == state[keep:end]:
            keep = end
            continue
        while previous[keep] == state[keep]:
            keep += 1
        break
    return Delta(keep=keep, tail=state[keep:])


# Rebuilding a state from its chain (rebuild, check_chain).


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """The chain applied: the state."""

    state: bytes


@dataclass(frozen=True, slots=True)
class ChainBroken:
    """A delta does not apply to the state before it: ``index`` is the
    delta's place after the snapshot (0 the first), and ``reason`` why."""

    index: int
    reason: str


RebuildResult = Rebuilt | ChainBroken


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredDelta:
    """A delta as its commit stored it: the change, and the size and depth the
    commit says it makes."""

    delta: Delta
    size: int
    depth: int


def rebuild(snapshot: bytes, deltas: Sequence[StoredDelta]) -> RebuildResult:
    """The state ``snapshot`` and then ``deltas``, in order, make: each must
    keep no more than the state before it holds, make the size its commit
    says, and stand one further from the snapshot than the one before."""
    state = bytearray(snapshot)  # each delta cuts and extends it in place
    for index, stored in enumerate(deltas):
        delta = stored.delta
        if delta.keep > len(state):
            reason = f"keeps {delta.keep:,} bytes of a state of {len(state):,}"
            return ChainBroken(index, reason)
        if delta.size != stored.size:
            reason = f"makes {delta.size:,} bytes, its commit says {stored.size:,}"
            return ChainBroken(index, reason)
        if stored.depth != index + 1:
            return ChainBroken(index, f"says it is delta {stored.depth}, it is delta {index + 1}")
        del state[delta.keep :]
        state += delta.tail
    return Rebuilt(bytes(state))


def describe(result: RebuildResult) -> str:
    """One line for a rebuild's outcome."""
    match result:
        case Rebuilt(state=state):
            return f"a state of {len(state):,} bytes"
        case ChainBroken(index=index, reason=reason):
            return f"delta {index + 1} after the snapshot does not apply: it {reason}"
        case _:
            assert_never(result)
