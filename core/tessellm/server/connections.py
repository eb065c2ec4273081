"""The listening socket's guard against slow clients and too many of them.

aiohttp itself closes a connection that stays idle for `keepalive_timeout` (from its opening
until a first request, and between requests). ConnectionGuard adds what it lacks:
- a cap on open connections: a connection past `max_connections` is answered 503 (an OpenAI
  error object, `Connection: close`) and closed before anything of it is read;
- a header timeout: from the first byte of a request to the end of its headers (the moment
  the app's middleware sees the request, `request_started`) at most `header_timeout_s`, else
  the connection is closed: a half-sent header (slowloris) holds a descriptor no longer;
- aiohttp's own protocol errors (a header line over 8 KB, a malformed request line) answered
  as OpenAI error objects instead of aiohttp's plain text (ErrorObjectRequestHandler).
The body timeout is where the body is read (requests.read_body: 408).
Invariant: every open connection of the site is in `open_connections` exactly once, from
connection_made to connection_lost.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)
DESCRIPTOR_RESERVE = 128   # descriptors kept for model files, sockets to the core, logs


def connection_cap(max_connections: int) -> int:
    """`max_connections`, after raising this process's descriptor limit (soft, up to the hard
    one) to hold them; lowered, with a warning, where the hard limit is too small."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + DESCRIPTOR_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        cap = max(1, soft - DESCRIPTOR_RESERVE)
        log.warning("the descriptor limit (%d) holds %d connections, not %d; capping there",
                    soft, cap, max_connections)
        return cap
    return max_connections


def error_body(status: int, message: str, type_: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


class ErrorObjectRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering its own protocol errors as error objects."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)   # logs; raises if already sent
        if status >= 500:
            text, type_ = "internal server error", "server_error"
        else:
            text, type_ = f"malformed HTTP request: {message or 'bad request'}", \
                "invalid_request_error"
        response = web.Response(status=status, body=error_body(status, text, type_),
                                content_type="application/json")
        response.force_close()
        return response


class _GuardedConnection(asyncio.Protocol):
    """One connection: aiohttp's handler behind the header timer."""

    def __init__(self, guard: ConnectionGuard, handler: asyncio.Protocol) -> None:
        self._guard = guard
        self._handler = handler
        self._transport: asyncio.Transport | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._guard.open_connections[transport] = self
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._in_request and self._header_timer is None:
            self._header_timer = asyncio.get_running_loop().call_later(
                self._guard.header_timeout_s, self._headers_timed_out)
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._guard.open_connections.pop(self._transport, None)
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def request_started(self) -> None:
        self._cancel_timer()
        self._in_request = True

    def request_finished(self) -> None:
        self._in_request = False

    def _cancel_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self._transport is not None and not self._in_request:
            log.info("closing a connection whose request headers took over %.0f s",
                     self._guard.header_timeout_s)
            self._transport.close()


class _Refused(asyncio.Protocol):
    """A connection past the cap: one 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = error_body(503, "too many open connections; retry later", "service_unavailable",
                          "too_many_connections")
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        transport.write(head.encode() + body)   # type: ignore[attr-defined]
        transport.close()


class ConnectionGuard:
    """Builds the site's connection protocols (see the module docstring)."""

    def __init__(self, max_connections: int, header_timeout_s: float,
                 handler_options: dict[str, Any]) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.handler_options = handler_options   # RequestHandler keyword arguments
        self.open_connections: dict[asyncio.BaseTransport, _GuardedConnection] = {}
        self.num_refused = 0

    def protocol(self, server: web.Server) -> asyncio.Protocol:
        if len(self.open_connections) >= self.max_connections:
            self.num_refused += 1
            return _Refused()
        handler = ErrorObjectRequestHandler(server, loop=asyncio.get_running_loop(),
                                            **self.handler_options)
        return _GuardedConnection(self, handler)

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        connection = self.open_connections.get(transport) if transport is not None else None
        if connection is not None:
            connection.request_started()

    def request_finished(self, transport: asyncio.BaseTransport | None) -> None:
        connection = self.open_connections.get(transport) if transport is not None else None
        if connection is not None:
            connection.request_finished()


class GuardedTCPSite(web.BaseSite):
    """A TCP site whose connections go through a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._guard.protocol(server), self._host, self._port, reuse_address=True)
