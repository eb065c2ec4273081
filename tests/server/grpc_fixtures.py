"""Helpers of the gRPC server tests: a real `tessellm serve --grpc-port 0` (server_fixtures'
running_server) and a stub on its gRPC port (read from the line the server prints)."""
from __future__ import annotations

import re

import grpc
from server_fixtures import ServerProcess
from tessellm.server.grpc.client import TessellmStub

GRPC_LINE = re.compile(r"tessellm: gRPC on ([0-9.]+:\d+)")


def grpc_target(server: ServerProcess) -> str:
    match = GRPC_LINE.search(server.log())
    assert match, f"no gRPC line in the server's log:\n{server.log()[-2000:]}"
    return match.group(1)


def stub_of(server: ServerProcess) -> tuple[grpc.Channel, TessellmStub]:
    channel = grpc.insecure_channel(grpc_target(server))
    return channel, TessellmStub(channel)
