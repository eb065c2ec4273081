"""ModelSpec: the architecture facts the graph builders need, read from an HF config.json."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessellm.cache.kv_groups import KVCacheLayout
from tessellm.errors import UnsupportedModelError
from tessellm.models.rope_scaling import context_length, rope_cos_sin, scaling_type

if TYPE_CHECKING:
    from tessellm.models.moe import MoESpec


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
    moe: "MoESpec | None" = None     # the expert layers of a mixture-of-experts model
    # sliding-window attention: a windowed layer's query at position p sees the keys at
    # positions > p - sliding_window (0: no window); sliding_layers are those layers (HF's
    # "sliding_attention" layer types)
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    attn_logit_softcap: float = 0.0      # scores = cap tanh(scores / cap) (0: none)
    final_logit_softcap: float = 0.0     # logits = cap tanh(logits / cap) (0: none)
    query_scale: float = 0.0             # the attention scale (0: 1 / sqrt(head_dim))

    @property
    def attention_dims(self) -> dict[str, int]:
        """The kernel-query dims of rotary and attention nodes."""
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim}

    @property
    def attention_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to every earlier key)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def layer_attention(self, layer: int) -> tuple[dict[str, int], tuple[Any, ...]]:
        """(kernel-query dims, extra arguments after the scale) of `layer`'s attention node:
        the window and soft-cap arguments and their dims where the layer has either."""
        from tessellm.graph.ops import attention_feature_dims
        window, cap = self.layer_window(layer), self.attn_logit_softcap
        dims = {**self.attention_dims, **attention_feature_dims(window, cap)}
        return dims, ((window, cap) if window or cap else ())

    @property
    def kv_layout(self) -> KVCacheLayout:
        """The model's block-table groups and KV tensors (tessellm.cache.kv_groups): several
        groups where windowed and full layers mix (Gemma 2 / 3)."""
        return KVCacheLayout.of([self.layer_window(i) for i in range(self.num_layers)])

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer has the sliding window (Mistral v0.1): KV blocks wholly out of every
        sequence's window can be freed."""
        return self.sliding_window > 0 and len(self.sliding_layers) == self.num_layers

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
    window, sliding = sliding_window_layers(config, arch, int(config["num_hidden_layers"]),
                                            max_pos)
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
        sliding_window=window,
        sliding_layers=sliding,
    )


_QWEN_WINDOW_RULE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                     "Qwen3MoeForCausalLM")


def sliding_window_layers(config: dict[str, Any], arch: str, num_layers: int,
                          max_positions: int, default_types: list[str] | None = None
                          ) -> tuple[int, tuple[int, ...]]:
    """(window, windowed layers) as transformers 5 reads them: `layer_types` where the config
    has them ("sliding_attention" / "full_attention"), else `default_types` (Gemma's
    patterns), else Qwen's rule (use_sliding_window, layers from max_window_layers on), else
    every layer when the config has a `sliding_window` that is used (Mistral by default;
    others with use_sliding_window). A window that covers max_positions never bites: (0, ())."""
    window = config.get("sliding_window")
    types = config.get("layer_types") or default_types
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"sliding_attention",
                                                          "full_attention"}:
            raise UnsupportedModelError(
                f"{arch}: layer_types {types!r} (want {num_layers} of sliding_attention / "
                "full_attention)")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if layers and not window:
            raise UnsupportedModelError(f"{arch}: sliding_attention layers without a "
                                        "sliding_window")
    elif not window:
        layers = ()
    elif arch in _QWEN_WINDOW_RULE:
        first = int(config.get("max_window_layers", 28))
        layers = tuple(range(first, num_layers)) if config.get("use_sliding_window") else ()
    elif config.get("use_sliding_window", arch in ("MistralForCausalLM",
                                                   "MixtralForCausalLM")):
        layers = tuple(range(num_layers))
    else:
        layers = ()
    if not layers or int(window) >= max_positions:
        return 0, ()
    return int(window), layers


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
