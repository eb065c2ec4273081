"""The protobuf side of the gRPC service: the service's descriptor, GenerateRequest -> the
/v1/completions schema, and the response messages.

A GenerateRequest becomes the JSON object a /v1/completions client would send with the same
fields (only the fields it sets; `text` or `token_ids` becomes `prompt`) and is validated by
CompletionRequest itself, so every rule and message is the HTTP endpoint's.
"""
from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from pydantic import ValidationError

from tessellm.engine.output_processor import StreamDelta
from tessellm.server.errors import validation_error
from tessellm.server.grpc import tessellm_pb2 as pb
from tessellm.server.protocol import CompletionRequest

SERVICE: ServiceDescriptor = pb.DESCRIPTOR.services_by_name["Tessellm"]
_NOT_SAMPLING = frozenset({"request_id"})   # GenerateRequest fields that are no body field


def method_path(method: MethodDescriptor) -> str:
    return f"/{SERVICE.full_name}/{method.name}"


def message_class(method: MethodDescriptor, output: bool) -> type[Message]:
    """The generated class of a method's request (output False) or response message."""
    descriptor = method.output_type if output else method.input_type
    return getattr(pb, descriptor.name)


def completion_request(message: pb.GenerateRequest) -> CompletionRequest:
    """The request as /v1/completions validates it; a 400 APIError (pydantic's message, as
    HTTP answers it) when invalid."""
    body: dict[str, Any] = {}
    for field, value in message.ListFields():   # only the fields set (proto3 presence)
        if field.name in _NOT_SAMPLING:
            continue
        if field.name == "text":
            body["prompt"] = value
        elif field.name == "token_ids":
            body["prompt"] = list(value.ids)
        else:
            body[field.name] = value if isinstance(value, (str, int, float)) else list(value)
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def delta_response(request_id: str, index: int, delta: StreamDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, index=index, text=delta.text,
                               token_ids=delta.token_ids,
                               finish_reason=(delta.finish_reason or "") if delta.finished
                               else "")


def usage_response(request_id: str, usage: dict[str, int]) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, usage=pb.Usage(**usage))
