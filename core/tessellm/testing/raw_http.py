"""HTTP/1.1 requests as raw bytes, for what an HTTP client library will not send (undecodable
header bytes, oversized headers, bodies that are not JSON) and for half-sent requests.

`build_request` makes the bytes of one request with `Connection: close`; `send_raw` (asyncio)
and `send_raw_blocking` send them and read the whole answer: the server closes after it, so
the body ends at EOF.
"""
from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RawResponse:
    status: int
    headers: dict[str, str]   # lower-cased names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def build_request(method: str, path: str, body: bytes | dict | None = None,
                  headers: dict[str, str | bytes] | None = None, host: str = "localhost"
                  ) -> bytes:
    """The bytes of one request; a dict body is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: {host}".encode(),
             b"Connection: close"]
    if data is not None:
        lines += [b"Content-Type: application/json", f"Content-Length: {len(data)}".encode()]
    for name, value in (headers or {}).items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes)
                                              else value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (data or b"")


def parse_response(data: bytes) -> RawResponse:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        raise ValueError(f"not an HTTP response: {data[:80]!r}")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _unchunk(body)
    return RawResponse(status, headers, body)


def _unchunk(body: bytes) -> bytes:
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)


async def send_raw(host: str, port: int, raw: bytes, timeout_s: float = 60.0) -> RawResponse:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), timeout_s)
    finally:
        writer.close()
    return parse_response(data)


def send_raw_blocking(host: str, port: int, raw: bytes, timeout_s: float = 60.0) -> RawResponse:
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return parse_response(b"".join(chunks))
