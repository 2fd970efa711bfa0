"""The step's state of record as a worker holds it (the state chain).

The held state is the whole state's JSON bytes, kept in the worker's memory
from the claim (or the hand-over) through every iteration the worker keeps
(the kept task), and the watermark: how many of its first bytes are still
those of the state the last commit stored. A commit stores the bytes past the
watermark as a delta against that state, or the whole state as a snapshot
(``dagnats.core.statechain.plan_state``). ``append`` adds items to a list of
the state (a JSON object) and sets its other fields without encoding, or
diffing, what was there: it writes the bytes after the list's end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dagnats.core import statechain
from dagnats.core.errors import InvalidArgument, StateTooLarge
from dagnats.core.payload import decode, encode
from dagnats.journal.v1 import journal_pb2 as jpb

_UNREAD: Any = object()


class HeldState:
    """A step's state in a worker's memory; ``chain`` is where the state the
    last commit stored stands in its chain (None: no commit stored one)."""

    def __init__(self, data: bytes | None, chain: statechain.Chain | None) -> None:
        self.present = data is not None
        self.data = bytearray(data or b"")
        self.chain = chain
        # The sequence of the commit that stored the state, once known.
        self.seq = 0
        self.kept = len(self.data)
        self._value: Any = _UNREAD
        # With the append form: the list's key and the offset of its closing "]".
        self._list: tuple[str, int] | None = None

    def value(self) -> Any:
        """The state, decoded; the one decoded value while only ``append``
        changes it, decoded again after ``replace``."""
        if not self.present:
            return None
        if self._value is _UNREAD:
            value = decode(bytes(self.data), field="state")
            if self._list is not None:
                self._value = value
            return value
        return self._value

    def replace(self, data: bytes) -> None:
        """The whole state is ``data`` now."""
        keep = statechain.diff(bytes(self.data[: self.kept]), data).keep if self.present else 0
        self.kept = min(self.kept, keep)
        self.data = bytearray(data)
        self.present = True
        self._value = _UNREAD
        self._list = None

    def append(self, key: str, items: Sequence[Any], fields: Mapping[str, Any]) -> None:
        """Add ``items`` to the list at ``key`` of the state (a JSON object,
        ``{}`` when there is none) and set ``fields``."""
        if key in fields:
            raise InvalidArgument(f"{key!r} is the appended list, not a field", field="fields")
        pieces = [encode(item, field="items") for item in items]
        _rest(fields)  # refused before anything changes when not JSON
        if self._list is None or self._list[0] != key:
            self._lay_out(key)
        assert self._list is not None
        end = self._list[1]
        value = self._value
        joined = b",".join(pieces)
        if value[key] and joined:
            joined = b"," + joined
        value[key].extend(items)
        for name, field_value in fields.items():
            value[name] = field_value
        rest = _rest({k: v for k, v in value.items() if k != key})
        self.kept = min(self.kept, end)
        del self.data[end:]
        self.data += joined
        self._list = (key, len(self.data))
        self.data += b"]" + rest + b"}"

    def _lay_out(self, key: str) -> None:
        """Encode the state with the list at ``key`` first, so that appending
        to it writes only what follows its end."""
        value = self.value() if self.present else {}
        if not isinstance(value, dict):
            raise InvalidArgument("append_state needs a state that is a JSON object", field="key")
        items = value.get(key, [])
        if not isinstance(items, list):
            raise InvalidArgument(f"the state's {key!r} is not a list", field="key")
        value = {key: items, **{k: v for k, v in value.items() if k != key}}
        head = b"{" + encode(key, field="key") + b":" + encode(items, field="state")
        others = _rest({k: v for k, v in value.items() if k != key})
        data = head + others + b"}"
        self.replace(data)
        self._value = value
        self._list = (key, len(head) - 1)

    def delta(self) -> statechain.Delta:
        """The state against the one the last commit stored."""
        return statechain.Delta(keep=self.kept, tail=bytes(self.data[self.kept :]))

    def committed(self, chain: statechain.Chain, seq: int) -> None:
        """The commit at ``seq`` stored the state, at ``chain``."""
        self.chain = chain
        self.kept = len(self.data)
        self.seq = seq

    def is_at(self, seq: int) -> bool:
        """Whether this is the state the commit at ``seq`` stored, unchanged since."""
        return self.present and self.seq == seq and self.kept == len(self.data)


class HeldStates:
    """The states a worker process holds, by step, newest last: a dispatch
    of a step whose task went back to the queue (after ``kept_iterations``,
    or a wait) and came back to this process finds the state the step's last
    commit stored here, and reads nothing (the claim says the state follows
    rather than rebuilding it). At most ``max_bytes`` of states are held."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._held: dict[tuple[str, str], HeldState] = {}

    def put(self, run_id: str, step_id: str, held: HeldState) -> None:
        key = (run_id, step_id)
        self._held.pop(key, None)
        self._held[key] = held
        while sum(len(h.data) for h in self._held.values()) > self._max_bytes:
            del self._held[next(iter(self._held))]

    def take(self, run_id: str, step_id: str, seq: int) -> HeldState | None:
        """The state the commit at ``seq`` of the step stored, if held."""
        held = self._held.pop((run_id, step_id), None)
        return held if held is not None and held.is_at(seq) else None


def _rest(fields: Mapping[str, Any]) -> bytes:
    """``fields`` as the members that follow the list, each after a comma."""
    return b"".join(
        b"," + encode(name, field="fields") + b":" + encode(v, field="fields")
        for name, v in fields.items()
    )


def store(held: HeldState, commit: jpb.Commit, settings: statechain.ChainSettings) -> None:
    """Put ``held`` into ``commit``, a delta or a snapshot as the state chain's
    rule says; the chain it makes is ``held``'s once the commit is stored
    (``committed``).

    Raises:
        StateTooLarge: the state is past ``settings.state_max_bytes``.
    """
    plan = statechain.plan_state(held.chain, held.delta(), settings)
    commit.has_state = True
    match plan:
        case statechain.WriteSnapshot():
            commit.state = bytes(held.data)
        case statechain.WriteDelta(delta=delta, chain=chain):
            commit.ClearField("state")
            commit.state_delta.CopyFrom(
                jpb.StateDelta(
                    keep=delta.keep,
                    tail=delta.tail,
                    size=delta.size,
                    depth=chain.depth,
                    chain_bytes=chain.delta_bytes,
                )
            )
        case statechain.StateOverLimit():
            raise StateTooLarge(plan.message(), field="state")


def chain_of(commit: jpb.Commit) -> statechain.Chain:
    """Where the state ``commit`` stored stands in its chain."""
    if commit.HasField("state_delta"):
        d = commit.state_delta
        return statechain.Chain(size=d.size, depth=d.depth, delta_bytes=d.chain_bytes)
    return statechain.Chain(size=len(commit.state))
