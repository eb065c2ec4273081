"""Data-parallel replicas on Ray: N engine cores as Ray actors behind one front end.

`tessellm serve --data-parallel-size N` (server.serve) starts them through `ReplicaSet`; each
actor runs the ordinary engine core loop (engine.engine_core.run_core) over tcp zmq sockets
its front end bound, so validation, streaming, aborts and liveness are the single engine's
code. Modules, one concept each: `cluster` (importing Ray, joining or starting a cluster),
`actor` (the engine core as a Ray actor), `prefix_index` (the block hashes a replica holds),
`router` (least-loaded and prefix-aware choice), `replica` (one actor's incarnations: ready,
in rotation, dead, restarted), `replica_set` (the replicas as one engine for the server),
`serve_app` (the same deployment as a Ray Serve application). Importing this package does
not import Ray; `serve_app` is exported lazily.
"""
from __future__ import annotations

from typing import Any

__all__ = ["serve_app"]


def __getattr__(name: str) -> Any:
    if name == "serve_app":
        from tessellm.ray.serve_app import serve_app
        return serve_app
    raise AttributeError(f"module 'tessellm.ray' has no attribute {name!r}")
