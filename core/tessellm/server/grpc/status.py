"""HTTP statuses -> gRPC status codes, and the API-key check of a call's metadata.

The gRPC service answers every error the HTTP server would, with the same message: an
APIError's HTTP status picks the code (400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404
NOT_FOUND, 503 UNAVAILABLE, 500 INTERNAL, ...; a status not listed maps to UNKNOWN for 4xx and
INTERNAL for 5xx). A Retry-After the HTTP answer would carry becomes trailing metadata
`retry-after`.
"""
from __future__ import annotations

from collections.abc import Iterable

import grpc

from tessellm.server.errors import APIError
from tessellm.server.server_config import ServerConfig
from tessellm.server.api_key import api_key_error

HTTP_TO_GRPC: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP error status."""
    default = grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.UNKNOWN
    return HTTP_TO_GRPC.get(status, default)


def trailing_metadata(err: APIError) -> tuple[tuple[str, str], ...]:
    retry = err.headers.get("Retry-After")
    return (("retry-after", retry),) if retry is not None else ()


def check_api_key(config: ServerConfig, metadata: Iterable[tuple[str, str | bytes]]) -> None:
    """Raises the HTTP server's 401 APIError unless the metadata carries `authorization:
    Bearer <key>` of the server's API key (compared in constant time); nothing without a key."""
    given = next((v for k, v in metadata if k == "authorization"), "")
    error = api_key_error(config, given if isinstance(given, str) else "")
    if error is not None:
        raise error
