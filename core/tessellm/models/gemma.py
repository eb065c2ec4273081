"""Graph of Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`, and
the language model of a `Gemma3ForConditionalGeneration` checkpoint), built unfused.

    x = embed(ids) * sqrt(hidden)                    (the scale rounded to the compute dtype)
    per layer: x = x + post_attn_norm(o_proj(attn(rope(q, k), v)))   q/k/v from in_norm(x)
               x = x + post_ff_norm(down(gelu_tanh(gate(n)) * up(n)))  n = pre_ff_norm(x)
    logits = lm_head(norm(x))       (tied to the embedding; Gemma 2: cap tanh(logits / cap))

Every norm is Gemma's RMSNorm, x_normed * (1 + w) with the product in float32; it runs as the
plain rms_norm op over the weight 1 + w, made once at load (adapt_gemma_weights) in float32
and rounded to the compute dtype: the same float32 product in float32, and in bfloat16 one
more rounding (of 1 + w and of x_normed before the product). Attention: scale
query_pre_attn_scalar^-0.5, Gemma 2's attention logit soft-cap, the sliding window on the
layers the config marks "sliding_attention" (layer_types, or the pattern transformers
derives: every other layer for Gemma 2, five of six for Gemma 3). Gemma 3 adds per-head q/k
norms before rope, and its sliding layers rotate with their own table (rope_local_base_freq,
unscaled) while the full layers use rope_theta with the config's scaling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tessellm.errors import UnsupportedModelError
from tessellm.graph import ops
from tessellm.graph.ir import GraphBuilder, ModelGraph
from tessellm.models.rope_scaling import context_length, rope_cos_sin
from tessellm.models.spec import ModelSpec, _rope_settings, sliding_window_layers

COS_SIN = "rope.cos_sin"
LOCAL_COS_SIN = "rope.cos_sin.local"
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(slots=True, frozen=True)
class GemmaSpec(ModelSpec):
    gemma3: bool = False                 # q/k norms, a rope table of its own for sliding layers
    local_rope_theta: float = 0.0        # Gemma 3's sliding layers (rope_local_base_freq)
    local_rope_scaling: tuple[tuple[str, Any], ...] = ()

    def local_rope_cos_sin(self) -> torch.Tensor:
        return rope_cos_sin(self.head_dim, self.local_rope_theta, self.max_position_embeddings,
                            dict(self.local_rope_scaling))


def _text_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(architecture, the config of the text model): a Gemma3ForConditionalGeneration
    checkpoint's text_config, read as a Gemma3ForCausalLM's."""
    arch = config["architectures"][0]
    if arch == GEMMA3_MULTIMODAL:
        text = dict(config.get("text_config") or {})
        for key in ("tie_word_embeddings",):
            if key not in text and key in config:
                text[key] = config[key]
        return GEMMA3, text
    return arch, config


def _get(config: dict[str, Any], key: str, default: Any) -> Any:
    """config[key], transformers' class default when the key is absent (None stays None)."""
    return config[key] if key in config else default


def gemma_spec(config: dict[str, Any]) -> GemmaSpec:
    arch, cfg = _text_config(config)
    if arch not in (GEMMA2, GEMMA3):
        raise UnsupportedModelError(f"{arch} is not a Gemma 2 / Gemma 3 architecture")
    gemma3 = arch == GEMMA3
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise UnsupportedModelError(f"{arch}: hidden_activation {act!r} is not supported "
                                    "(only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{arch}: use_bidirectional_attention is not supported "
                                    "(tessellm attends causally)")
    hidden = int(_get(cfg, "hidden_size", 2304))
    heads = int(_get(cfg, "num_attention_heads", 8))
    layers = int(_get(cfg, "num_hidden_layers", 26))
    head_dim = int(_get(cfg, "head_dim", 256) or hidden // heads)
    max_pos = int(_get(cfg, "max_position_embeddings", 131072 if gemma3 else 8192))
    if gemma3:
        params = cfg.get("rope_parameters") or {}
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if cfg.get("rope_scaling"):
            full.update(cfg["rope_scaling"])
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        theta, scaling = _rope_settings({"rope_parameters": full,
                                         "max_position_embeddings": max_pos})
        local_theta, local_scaling = _rope_settings({"rope_parameters": local,
                                                     "max_position_embeddings": max_pos})
        pattern = int(cfg.get("sliding_window_pattern", 6))
        default_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                         for i in range(layers)]
    else:
        theta, scaling = _rope_settings(cfg)
        local_theta, local_scaling = 0.0, ()
        default_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                         for i in range(layers)]
    max_pos = context_length(max_pos, dict(scaling))
    window_cfg = {**cfg, "sliding_window": _get(cfg, "sliding_window", 4096)}
    window, sliding = sliding_window_layers(window_cfg, arch, layers, max_pos, default_types)
    attn_cap = _get(cfg, "attn_logit_softcapping", None if gemma3 else 50.0)
    final_cap = _get(cfg, "final_logit_softcapping", None if gemma3 else 30.0)
    bias = bool(cfg.get("attention_bias", False))
    return GemmaSpec(
        architecture=arch,
        vocab_size=int(_get(cfg, "vocab_size", 262208 if gemma3 else 256000)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", 4) or heads),
        head_dim=head_dim,
        intermediate_size=int(_get(cfg, "intermediate_size", 9216)),
        norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        qkv_bias=bias, o_bias=bias,
        qk_norm=gemma3,
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        sliding_layers=sliding,
        attn_logit_softcap=float(attn_cap or 0.0),
        final_logit_softcap=float(final_cap or 0.0),
        query_scale=float(_get(cfg, "query_pre_attn_scalar", 256)) ** -0.5,
        gemma3=gemma3,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


# A Gemma3ForConditionalGeneration checkpoint's text model, under either layout transformers
# has saved: its prefix -> the Gemma3ForCausalLM name's
_MULTIMODAL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def _text_weight_name(name: str) -> str | None:
    """The Gemma3ForCausalLM name of a multimodal checkpoint's weight (None: the vision
    tower's or the projector's, which the text model does not read)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _MULTIMODAL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def is_gemma_norm(name: str) -> bool:
    """Every Gemma RMSNorm weight (layer norms, q/k norms, the final norm) ends so."""
    return name.endswith("norm.weight")


def adapt_gemma_weights(weights: dict[str, torch.Tensor], spec: ModelSpec
                        ) -> dict[str, torch.Tensor]:
    """HF names (a multimodal checkpoint's text model renamed, its vision weights dropped);
    every norm weight w becomes 1 + w (float32 sum, then the load dtype); the rope tables."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        new = _text_weight_name(name)
        if new is None or new.endswith("rotary_emb.inv_freq"):
            continue
        out[new] = (1.0 + w.float()).to(w.dtype) if is_gemma_norm(new) else w
    return add_rope_tables(out, spec)


def add_rope_tables(weights: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    weights[COS_SIN] = spec.rope_cos_sin()
    if isinstance(spec, GemmaSpec) and spec.gemma3:
        weights[LOCAL_COS_SIN] = spec.local_rope_cos_sin()
    return weights


def build_gemma_graph(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> ModelGraph:
    if not isinstance(spec, GemmaSpec):
        raise UnsupportedModelError(f"the Gemma graph needs a GemmaSpec, got {type(spec)}")
    b = GraphBuilder(weights)
    inp = b.step_inputs(spec.num_layers, spec.kv_layout.layer_groups)
    h = spec.hidden_size
    norm = {"hidden": h}
    cos_sin = b.weight(COS_SIN)
    local_cos_sin = b.weight(LOCAL_COS_SIN) if spec.gemma3 else cos_sin

    def rms(x, name: str, role: str, layer: int | None):
        return b.op(ops.rms_norm, x, b.weight(name), spec.norm_eps, dims=norm, role=role,
                    layer=layer)

    x = b.embedding(inp.input_ids, "model.embed_tokens.weight", role="embed")
    x = b.op(ops.mul_scalar, x, math.sqrt(h), dims={"features": h}, role="embed_scale")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        n = rms(x, f"{p}.input_layernorm.weight", "input_norm", i)
        q = b.linear(n, f"{p}.self_attn.q_proj", role="q_proj", layer=i, bias=spec.qkv_bias)
        k = b.linear(n, f"{p}.self_attn.k_proj", role="k_proj", layer=i, bias=spec.qkv_bias)
        v = b.linear(n, f"{p}.self_attn.v_proj", role="v_proj", layer=i, bias=spec.qkv_bias)
        if spec.qk_norm:
            q, k = (b.call(ops.merge_heads, b.op(
                ops.rms_norm, b.call(ops.per_head, t, spec.head_dim),
                b.weight(f"{p}.self_attn.{name}.weight"), spec.norm_eps,
                dims={"hidden": spec.head_dim, "heads": heads}, role=name, layer=i))
                for t, name, heads in ((q, "q_norm", spec.num_heads),
                                       (k, "k_norm", spec.num_kv_heads)))
        table = local_cos_sin if spec.layer_window(i) else cos_sin
        qk = b.op(ops.rotary_embedding, inp.positions, q, k, table, spec.head_dim,
                  dims=spec.attention_dims, role="rope", layer=i)
        attn_dims, attn_extra = spec.layer_attention(i)
        attn = b.op(ops.attention, b.item(qk, 0), b.item(qk, 1), v, inp.kv_caches[i],
                    inp.meta_of(i), spec.attention_scale, *attn_extra, dims=attn_dims,
                    role="attention", layer=i)
        o = b.linear(attn, f"{p}.self_attn.o_proj", role="o_proj", layer=i, bias=spec.o_bias)
        o = rms(o, f"{p}.post_attention_layernorm.weight", "post_attention_norm", i)
        x = b.op(ops.add, o, x, dims=norm, role="attn_residual", layer=i)
        n = rms(x, f"{p}.pre_feedforward_layernorm.weight", "pre_feedforward_norm", i)
        gate = b.linear(n, f"{p}.mlp.gate_proj", role="gate_proj", layer=i, bias=False)
        up = b.linear(n, f"{p}.mlp.up_proj", role="up_proj", layer=i, bias=False)
        inter = {"features": spec.intermediate_size}
        act = b.op(ops.mul, b.op(ops.gelu_tanh, gate, dims=inter, role="act", layer=i), up,
                   dims=inter, role="act_mul", layer=i)
        down = b.linear(act, f"{p}.mlp.down_proj", role="down_proj", layer=i, bias=False)
        down = rms(down, f"{p}.post_feedforward_layernorm.weight", "post_feedforward_norm", i)
        x = b.op(ops.add, down, x, dims=norm, role="mlp_residual", layer=i)
    x = rms(x, "model.norm.weight", "final_norm", None)
    last = b.call(ops.select_rows, x, inp.logits_indices)
    head = "model.embed_tokens" if spec.tie_word_embeddings or "lm_head.weight" not in weights \
        else "lm_head"
    logits = b.linear(last, head, role="lm_head", layer=None, bias=False)
    if spec.final_logit_softcap:
        logits = b.op(ops.logit_softcap, logits, spec.final_logit_softcap,
                      dims={"features": spec.vocab_size}, role="final_softcap")
    b.output(logits)
    return ModelGraph(b.graph, weights, spec.num_layers)


def adapt_gemma_gguf_weights(weights: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """A GGUF file's weights arrive under the graph's names with llama.cpp's norm weights,
    which its converter stores as 1 + w already: only the rope tables are added."""
    return add_rope_tables(dict(weights), spec)
