"""The shipped tessellm.proto and its committed tessellm_pb2.py agree, and a server asked
for gRPC without grpcio refuses to start (before any engine core is spawned)."""
from __future__ import annotations

import asyncio
import importlib.resources
import sys

import pytest
from google.protobuf import descriptor_pb2
from tessellm.config import EngineConfig
from tessellm.errors import ConfigError
from tessellm.server.grpc import tessellm_pb2 as pb
from tessellm.server.server_config import ServerConfig

PROTO = "tessellm/server/grpc/tessellm.proto"


def test_the_generated_module_is_up_to_date_with_the_proto(tmp_path):
    """Regenerate with: python -m grpc_tools.protoc -Icore --python_out=core core/<PROTO>."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    source = importlib.resources.files("tessellm.server.grpc") / "tessellm.proto"
    root = str(source).removesuffix(PROTO)
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{root}", f"--descriptor_set_out={out}", PROTO]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:   # the generated module leaves out the JSON names
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "tessellm_pb2.py is stale: regenerate it from tessellm.proto"


def _without_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)   # `import grpc` raises ImportError
    for name in [m for m in sys.modules if m.startswith("tessellm.server.grpc.")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_missing_grpcio_is_a_start_up_error(monkeypatch):
    _without_grpc(monkeypatch)
    from tessellm.server.grpc.server import load_grpc_service
    with pytest.raises(ConfigError, match=r"tessellm\[grpc\]"):
        load_grpc_service()
    from tessellm.server.serve import serve
    with pytest.raises(ConfigError, match=r"--grpc-port needs grpcio"):   # before the core
        asyncio.run(serve(EngineConfig(), None, None, ServerConfig(grpc_port=0)))
