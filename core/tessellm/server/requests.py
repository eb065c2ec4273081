"""Per-request plumbing shared by the handlers: app/request keys, the request id, and
reading a JSON body into a schema (invalid JSON 400, over the size limit 413, wrong types 400,
a body that does not arrive within body_timeout_s 408).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from tessellm.errors import InvalidRequestError
from tessellm.server.errors import APIError, bad_request, validation_error
from tessellm.server.json_body import parse_json_object
from tessellm.server.state import ServerState

STATE_KEY = web.AppKey("tessellm_state", ServerState)
# typed request keys where aiohttp has them (3.12+: plain str keys warn), str keys before
_RequestKey = getattr(web, "RequestKey", None)
REQUEST_ID: Any = _RequestKey("tessellm_request_id", str) if _RequestKey else "tessellm_request_id"
ARRIVAL: Any = _RequestKey("tessellm_arrival", float) if _RequestKey else "tessellm_arrival"
CLIENT_REQUEST_ID: Any = (_RequestKey("tessellm_client_request_id", str) if _RequestKey
                          else "tessellm_client_request_id")
MAX_REQUEST_ID_LEN = 128

M = TypeVar("M", bound=BaseModel)


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def client_request_id(value: str | None, name: str = "X-Request-Id") -> str | None:
    """The client's X-Request-Id (gRPC: `request_id`, named by `name`) when valid (printable
    ASCII, 1..128 chars), None when absent; an invalid one is a 400 (silently replacing it
    would break the client's log joins). It is echoed and logged, never used as the engine's
    request id: two clients may send the same."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_REQUEST_ID_LEN or not (value.isascii() and value.isprintable()):
        raise bad_request(f"{name} must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII "
                          f"characters", name)
    return value


def echo_id(request: web.Request) -> str:
    """The X-Request-Id to answer with: the client's, else the server's own request id."""
    return request.get(CLIENT_REQUEST_ID) or request[REQUEST_ID]


def request_context(request: web.Request) -> tuple[ServerState, str, float]:
    """(state, request id, arrival time) of a request the middleware has seen."""
    return request.app[STATE_KEY], request[REQUEST_ID], request[ARRIVAL]


# The content types a browser may POST cross-origin without a CORS preflight: a page on any
# site could otherwise make a visitor's browser run requests on a server without an API key.
SIMPLE_FORM_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded",
                               "multipart/form-data"})


async def read_body(request: web.Request, model: type[M]) -> M:
    """The JSON body validated as `model`. 415 for the form content types a browser sends
    without a preflight (see SIMPLE_FORM_TYPES); 413 past max_body_bytes; 400 otherwise."""
    if request.content_type in SIMPLE_FORM_TYPES:
        raise APIError(415, f"the request body is sent as {request.content_type!r}; send JSON "
                       "with Content-Type: application/json")
    config = request.app[STATE_KEY].config
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"the request body has {request.content_length} bytes; the limit "
                       f"is {limit}")
    try:
        async with asyncio.timeout(config.body_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body is larger than the limit of {limit} bytes") \
            from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within "
                       f"{config.body_timeout_s:g} s", code="body_timeout") from None
    try:
        data = parse_json_object(raw)
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def arrival_now() -> float:
    return time.monotonic()
