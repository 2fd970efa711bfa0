"""The engine's, the journal's and the inputs' RPCs one by one, each with its
deadline and its retries: what ``Client``, ``Worker`` and ``JournalClient``
are built on, for a caller that speaks the contracts itself (the HTTP
gateway's worker bridge makes exactly the SDK's calls through it).

Every method takes and returns the generated contract messages and raises the
domain errors of ``dagnats.core.errors``, never a ``grpc.RpcError``; see
``EngineRpc`` for which calls are retried and for how long.
"""

from dagnats.sdk._rpc import EngineRpc, Lease, RetryPolicy

__all__ = ["EngineRpc", "Lease", "RetryPolicy"]
