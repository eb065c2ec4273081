"""The architecture "MetaLlamaForCausalLM": a Llama checkpoint in Meta's original layout
(params.json's names in config.json, `layers.{i}.attention.wq.weight`-style tensors, rotary
rows interleaved pairwise), served by tessellm's own Llama graph.

Three functions make an architecture: read the config into a ModelSpec, adapt the checkpoint's
tensors to the names and layout the graph reads, build the graph. Here the first two are new
and the third is the public Llama builder.
"""
from __future__ import annotations

from typing import Any

import torch

from tessellm.plugin_api import (
    Architecture,
    ModelSpec,
    adapt_llama_weights,
    build_llama_graph,
    hookimpl,
)

TESSELLM_API_VERSION = "1.3"
NAME = "MetaLlamaForCausalLM"


def meta_llama_spec(config: dict[str, Any]) -> ModelSpec:
    """params.json's keys -> the facts the Llama graph needs."""
    dim, heads = int(config["dim"]), int(config["n_heads"])
    return ModelSpec(
        architecture=NAME,
        vocab_size=int(config["vocab_size"]),
        hidden_size=dim,
        num_layers=int(config["n_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("n_kv_heads") or heads),
        head_dim=dim // heads,
        intermediate_size=int(config["hidden_dim"]),
        norm_eps=float(config.get("norm_eps", 1e-5)),
        max_position_embeddings=int(config.get("max_seq_len", 2048)),
        tie_word_embeddings=False,          # Meta's checkpoints carry output.weight
        rope_theta=float(config.get("rope_theta", 10000.0)),
    )


def rotary_rows_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta rotates pairs (x0, x1), (x2, x3), ...; the graph's rotary (as in transformers)
    rotates the halves (x0, x_{d/2}), ...: reorder each head's rows from pairs to halves."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def adapt_meta_weights(weights: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Meta's tensor names and rotary layout -> the Llama graph's, then the Llama adapter
    (which adds the rope table)."""
    top = {"tok_embeddings.weight": "model.embed_tokens.weight",
           "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    per_layer = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                 "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                 "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
                 "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
    out = {}
    for name, tensor in weights.items():
        if name in top:
            out[top[name]] = tensor
            continue
        _, layer, rest = name.split(".", 2)                  # layers.{i}.{rest}
        part = rest.removesuffix(".weight")
        if part == "attention.wq":
            tensor = rotary_rows_to_halves(tensor, spec.num_heads)
        elif part == "attention.wk":
            tensor = rotary_rows_to_halves(tensor, spec.num_kv_heads)
        out[f"model.layers.{layer}.{per_layer[part]}.weight"] = tensor
    return adapt_llama_weights(out, spec)


ARCHITECTURE = Architecture(spec=meta_llama_spec, adapt_weights=adapt_meta_weights,
                            build_graph=build_llama_graph)


@hookimpl
def tessellm_architectures() -> dict[str, Architecture]:
    return {NAME: ARCHITECTURE}
