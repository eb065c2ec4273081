"""OpenAI-style error objects and the mapping from exceptions to HTTP statuses.

Every 4xx/5xx body the server sends is `{"error": {"message", "type", "param", "code"}}`.
Mapping: InvalidRequestError and pydantic ValidationError -> 400; QueueFullError and
EngineUnresponsiveError -> 503 with Retry-After; aiohttp's own HTTP errors keep their status
and headers (413 body too large, 404 no route, 405 method with Allow); anything else -> 500
(logged with its traceback, message kept generic). A 408 or 413 closes the connection (the
rest of the body is never read).
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from tessellm.engine.async_engine import (EngineDeadError, EngineUnresponsiveError,
                                          QueueFullError)
from tessellm.errors import InvalidRequestError

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
          504: "timeout_error"}
_CLOSING = (408, 413)   # statuses after which the connection is closed
_KEPT_HEADERS = ("Allow", "Retry-After")   # of aiohttp's own HTTP errors


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else
                                       "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        response = web.Response(status=self.status, text=json.dumps(self.body()),
                                content_type="application/json", headers=headers)
        if self.status in _CLOSING:
            response.force_close()
        return response


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def validation_error(exc: ValidationError) -> APIError:
    """A 400 from pydantic's errors: every problem, each with its field path."""
    parts, first = [], None
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"])
        first = first or loc or None
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return APIError(400, "; ".join(parts), param=first)


def from_exception(exc: BaseException) -> APIError | None:
    """The APIError for an expected exception; None for a bug (the caller answers 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full",
                        headers={"Retry-After": str(max(1, exc.retry_after_s))})
    if isinstance(exc, EngineDeadError):  # not "queue full": retrying here will not help
        return APIError(503, str(exc), type="service_unavailable", code="engine_unavailable")
    if isinstance(exc, EngineUnresponsiveError):
        return APIError(503, str(exc), type="service_unavailable", code="engine_unresponsive",
                        headers={"Retry-After": "1"})
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, web.HTTPException) and exc.status >= 400:
        return APIError(exc.status, exc.reason if exc.text is None else
                        exc.text.removeprefix(f"{exc.status}: "),
                        headers={k: exc.headers[k] for k in _KEPT_HEADERS if k in exc.headers})
    return None


def internal_error(message: str = "internal server error") -> APIError:
    return APIError(500, message, type="server_error")
