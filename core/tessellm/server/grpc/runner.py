"""The grpc.aio server of one ServerState: bind, start, stop.

Import only after server.load_grpc_service() succeeded (grpcio is optional).
"""
from __future__ import annotations

import grpc

from tessellm.errors import ConfigError
from tessellm.server.grpc.server import grpc_address
from tessellm.server.grpc.service import TessellmService, generic_handler
from tessellm.server.state import ServerState


class GrpcRunner:
    """`await start()` binds host:port (0 picks a free port, then `port` is the bound one)
    and serves; `await stop(grace_s)` lets calls in flight finish for up to grace_s."""

    def __init__(self, state: ServerState, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((generic_handler(TessellmService(state)),))

    async def start(self) -> None:
        address = grpc_address(self.host, self.port)
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {address} for gRPC: {e}") from e
        if bound == 0:
            raise ConfigError(f"cannot listen on {address} for gRPC")
        self.port = bound
        await self.server.start()

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
