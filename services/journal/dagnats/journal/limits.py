"""How large the journal's records and answers may be.

A record over ``MAX_RECORD_BYTES`` (serialized) is refused before it is written
with ``RecordTooLarge`` (RESOURCE_EXHAUSTED, error code ``record_too_large``).
Every answer of the journal service then fits ``MAX_ANSWER_BYTES``, below the
4 MiB a gRPC client receives by default: a call answers at most one record,
and a claim carries the state (one commit's, so at most one record) and as many
of the iteration's records as fit, with a cursor to read the rest.
"""

from __future__ import annotations

MAX_RECORD_BYTES = 2 * 1024 * 1024  # twice the default checkpoint cap of a non-journal step
MAX_ANSWER_BYTES = 3 * 1024 * 1024
# Room kept below the NATS server's max_payload for a record's headers.
HEADER_ROOM = 8 * 1024
# The partial output an interrupted result carries: its end, when longer.
MAX_PARTIAL_BYTES = 256 * 1024
# The inputs one PlaceInputs call places anew, by their records' size: a queued
# input past it stays queued for the next call, so the answer fits.
MAX_PLACED_BYTES = MAX_ANSWER_BYTES - 256 * 1024
