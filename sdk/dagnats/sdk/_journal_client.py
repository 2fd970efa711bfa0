"""Reading and auditing the journal from a client.

:class:`JournalClient` calls the journal service's read-only methods; the
worker side of the journal is ``TaskContext.journal()``. Failed calls become
the domain error the service raised, never a ``grpc.RpcError``. A call (a page,
for ``read``) whose transport fails is tried again for the RPC policy's
budget, as every client call is (see ``_rpc``); a followed read is not.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import grpc
import grpc.aio

from dagnats.core import errors
from dagnats.core.grpcutil import WireError, error_from_rpc
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.sdk._credentials import Credentials
from dagnats.sdk._rpc import EngineRpc, RetryPolicy

# Records per Read page when not following; a shorter page is the last one.
PAGE = 500


class JournalClient:
    """Calls the journal service's read-only methods.

    Use it as ``async with JournalClient(target) as journal:``. The channel
    opens on the first call, so that it belongs to the running event loop.

    Args:
        target: Address of the journal service, such as ``"localhost:7233"``.
        timeout: Deadline of one call (of one page, for ``read``), in seconds.
        retry_for: Seconds a call keeps retrying a service it cannot reach.
        credentials: Token and TLS files; by default from the environment
            (see ``Credentials``).

    Every method raises the domain error the service answered with
    (``NotFound``, ``InvalidArgument``, ``Unavailable``, ...).
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 30.0,
        retry_for: float = 30.0,
        credentials: Credentials | None = None,
    ) -> None:
        self._target = target
        self._timeout = timeout
        self._rpc = EngineRpc(
            target, timeout=timeout, retry=RetryPolicy(budget=retry_for), credentials=credentials
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._rpc.close()

    async def check(self, run_id: str) -> pb.CheckResponse:
        """Audit the journal of a run.

        Returns:
            The violations and how many steps and records were checked.
        """
        return await self._rpc.check_journal(pb.CheckRequest(run_id=run_id))

    async def state(self, run_id: str, step_id: str, *, at_seq: int = 0) -> bytes | None:
        """The state (JSON) of a step's commit at ``at_seq`` (0: its last
        commit that ended an iteration), rebuilt from its snapshot and the
        deltas after it; None when that commit carried no state.

        Raises:
            NotFound: no commit of the step at ``at_seq``.
        """
        request = pb.ReadStateRequest(run_id=run_id, step_id=step_id, at_seq=at_seq)
        return await self._rpc.read_state(request)

    async def read(
        self,
        run_id: str,
        step_id: str,
        *,
        from_seq: int = 0,
        follow: bool = False,
        limit: int = 0,
    ) -> AsyncIterator[pb.Record]:
        """Yield a step's records from ``from_seq`` on, in sequence order.

        Without ``follow`` it ends at the tail, or after ``limit`` records when
        ``limit`` is positive; with it, it waits for new records until the
        caller stops iterating (``limit`` does not apply).
        """
        if follow:
            request = pb.ReadRequest(run_id=run_id, step_id=step_id, from_seq=from_seq, follow=True)
            async for record in self._stream(request, deadline=None):
                yield record
            return
        left = limit if limit > 0 else None
        while left is None or left > 0:
            page = PAGE if left is None else min(PAGE, left)
            request = pb.ReadRequest(run_id=run_id, step_id=step_id, from_seq=from_seq, limit=page)
            records = await self._page(request)
            for record in records:
                from_seq = record.seq + 1
                yield record
            if len(records) < page:
                return
            if left is not None:
                left -= len(records)

    async def _page(self, request: pb.ReadRequest) -> list[pb.Record]:
        """One page, read whole: a page whose stream failed is read again."""

        async def attempt() -> list[pb.Record]:
            call = self._rpc.journal_stub().Read(request, timeout=self._timeout)
            return [response.record async for response in call]

        return await self._rpc.retrying("Read", attempt, idempotent=True)

    async def watch_stream(
        self, run_id: str, step_id: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield a step's live preview events as ``(id, data)`` (see
        ``WatchStreamResponse``) until the caller stops iterating. The first
        is ``("", {})``: from then on nothing published is missed."""
        request = pb.WatchStreamRequest(run_id=run_id, step_id=step_id)
        call = self._rpc.journal_stub().WatchStream(request)
        try:
            async for response in call:
                yield response.id, json.loads(response.data) if response.id else {}
        except grpc.aio.AioRpcError as err:
            raise self._domain_error(err) from None
        finally:
            call.cancel()

    async def _stream(
        self, request: pb.ReadRequest, *, deadline: float | None
    ) -> AsyncIterator[pb.Record]:
        call = self._rpc.journal_stub().Read(request, timeout=deadline)
        try:
            async for response in call:
                yield response.record
        except grpc.aio.AioRpcError as err:
            raise self._domain_error(err) from None
        finally:
            call.cancel()  # a no-op once the stream ended; stops it if the caller left early

    def _domain_error(self, err: grpc.aio.AioRpcError) -> WireError:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            # A server without the journal service (an engine served on its own).
            return errors.Unavailable(f"{self._target} does not serve the journal service")
        return error_from_rpc(err)
