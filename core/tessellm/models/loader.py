"""Load an HF model directory into a ModelSpec, adapted host weights and the unfused graph."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessellm.graph.ir import ModelGraph
from tessellm.models.architectures import Architecture, resolve_architecture
from tessellm.models.hf_files import load_safetensors, read_hf_config
from tessellm.models.spec import ModelSpec


@dataclass
class LoadedModel:
    config: dict[str, Any]
    spec: ModelSpec
    graph: ModelGraph


def checkpoint_dtype(config: dict[str, Any]) -> str | None:
    return config.get("torch_dtype") or config.get("dtype")


def load_model(model_dir: str | Path, dtype: torch.dtype, *, progress: bool = True,
               extra_architectures: dict[str, Architecture] | None = None,
               config: dict[str, Any] | None = None) -> LoadedModel:
    """Resolve the architecture first (so an unsupported one fails before any weight is read)."""
    config = config if config is not None else read_hf_config(model_dir)
    arch = resolve_architecture(config, extra_architectures)
    spec = arch.spec(config)
    weights = arch.adapt_weights(load_safetensors(model_dir, dtype, progress=progress), spec)
    return LoadedModel(config, spec, arch.build_graph(spec, weights))
