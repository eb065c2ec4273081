"""Starting the gRPC service on the HTTP server's event loop (grpc.aio).

`load_grpc_service()` is called at start-up, before the engine core is spawned, when
--grpc-port is given: without grpcio (or with a protobuf runtime older than the generated
tessellm_pb2 needs) the server refuses to start with a ConfigError naming the extra, never
failing mid-request. The gRPC server shares the HTTP server's ServerState (engine, limits,
metrics, draining flag): it is stopped after the engine drained, before the app's cleanup.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tessellm.errors import ConfigError

if TYPE_CHECKING:
    from tessellm.server.grpc.runner import GrpcRunner

INSTALL_HINT = "pip install 'tessellm[grpc]'"


def load_grpc_service() -> type[GrpcRunner]:
    """The GrpcRunner class, or a ConfigError saying what to install."""
    try:
        from tessellm.server.grpc.runner import GrpcRunner
    except ImportError as e:
        raise ConfigError(f"--grpc-port needs grpcio and protobuf ({INSTALL_HINT}): {e}") \
            from e
    except Exception as e:   # protobuf's runtime VersionError: the runtime is too old
        raise ConfigError(f"--grpc-port: the installed protobuf cannot load the service's "
                          f"messages ({INSTALL_HINT}): {e}") from e
    return GrpcRunner


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
