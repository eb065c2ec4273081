"""Mixture-of-experts GGUF files (llama.cpp's `qwen2moe`, `qwen3moe`, and `llama` with
`expert_count`, i.e. Mixtral): their metadata as an HF-style config and their tensors under
the graph's names (tessellm.models.moe).

llama.cpp stores each layer's experts stacked in 3-D tensors `ffn_{gate,up,down}_exps`
([E, I, H] and [E, H, I] in HF's order; the loader reads them as 2-D stacks of rows), the
router as `ffn_gate_inp` [E, H] and Qwen2-MoE's shared expert as `ffn_{gate,up,down}_shexp`
with its gate `ffn_gate_inp_shexp` [H]. Routing as llama.cpp's graphs do it: Mixtral and
Qwen3-MoE renormalize the chosen weights, Qwen2-MoE does not. A layer without a router
keeps a dense MLP (`mlp_only_layers`). The per-expert tensors of early Mixtral files
(`ffn_gate.{e}`) are not read (the loader names them as unknown tensors).
"""
from __future__ import annotations

from typing import Any, Callable

from tessellm.errors import ModelLoadError

MOE_GGUF_ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}

MOE_NAMES = {
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.gate",
    "blk.{i}.ffn_gate_exps": "model.layers.{i}.mlp.experts.gate_proj",
    "blk.{i}.ffn_up_exps": "model.layers.{i}.mlp.experts.up_proj",
    "blk.{i}.ffn_down_exps": "model.layers.{i}.mlp.experts.down_proj",
    "blk.{i}.ffn_gate_shexp": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "blk.{i}.ffn_up_shexp": "model.layers.{i}.mlp.shared_expert.up_proj",
    "blk.{i}.ffn_down_shexp": "model.layers.{i}.mlp.shared_expert.down_proj",
    "blk.{i}.ffn_gate_inp_shexp": "model.layers.{i}.mlp.shared_expert_gate",
}
EXPERT_STEMS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_STEMS = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")


def is_moe_file(arch: str, num: Callable[..., Any]) -> bool:
    return arch in MOE_GGUF_ARCHITECTURES or (arch == "llama"
                                               and num("expert_count", int, 0) > 0)


def moe_config(arch: str, num: Callable[..., Any], tensors: dict[str, Any],
               layers: int) -> dict[str, Any]:
    """The MoE keys of the HF-style config (merged over the dense family's)."""
    experts, used = num("expert_count", int), num("expert_used_count", int)
    if not 1 <= used <= experts:
        raise ModelLoadError(f"GGUF {arch}: expert_used_count {used} must lie in "
                             f"1..expert_count ({experts})")
    dense_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if arch == "llama":
        if dense_layers:
            raise ModelLoadError(f"GGUF llama with experts: layer(s) {dense_layers[:5]} lack "
                                 "ffn_gate_inp (Mixtral routes every layer)")
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
                "num_experts_per_tok": used}
    config = {"architectures": [MOE_GGUF_ARCHITECTURES[arch]], "num_experts": experts,
              "num_experts_per_tok": used, "mlp_only_layers": dense_layers,
              "moe_intermediate_size": num("expert_feed_forward_length", int),
              "norm_topk_prob": arch == "qwen3moe"}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = num("expert_shared_feed_forward_length",
                                                        int, 0)
    return config


def moe_expected_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF stem -> the shape (HF order) of its tensors in an expert layer."""
    h = c["hidden_size"]
    e = c.get("num_experts") or c["num_local_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    shared = c.get("shared_expert_intermediate_size") or 0
    return {"blk.{i}.ffn_gate_inp": (e, h), "blk.{i}.ffn_gate_exps": (e, inter, h),
            "blk.{i}.ffn_up_exps": (e, inter, h), "blk.{i}.ffn_down_exps": (e, h, inter),
            "blk.{i}.ffn_gate_shexp": (shared, h), "blk.{i}.ffn_up_shexp": (shared, h),
            "blk.{i}.ffn_down_shexp": (h, shared), "blk.{i}.ffn_gate_inp_shexp": (h,)}


def moe_required(c: dict[str, Any], layer: int) -> list[str]:
    """The MLP stems layer `layer` of a MoE file must have."""
    if layer in (c.get("mlp_only_layers") or ()):
        return ["ffn_gate", "ffn_up", "ffn_down"]
    return list(EXPERT_STEMS) + (list(SHARED_STEMS)
                                 if c.get("shared_expert_intermediate_size") else [])
