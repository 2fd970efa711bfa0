"""The gateway's connections to the gRPC services, one set per application."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from dagnats.gateway.config import GatewayConfig
from dagnats.sdk import Client, JournalClient
from dagnats.sdk.rpc import EngineRpc, RetryPolicy


@dataclass(slots=True)
class Backend:
    """Clients of the engine, journal and inputs services (at the engine's
    address, or each at its own).

    ``client``, ``journal`` and ``api`` (the calls ``client`` does not wrap)
    serve the REST API, with the gateway's client credentials; ``rpc`` is the
    task and journal-writer API the worker bridge speaks for its HTTP
    workers, with its worker credentials.
    """

    client: Client
    journal: JournalClient
    api: EngineRpc
    rpc: EngineRpc

    @classmethod
    def connect(cls, config: GatewayConfig) -> Backend:
        """Clients of ``config``'s engine: the REST API's with its client
        credentials, the bridge's with its worker credentials."""
        target, timeout, retry_for = config.engine_target, config.rpc_timeout, config.retry_for
        journal, inputs = config.journal_target, config.inputs_target
        api = config.client_credentials
        return cls(
            client=Client(
                target, timeout=timeout, retry_for=retry_for, credentials=api, inputs_target=inputs
            ),
            journal=JournalClient(
                journal or target, timeout=timeout, retry_for=retry_for, credentials=api
            ),
            api=EngineRpc(
                target,
                timeout=timeout,
                retry=RetryPolicy(budget=retry_for),
                credentials=api,
                journal_target=journal,
                inputs_target=inputs,
            ),
            rpc=EngineRpc(
                target,
                timeout=timeout,
                credentials=config.worker_credentials,
                journal_target=journal,
                inputs_target=inputs,
            ),
        )

    async def close(self) -> None:
        await self.client.close()
        await self.journal.close()
        await self.api.close()
        await self.rpc.close()


def backend(request: Request) -> Backend:
    """FastAPI dependency: the application's backend."""
    found: Backend = request.app.state.backend
    return found


BackendDep = Annotated[Backend, Depends(backend)]
