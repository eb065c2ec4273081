"""Server-sent events: `data: <json>\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end.

Once the response has started, an error can no longer change the HTTP status: it is sent as
an event `data: {"error": {...}}` (what the OpenAI clients raise on), followed by [DONE].
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"


def encode_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


class SSEWriter:
    """Writes one event stream. A client that has gone away makes `send` raise
    ConnectionResetError (aiohttp's ClientConnectionResetError is one)."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Request-Id": request_id, "X-Accel-Buffering": "no"})

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.response.write(encode_event(obj))

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
