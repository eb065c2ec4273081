"""Load a model source (HF directory or GGUF file) into a ModelSpec, adapted host weights and
the unfused graph."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tessellm.graph.ir import ModelGraph
from tessellm.models.architectures import Architecture, resolve_architecture
from tessellm.models.gguf_file import load_gguf
from tessellm.models.hf_files import load_safetensors, read_hf_config
from tessellm.models.source import ModelSource
from tessellm.models.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: dict[str, Any]
    spec: ModelSpec
    graph: ModelGraph
    build_graph: Callable[[ModelSpec, dict[str, Any]], ModelGraph]   # the architecture's
    packed_types: Counter = field(default_factory=Counter)       # kept packed, by type
    dequantized_types: Counter = field(default_factory=Counter)  # expanded at load, by type


def checkpoint_dtype(config: dict[str, Any]) -> str | None:
    return config.get("torch_dtype") or config.get("dtype")


def open_source(source: ModelSource) -> Any:
    """What reading the source's config, weights and tokenizer can share: a GGUF file's
    parsed header (open_gguf: seconds for a large vocabulary, so it is parsed once per load),
    None for other kinds."""
    if source.kind == "gguf":
        from tessellm.models.gguf_file import open_gguf
        return open_gguf(source.path)
    return None


def read_source_config(source: ModelSource, opened: Any = None) -> dict[str, Any]:
    """The HF-style config of a source (a GGUF file's metadata, converted). `opened`: the
    source's open_source() result, if the caller has it."""
    if source.kind == "gguf":
        from tessellm.models.gguf_config import gguf_config
        return gguf_config(opened if opened is not None else open_source(source))
    return read_hf_config(source.path)


def load_model(source: ModelSource, dtype: torch.dtype, *, progress: bool = True,
               keep_packed: bool = True,
               extra_architectures: dict[str, Architecture] | None = None,
               config: dict[str, Any] | None = None, opened: Any = None) -> LoadedModel:
    """Resolve the architecture first (so an unsupported one fails before any weight is read).

    keep_packed: a GGUF file's Q8_0/Q4_0/Q4_1 matrices stay packed; other types (and all of
    them when False) are dequantized to `dtype`, which the log says.
    """
    config = config if config is not None else read_source_config(source, opened)
    arch = resolve_architecture(config, extra_architectures)
    spec = arch.spec(config)
    if source.kind != "gguf":
        weights = arch.adapt_weights(load_safetensors(source.path, dtype, progress=progress), spec)
        return LoadedModel(config, spec, arch.build_graph(spec, weights), arch.build_graph)
    gg = load_gguf(source.path, dtype, keep_packed=keep_packed, reader=opened)
    if gg.dequantized_types:
        log.info("GGUF %s: dequantized to %s at load: %s", source.path.name,
                 str(dtype).removeprefix("torch."), _counts(gg.dequantized_types))
    if gg.packed_types:
        log.info("GGUF %s: kept packed: %s", source.path.name, _counts(gg.packed_types))
    weights = arch.adapt_gguf_weights(gg.weights, spec)
    return LoadedModel(config, spec, arch.build_graph(spec, weights), arch.build_graph,
                       gg.packed_types,
                       gg.dequantized_types)


def _counts(c: Counter) -> str:
    return ", ".join(f"{name} x{n}" for name, n in sorted(c.items()))
