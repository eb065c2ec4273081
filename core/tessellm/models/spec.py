"""ModelSpec: the architecture facts the graph builders need, read from an HF config.json."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tessellm.errors import UnsupportedModelError
from tessellm.models.rope_scaling import context_length, rope_cos_sin, scaling_type


@dataclass(slots=True, frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()

    @property
    def attention_dims(self) -> dict[str, int]:
        """The kernel-query dims of rotary and attention nodes."""
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim}

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def rope_cos_sin(self) -> torch.Tensor:
        """[max_position_embeddings, head_dim] float32: cos | sin of each position's angles."""
        return rope_cos_sin(self.head_dim, self.rope_theta, self.max_position_embeddings,
                            dict(self.rope_scaling))


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def _rope_settings(config: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...]]:
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older "rope_scaling".
    params = config.get("rope_parameters") or {}
    theta = float(_get(config, "rope_theta", default=params.get("rope_theta", 10000.0)))
    scaling = dict(config.get("rope_scaling") or {})
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        kind = scaling_type(scaling)
        if kind == "dynamic":   # transformers scales from max_position_embeddings
            scaling.setdefault("original_max_position_embeddings",
                               int(config.get("max_position_embeddings", 2048)))
        if kind == "yarn" and scaling.get("factor") is None:
            scaling["factor"] = (int(config["max_position_embeddings"])
                                 / float(scaling["original_max_position_embeddings"]))
    return theta, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                               for k, v in scaling.items()))


def llama_family_spec(config: dict[str, Any]) -> ModelSpec:
    """Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm) share one block structure."""
    arch = config["architectures"][0]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    theta, scaling = _rope_settings(config)
    is_qwen2, is_qwen3 = arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"
    max_pos = context_length(int(config.get("max_position_embeddings", 2048)), dict(scaling))
    window = config.get("sliding_window")
    if window and (config.get("use_sliding_window", arch == "MistralForCausalLM")) and window < max_pos:
        # Sliding-window attention is not implemented: cap the context so it never applies.
        max_pos = int(window)
    return ModelSpec(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bool(config.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=is_qwen3,
        rope_theta=theta,
        rope_scaling=scaling,
    )


def gpt2_spec(config: dict[str, Any]) -> ModelSpec:
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"GPT2LMHeadModel: activation {act!r} is not supported")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise UnsupportedModelError(
            "GPT2LMHeadModel: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
            "are not supported")
    hidden = int(config["n_embd"])
    heads = int(config["n_head"])
    return ModelSpec(
        architecture="GPT2LMHeadModel",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(config.get("n_inner") or 4 * hidden),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(config.get("n_positions", 1024)),
        tie_word_embeddings=True,
        qkv_bias=True, o_bias=True, mlp_bias=True,
    )
