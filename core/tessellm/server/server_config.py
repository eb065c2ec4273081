"""ServerConfig and the YAML config file of `tessellm serve`.

The YAML file is one flat mapping: EngineConfig fields and ServerConfig fields side by side.
Precedence, lowest first: field defaults < the environment (TESSELLM_API_KEY only) < the YAML
file < command-line flags. A key that belongs to neither config is an error naming the key;
so is a key whose value has the wrong type (pydantic's message, with the key's name).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator,
                      model_validator)

from tessellm.config import EngineConfig
from tessellm.errors import ConfigError

API_KEY_ENV = "TESSELLM_API_KEY"


class ServerConfig(BaseModel):
    """Options of the HTTP (and gRPC) server (the engine's live in EngineConfig)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="bind address; loopback unless told otherwise")
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port (printed)")
    api_key: SecretStr | None = Field(None, description=f"require `Authorization: Bearer` on "
                                      f"/v1/*; default ${API_KEY_ENV}")
    max_queue: int = Field(256, ge=1, description="most requests waiting for a first schedule")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger bodies get 413")
    max_n: int = Field(16, ge=1, description="largest `n` (and prompts per completion request)")
    chat_template: str | None = Field(None, description="Jinja chat template file; default "
                                      "the tokenizer's")
    drain_timeout_s: float = Field(10.0, ge=0, description="on SIGTERM, how long in-flight "
                                   "requests may finish before they are aborted")
    request_timeout_s: float | None = Field(None, gt=0, description="end a request that has not "
                                            "finished after this many seconds with an error "
                                            "(default: no limit)")
    engine_heartbeat_timeout_s: float = Field(2.0, gt=0, description="the engine core silent "
                                              "this long: /health 503, new requests 503")
    engine_stall_timeout_s: float = Field(60.0, gt=0, description="the engine core silent (or "
                                          "one step running) this long: requests in flight "
                                          "fail")
    header_timeout_s: float = Field(30.0, gt=0, description="most seconds from a request's "
                                    "first byte to the end of its headers")
    body_timeout_s: float = Field(60.0, gt=0, description="most seconds to receive a request "
                                  "body once its headers are in")
    keepalive_timeout_s: float = Field(75.0, gt=0, description="an idle connection (none sent "
                                       "yet, or between requests) is closed after this long")
    max_connections: int = Field(1000, ge=1, description="open connections beyond this are "
                                 "answered 503 and closed")
    tool_call_parser: str | None = Field(None, description="tool-call format to parse and force "
                                         "(hermes, llama3_json, mistral, or a plugin's); "
                                         "default: the one the chat template implies")
    grpc_port: int | None = Field(None, ge=0, le=65535, description="also serve the gRPC "
                                  "service (tessellm.proto) on this port of `host` (0: a free "
                                  "one, printed); needs `tessellm[grpc]`")
    otlp_traces_endpoint: str | None = Field(None, min_length=1, description="export one "
                                             "OpenTelemetry span per request to this OTLP "
                                             "endpoint; needs `tessellm[otel]`")

    lora_modules: list[str] = Field(default_factory=list, description="LoRA adapters to serve "
                                    "(needs enable_lora): `name=path` or a JSON object "
                                    "{\"name\", \"path\"}; a request's `model` names one")
    data_parallel_size: int = Field(1, ge=1, description="engine cores (replicas, each with "
                                    "its own KV cache) behind this front end; more than 1 runs "
                                    "them as Ray actors (needs `tessellm[ray]`)")
    dp_routing: Literal["least-loaded", "prefix-aware"] = Field(
        "least-loaded", description="with data_parallel_size > 1: how a request's replica is "
        "chosen")
    replica_max_restarts: int = Field(3, ge=0, description="with data_parallel_size > 1: "
                                      "times Ray restarts a replica whose actor died")
    allow_runtime_lora: bool = Field(False, description="enable POST /v1/load_lora_adapter and "
                                     "/v1/unload_lora_adapter (behind the API key)")

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules_parse(cls, v: list[str]) -> list[str]:
        from tessellm.server.lora_adapters import parse_lora_module
        names = [parse_lora_module(spec)[0] for spec in v]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        return v

    @model_validator(mode="after")
    def _liveness_order(self) -> ServerConfig:
        if self.engine_heartbeat_timeout_s > self.engine_stall_timeout_s:
            raise ValueError(f"engine_heartbeat_timeout_s ({self.engine_heartbeat_timeout_s}) "
                             f"must not exceed engine_stall_timeout_s "
                             f"({self.engine_stall_timeout_s})")
        return self

    @model_validator(mode="after")
    def _replica_options(self) -> ServerConfig:
        if self.data_parallel_size == 1 and self.dp_routing != "least-loaded":
            raise ValueError("dp_routing applies to replicas: it needs data_parallel_size > 1")
        return self

    @field_validator("api_key")
    @classmethod
    def _key_nonempty(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value():
            raise ValueError("api_key must not be empty")
        return v


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                     for e in exc.errors())


def read_yaml_config(path: str | Path) -> dict[str, Any]:
    """The YAML file as a flat dict (safe_load: no arbitrary objects)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values, "
                          f"found {type(data).__name__}")
    return data


def build_configs(file_values: Mapping[str, Any] | None = None,
                  overrides: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None,
                  source: str = "config") -> tuple[EngineConfig, ServerConfig]:
    """Split the flat key space into (EngineConfig, ServerConfig); `overrides` (CLI flags,
    None values dropped) win over `file_values`. Raises ConfigError naming a bad key."""
    engine_keys, server_keys = set(EngineConfig.model_fields), set(ServerConfig.model_fields)
    values = dict(file_values or {})
    for key in values:
        if not isinstance(key, str) or key not in engine_keys | server_keys:
            raise ConfigError(f"unknown key {key!r} in {source}; valid keys: "
                              f"{', '.join(sorted(engine_keys | server_keys))}")
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    env = os.environ if environ is None else environ
    if values.get("api_key") is None and env.get(API_KEY_ENV):
        values["api_key"] = env[API_KEY_ENV]
    try:
        engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_keys})
        server = ServerConfig(**{k: v for k, v in values.items() if k in server_keys})
    except ValidationError as e:
        raise ConfigError(f"invalid {source}: {_validation_message(e)}") from None
    if (engine.ray_address is not None and server.data_parallel_size == 1
            and engine.distributed_executor_backend != "ray"):
        raise ConfigError(f"invalid {source}: ray_address applies to replicas "
                          "(data_parallel_size > 1) or to distributed_executor_backend 'ray'")
    return engine, server


def load_configs(path: str | Path | None, overrides: Mapping[str, Any] | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    """build_configs over the YAML file at `path` (or no file)."""
    file_values = read_yaml_config(path) if path is not None else {}
    source = f"config file {str(path)!r}" if path is not None else "options"
    return build_configs(file_values, overrides, environ, source)
