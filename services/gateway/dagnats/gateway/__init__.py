"""The HTTP gateway: the REST API, the journal as JSON or server-sent events,
and the HTTP bridge for workers, all in front of the gRPC services.

``create_app`` builds the ASGI application; ``start_gateway`` serves it with
uvicorn in the running event loop (``dagnats serve gateway`` and ``dagnats
dev`` use it).
"""

from dagnats.gateway.app import create_app
from dagnats.gateway.config import GatewayConfig
from dagnats.gateway.server import GatewayServer, start_gateway

__all__ = ["GatewayConfig", "GatewayServer", "create_app", "start_gateway"]
