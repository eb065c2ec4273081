"""Phi-3 / Phi-3.5 (mini) (`Phi3ForCausalLM`): the Llama block over fused checkpoint weights.

Phi-3's layer is Llama's (RMSNorm, silu gate/up MLP, no biases, half-split rotary); only its
checkpoint fuses two pairs of linears, by rows:

    self_attn.qkv_proj  [q | k | v]    rows H*d, Hkv*d, Hkv*d  -> q_proj, k_proj, v_proj
    mlp.gate_up_proj    [gate | up]    rows I, I               -> gate_proj, up_proj

The adapter splits them (row ranges of the fused tensor, so a packed GGUF tensor stays
packed: a row is whole blocks) and the Llama builder builds the graph unfused; the qkv and
gate/up passes fuse them again where the device has the kernels. llama.cpp's `phi3` files
store the same two tensors (`attn_qkv`, `ffn_up` holding gate then up), which
tessellm.models.gguf_file maps to these HF names, so one adapter serves both formats.

The spec is llama_family_spec's over a normalized config (so its sliding-window handling
applies unchanged): Phi-3 applies `sliding_window` whenever it is set (transformers' Phi3
has no `use_sliding_window`), its rope is default or longrope ("su" and, as transformers
reads Phi-3 configs, "yarn" are longrope), with `original_max_position_embeddings` read from
the top level of the config (default 4096) and `factor` = max_position_embeddings / original
unless given. Refused by name: partial_rotary_factor != 1 (Phi-4-mini), any other rope type,
hidden_act other than silu (llama_family_spec).
"""
from __future__ import annotations

from typing import Any

import torch

from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.llama import adapt_llama_weights
from tessellm.models.rope_scaling import longrope_factors
from tessellm.models.spec import ModelSpec, llama_family_spec
from tessellm.quant.formats import PackedWeight

ARCH = "Phi3ForCausalLM"
_ORIGINAL_DEFAULT = 4096   # Phi3Config's original_max_position_embeddings

Weight = torch.Tensor | PackedWeight


def phi3_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = dict(config)
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"{ARCH}: partial_rotary_factor {partial} is not "
                                    "supported (only 1.0: rotary over the whole head)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("su", "yarn", "longrope"):
        cfg["rope_scaling"] = _longrope_scaling(config, params)
    elif kind == "default":
        cfg["rope_scaling"] = None
        cfg["rope_parameters"] = {"rope_type": "default",
                                  "rope_theta": params.get("rope_theta",
                                                           config.get("rope_theta", 10000.0))}
    else:
        raise UnsupportedModelError(f"{ARCH}: rope type {kind!r} is not supported (Phi-3 "
                                    "has default or longrope)")
    if cfg.get("sliding_window") is not None:
        cfg["use_sliding_window"] = True
    spec = llama_family_spec(cfg)
    if spec.rope_scaling:
        longrope_factors(dict(spec.rope_scaling), spec.head_dim)   # refused before any load
    return spec


def _longrope_scaling(config: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    orig = int(config.get("original_max_position_embeddings") or _ORIGINAL_DEFAULT)
    scaling = {k: v for k, v in params.items()
               if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = "longrope"
    scaling["original_max_position_embeddings"] = orig
    if scaling.get("factor") is None:
        scaling["factor"] = int(config.get("max_position_embeddings", orig)) / orig
    return scaling


def split_rows(w: Weight, sizes: list[int], name: str) -> list[Weight]:
    """Consecutive row ranges of `w` of the given sizes (views; a PackedWeight stays packed)."""
    if w.shape[0] != sum(sizes):
        raise ModelLoadError(f"{name} has {w.shape[0]} rows, the config implies "
                             f"{' + '.join(map(str, sizes))} = {sum(sizes)}")
    out, start = [], 0
    for n in sizes:
        out.append(w.with_data(w.data[start:start + n]) if isinstance(w, PackedWeight)
                   else w[start:start + n])
        start += n
    return out


def adapt_phi3_weights(weights: dict[str, Weight], spec: ModelSpec) -> dict[str, Weight]:
    """qkv_proj -> q/k/v_proj and gate_up_proj -> gate/up_proj per layer, then Llama's
    adapter (the rope table). Serves safetensors and GGUF weights (both under HF names)."""
    out = dict(weights)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for i in range(spec.num_layers):
        for fused, parts, sizes in (
                (f"model.layers.{i}.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
                 [q, kv, kv]),
                (f"model.layers.{i}.mlp.gate_up_proj", ("gate_proj", "up_proj"),
                 [spec.intermediate_size] * 2)):
            name = f"{fused}.weight"
            if name not in out:
                raise ModelLoadError(f"{ARCH} checkpoint lacks {name}")
            stem = fused.rpartition(".")[0]
            for part, w in zip(parts, split_rows(out.pop(name), sizes, name)):
                out[f"{stem}.{part}.weight"] = w
    return adapt_llama_weights(out, spec)
