"""A fork's copied prefix, record by record: its sequence fields moved to the
new journal, and the digest that names the prefix.

A record names earlier records of its step by their stream sequence
(``expected_seq``, ``base_seq``, an intent's ``honours_seq``, an output's or
a result's ``intent_seq``), and always one that comes before it. A prefix is
copied in order, so each copy's references map through the sequences its
earlier copies were given (``moved``). The digest names each reference by
its record's place in the prefix instead (1 for the first, 0 for none), so a
faithful copy and its source have the same digest (``prefix_digest``).
Protobuf in, protobuf out; no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

from dagnats.journal.v1 import journal_pb2 as pb

DIGEST_PREFIX = "sha256:"


def moved(record: pb.Record, run_id: str, seqs: Mapping[int, int]) -> pb.Record:
    """``record`` as copied into run ``run_id``'s journal: each sequence it
    names mapped through ``seqs`` (0 stays 0), its own ``seq`` cleared.

    Raises:
        KeyError: a reference to a record that is not in ``seqs`` (not
            copied before it).
    """
    return _mapped(record, run_id, lambda seq: seqs[seq] if seq else 0)


def prefix_digest(records: Sequence[pb.Record]) -> str:
    """The digest of a prefix as its records hold it, each sequence named
    by its record's place in ``records`` (from 1): the same for a source's
    records and their faithful copies. A reference outside the prefix is
    kept as it is (prefixed, so it cannot pass for a place)."""
    places = {r.seq: i + 1 for i, r in enumerate(records)}
    h = hashlib.sha256()
    for r in records:
        # A sequence the prefix does not hold stays apart from any place.
        body = _mapped(r, "", lambda seq: places.get(seq, seq + (1 << 62) if seq else 0))
        data = body.SerializeToString(deterministic=True)
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return DIGEST_PREFIX + h.hexdigest()


def _mapped(record: pb.Record, run_id: str, to: Callable[[int], int]) -> pb.Record:
    copy = pb.Record()
    copy.CopyFrom(record)
    copy.run_id = run_id
    copy.ClearField("seq")
    copy.expected_seq = to(record.expected_seq)
    copy.base_seq = to(record.base_seq)
    kind = copy.WhichOneof("kind")
    if kind == "tool_intent":
        copy.tool_intent.honours_seq = to(record.tool_intent.honours_seq)
    elif kind == "tool_intents":
        for intent in copy.tool_intents.intents:
            intent.honours_seq = to(intent.honours_seq)
    elif kind == "tool_output":
        copy.tool_output.intent_seq = to(record.tool_output.intent_seq)
    elif kind == "tool_result":
        copy.tool_result.intent_seq = to(record.tool_result.intent_seq)
    if copy.HasField("leading_tool_result"):
        copy.leading_tool_result.intent_seq = to(record.leading_tool_result.intent_seq)
    return copy
