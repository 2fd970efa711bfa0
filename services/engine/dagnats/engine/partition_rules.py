"""The rule that shares partitions among replicas: pure, no I/O, no clock.

Every replica reads the same bucket (``PARTITIONS``): the replicas present
(their presence keys, alive while renewed within the partition lease) and each
partition's owner (``owner.<k>``, with its revision). From that view,
:func:`decide` says what this replica does next, as a closed union of actions:
take a partition (compare-and-swap on the revision it saw), or give one up.

Shares: the present replicas sorted by id; with ``n`` of them and ``P``
partitions each owns ``P // n``, and the first ``P % n`` in that order one
more. A replica under its share takes free partitions (no owner, or an owner
that is not present: its lease expired or it released); one over its share
gives up its highest-numbered partitions. Nothing moves that need not: a
joining replica gets its share from those over theirs, the rest stay put.

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


def share_of(me: str, replicas: frozenset[str], partitions: int) -> int:
    """How many partitions ``me`` owns when ``replicas`` (with ``me``) are present."""
    ordered = sorted(replicas | {me})
    base, extra = divmod(partitions, len(ordered))
    return base + (1 if ordered.index(me) < extra else 0)


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
    """What this replica does next to reach its share; empty when it has it."""
    mine = sorted(owned(view))
    share = share_of(view.me, view.replicas, view.partitions)
    if len(mine) > share:
        return tuple(GiveUp(k, view.owner(k).revision) for k in mine[share:])
    wanted = share - len(mine)
    return tuple(Take(k, view.owner(k).revision) for k in free(view)[:wanted])
