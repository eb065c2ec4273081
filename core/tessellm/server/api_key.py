"""The API-key check shared by HTTP (app.guard_middleware) and gRPC (grpc.status).

With `api_key` set, a request must carry `Bearer <key>` (the HTTP `Authorization` header or
the gRPC `authorization` metadata), compared in constant time; otherwise it is a 401.
"""
from __future__ import annotations

import hmac

from tessellm.server.errors import APIError
from tessellm.server.server_config import ServerConfig


def api_key_error(config: ServerConfig, authorization: str) -> APIError | None:
    """The 401 to answer when `authorization` does not carry the server's key; None when it
    does or the server has no key."""
    key = config.api_key
    if key is None:
        return None
    expected = f"Bearer {key.get_secret_value()}"
    # aiohttp keeps undecodable header bytes as surrogate escapes: compare the bytes
    if hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"), expected.encode()):
        return None
    return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
