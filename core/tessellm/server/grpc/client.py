"""A typed client stub of tessellm.v1.Tessellm over a grpc or grpc.aio channel.

    stub = TessellmStub(grpc.insecure_channel("127.0.0.1:50051"))
    for message in stub.Generate(pb.GenerateRequest(text="Once", max_tokens=8),
                                 metadata=bearer("KEY")): ...

The callables are made from the proto's service descriptor, as the server's handlers are.
"""
from __future__ import annotations

from typing import Any

import grpc

from tessellm.server.grpc.messages import SERVICE, message_class, method_path


def bearer(api_key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries an API key."""
    return (("authorization", f"Bearer {api_key}"),)


class TessellmStub:
    """Generate (server streaming), Abort, Health, Models: channel callables."""

    Generate: Any
    Abort: Any
    Health: Any
    Models: Any

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        for method in SERVICE.methods:
            make = channel.unary_stream if method.server_streaming else channel.unary_unary
            setattr(self, method.name, make(
                method_path(method),
                request_serializer=message_class(method, output=False).SerializeToString,
                response_deserializer=message_class(method, output=True).FromString))
