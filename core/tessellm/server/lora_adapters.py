"""ServedAdapters: the LoRA adapters a server serves, by the name a request's `model` gives.

Adapters come from `--lora-modules name=path ...` at start-up and, with
`--allow-runtime-lora`, from POST /v1/load_lora_adapter and /v1/unload_lora_adapter. Each
registration gets a new int id (1, 2, ...; never reused), which is what the engine core keys
its host cache, slot table and prefix-cache blocks by: a name loaded again after an unload
never shares anything with the weights it replaced. Here the adapter's directory and its
adapter_config.json are checked (without torch); the core reads the weights when a request
first uses it, and a request whose adapter does not fit the base model gets a 400 saying why.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tessellm.lora.adapter_config import LoRAError, adapter_directory, read_adapter_config
from tessellm.server.errors import APIError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    int_id: int
    path: str

    @property
    def wire(self) -> tuple[str, int, str]:
        """What a request carries to the engine core (LoRARequest's fields)."""
        return (self.name, self.int_id, self.path)


def parse_lora_module(spec: Any) -> tuple[str, str]:
    """`name=path`, or a JSON object {"name", "path"} (vLLM's two forms) -> (name, path)."""
    if isinstance(spec, dict):
        name, path = spec.get("name"), spec.get("path")
    elif isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"lora module {spec!r} is not valid JSON: {e}") from None
        return parse_lora_module(obj) if isinstance(obj, dict) else parse_lora_module(None)
    elif isinstance(spec, str) and "=" in spec:
        name, _, path = spec.partition("=")
    else:
        raise ValueError(f"lora module {spec!r} must be name=path or "
                         '{"name": ..., "path": ...}')
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"lora module name {name!r} must be 1-128 letters, digits or ._:/@+- "
                         "(starting with a letter or digit)")
    if not isinstance(path, str) or not path:
        raise ValueError(f"lora module {name!r} needs a path")
    return name, path


class ServedAdapters:
    def __init__(self, base_names: frozenset[str], max_loras: int, max_lora_rank: int) -> None:
        self.base_names = base_names      # the base model's names: no adapter may take one
        self.enabled = max_loras > 0
        self.max_lora_rank = max_lora_rank
        self._by_name: dict[str, ServedAdapter] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> ServedAdapter | None:
        return self._by_name.get(name)

    @property
    def all(self) -> list[ServedAdapter]:
        return list(self._by_name.values())

    def add(self, name: str, path: str) -> ServedAdapter:
        """Register an adapter (APIError 400 when it cannot be served, 409 when the name is
        taken); its directory and adapter_config.json are read here."""
        if not self.enabled:
            raise APIError(400, "this server serves no LoRA adapters: start it with "
                           "--enable-lora", param="lora_name")
        try:
            name, path = parse_lora_module({"name": name, "path": path})
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from None
        if name in self.base_names or name in self._by_name:
            raise APIError(409, f"the model name {name!r} is already served",
                           param="lora_name", code="model_exists")
        try:
            config = read_adapter_config(adapter_directory(path), name)
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None
        if int(config["r"]) > self.max_lora_rank:
            raise APIError(400, f"adapter {name!r}: rank {config['r']} exceeds "
                           f"max_lora_rank {self.max_lora_rank}", param="lora_path")
        adapter = ServedAdapter(name, self._next_id, path)
        self._next_id += 1
        self._by_name[name] = adapter
        return adapter

    def remove(self, name: Any) -> ServedAdapter:
        adapter = self._by_name.pop(name, None) if isinstance(name, str) else None
        if adapter is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="model_not_found")
        return adapter

    def cards(self, parent: str, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters (`parent`: the base model, as vLLM lists them)."""
        return [{"id": a.name, "object": "model", "created": created, "owned_by": "tessellm",
                 "root": a.path, "parent": parent, "max_model_len": max_model_len}
                for a in self._by_name.values()]
