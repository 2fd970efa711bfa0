"""The calls a journal ``Session`` stream carries, named once for both ends.

Each field of ``SessionRequest.call`` stands for the unary journal RPC that
takes the same request: the service answers it by running that RPC's own
method, and the SDK names its span after that RPC.
"""

from __future__ import annotations

from dagnats.journal.v1 import journal_pb2 as pb

SERVICE = "/dagnats.journal.v1.JournalService/"
_METHODS = pb.DESCRIPTOR.services_by_name["JournalService"].methods
# The request's oneof field -> the unary RPC that takes the same request.
CALLS = {
    field.name: next(m.name for m in _METHODS if m.input_type is field.message_type)
    for field in pb.SessionRequest.DESCRIPTOR.oneofs_by_name["call"].fields
}
