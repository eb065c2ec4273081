"""The aiohttp Application: routes and middlewares.

Middlewares, outermost first:
  1. context: tells the ConnectionGuard (when the app has one) that a request's headers are
     in and when it is done; the server's own request id (`cmpl-<uuid>`, the engine's id); the client's
     X-Request-Id, when valid, is logged beside it and echoed on every answer (else the
     server's id is); every error, expected or not, becomes an OpenAI error object here;
  2. guard: while draining (SIGTERM) /v1/* answers 503; with an API key, /v1/* and /api/*
     (the dashboard's JSON) require `Authorization: Bearer <key>` (compared in constant
     time) or answer 401.
/health, /metrics, /v1/models and /api/dashboard are cheap and never touch the engine's
queue. / and /ui/* are the built-in web page (web_ui.py): static, no key needed.
The engine and the dashboard's history sampler are started when the app starts and stopped
(aborting leftovers) on cleanup.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from tessellm.server.api_key import api_key_error
from tessellm.server.chat import create_chat_completion
from tessellm.server.completions import create_completion
from tessellm.server.connections import ConnectionGuard
from tessellm.server.dashboard import DASHBOARD_PATH, dashboard
from tessellm.server.errors import APIError, from_exception, internal_error
from tessellm.server.lora_routes import add_lora_routes
from tessellm.server.requests import (
    ARRIVAL,
    CLIENT_REQUEST_ID,
    REQUEST_ID,
    STATE_KEY,
    arrival_now,
    client_request_id,
    echo_id,
    new_request_id,
)
from tessellm.server.service_info import draining_error, health_error, model_cards
from tessellm.server.state import ServerState
from tessellm.server.web_ui import add_web_ui

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GUARD_KEY = web.AppKey("tessellm_connection_guard", ConnectionGuard)


@web.middleware
async def context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    guard = request.app.get(GUARD_KEY)
    if guard is None:
        return await _in_context(request, handler)
    guard.request_started(request.transport)
    try:
        return await _in_context(request, handler)
    finally:
        guard.request_finished(request.transport)


async def _in_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[ARRIVAL] = arrival_now()
    request[REQUEST_ID] = own_id = new_request_id()
    try:
        client_id = client_request_id(request.headers.get("X-Request-Id"))
    except APIError as e:
        return e.response(own_id)
    if client_id is not None:
        request[CLIENT_REQUEST_ID] = client_id
    request_id = f"{own_id} (client {client_id})" if client_id else own_id  # for the log
    try:
        response = await handler(request)
    except Exception as exc:  # every failure answers an OpenAI error object
        err = from_exception(exc)
        if err is None:
            log.exception("[%s] unhandled error in %s %s", request_id, request.method,
                          request.path)
            err = internal_error()
        elif err.status >= 500:
            log.error("[%s] %s %s -> %d: %s", request_id, request.method, request.path,
                      err.status, err.message)
        else:
            log.info("[%s] %s %s -> %d: %s", request_id, request.method, request.path,
                     err.status, err.message)
        return err.response(echo_id(request))
    if not response.prepared:
        response.headers["X-Request-Id"] = echo_id(request)
    return response


@web.middleware
async def guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(("/v1/", "/api/")):
        state = request.app[STATE_KEY]
        draining = draining_error(state)
        if draining is not None and request.path.startswith("/v1/"):
            raise draining
        error = api_key_error(state.config, request.headers.get("Authorization", ""))
        if error is not None:
            raise error
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    """200 while the engine core runs and reports in time; 503 otherwise
    (service_info.health_error)."""
    error = health_error(request.app[STATE_KEY])
    if error is not None:
        raise error
    return web.json_response({"status": "ok"})


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": model_cards(request.app[STATE_KEY])})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; "
                                                            "charset=utf-8"})


async def _start_engine(app: web.Application) -> None:
    app[STATE_KEY].engine.start()
    app[STATE_KEY].history.start()


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE_KEY]
    await state.history.stop()
    await state.engine.shutdown(0.0)
    state.executor.shutdown(wait=False, cancel_futures=True)


def create_app(state: ServerState, guard: ConnectionGuard | None = None) -> web.Application:
    """The app of one server; the AsyncEngine in `state` must not be started yet. `guard`:
    the ConnectionGuard of the site that serves it, if any (told of each request)."""
    app = web.Application(middlewares=[context_middleware, guard_middleware],
                          client_max_size=state.config.max_body_bytes)
    app[STATE_KEY] = state
    if guard is not None:
        app[GUARD_KEY] = guard
    state.engine.observer = state.metrics
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    if state.config.allow_runtime_lora:
        add_lora_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(DASHBOARD_PATH, dashboard)
    add_web_ui(app)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app
