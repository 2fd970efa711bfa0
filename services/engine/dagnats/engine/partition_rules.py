"""The rule that shares partitions among replicas: pure, no I/O, no clock.

Every replica sees the same things: the replicas present (heard beating
within the partition lease) and, in the bucket ``PARTITIONS``, each
partition's owner (``owner.<k>``, with its revision). From that view,
:func:`decide` says what this replica does next, as a closed union of actions:
take a partition (compare-and-swap on the revision it saw), or give one up.

Shares: with ``n`` replicas present and ``P`` partitions, each owns
``P // n`` (the floor) or one more (the ceiling), as many at the ceiling as
``P % n``. Which ones own the ceiling is whichever already do: nothing moves
that need not, so a replica joining a deployment with fewer partitions than
replicas takes none from the owners, and one joining a deployment that can
share takes only what brings everyone to the floor. A replica takes free
partitions (no owner, or an owner that is not present: its lease expired or
it released) up to the floor, and up to the ceiling once no replica present
is below the floor; one over the ceiling gives up its highest-numbered
partitions; when the replicas below the floor need more than is free, the
replica owning the most (the first by id among equals) gives up one. A
replica that stops gives up what its view says it owns (:func:`release`).

Ownership is advisory (for speed only): two replicas that briefly both
consume a partition are safe, so the rule needs no order between one giving
up and another taking, and views that briefly differ only delay agreement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Owner:
    """What ``owner.<k>`` holds: the owning replica (None when nobody owns the
    partition: never owned, given up, or released) and the key's revision
    (0 when the key was never written), which a take must match."""

    replica: str | None
    revision: int


NO_OWNER = Owner(replica=None, revision=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class View:
    """The bucket as this replica last saw it."""

    me: str
    partitions: int
    replicas: frozenset[str]
    owners: Mapping[int, Owner] = field(default_factory=dict)

    def owner(self, partition: int) -> Owner:
        return self.owners.get(partition, NO_OWNER)


@dataclass(frozen=True, slots=True)
class Take:
    """Become ``partition``'s owner, if its key is still at ``revision``."""

    partition: int
    revision: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Stop owning ``partition``, if its key is still at ``revision``."""

    partition: int
    revision: int


Action = Take | GiveUp


def bounds(view: View) -> tuple[int, int]:
    """The floor and the ceiling of a present replica's share."""
    present = len(view.replicas | {view.me})
    floor, extra = divmod(view.partitions, present)
    return floor, floor + (1 if extra else 0)


def counts(view: View) -> dict[str, int]:
    """How many partitions each present replica owns."""
    present = view.replicas | {view.me}
    owning = {r: 0 for r in present}
    for k in range(view.partitions):
        replica = view.owner(k).replica
        if replica in owning:
            owning[replica] += 1
    return owning


def owned(view: View) -> frozenset[int]:
    """The partitions whose owner key names this replica."""
    return frozenset(k for k in range(view.partitions) if view.owner(k).replica == view.me)


def free(view: View) -> list[int]:
    """The partitions nobody present owns, in the order this replica tries
    them: starting at its own place among the replicas, so that replicas
    taking at once mostly try different keys."""
    present = view.replicas | {view.me}
    loose = [
        k
        for k in range(view.partitions)
        if view.owner(k).replica not in present  # no owner, or one not present
    ]
    if not loose:
        return loose
    start = sorted(present).index(view.me) * (view.partitions // len(present))
    return sorted(loose, key=lambda k: (k - start) % view.partitions)


def decide(view: View) -> tuple[Action, ...]:
    """What this replica does next towards an even share; empty when nothing
    needs to move."""
    mine = sorted(owned(view))
    floor, ceiling = bounds(view)
    if len(mine) > ceiling:
        return tuple(GiveUp(k, view.owner(k).revision) for k in mine[ceiling:])
    owning = counts(view)
    loose = free(view)
    short = sum(max(0, floor - n) for n in owning.values())
    if short > len(loose):
        # Some replica is below the floor and nothing free will bring it up:
        # the one owning the most gives one up, one at a time.
        donor = min((r for r in owning if owning[r] > floor), key=lambda r: (-owning[r], r))
        return (GiveUp(mine[-1], view.owner(mine[-1]).revision),) if donor == view.me else ()
    wanted = floor - len(mine) if short else ceiling - len(mine)
    return tuple(Take(k, view.owner(k).revision) for k in loose[: max(wanted, 0)])


def release(view: View) -> tuple[GiveUp, ...]:
    """What a stopping replica gives up: each partition whose owner key names
    it in ``view``, at the revision seen. A partition it consumes but whose
    key it has not seen since its watch started over, or which another has
    taken since, is not given up: its key is left to the lease, as after a
    kill, and another's claim is never deleted."""
    return tuple(GiveUp(k, view.owner(k).revision) for k in sorted(owned(view)))
