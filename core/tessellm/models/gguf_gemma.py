"""Gemma 2 / Gemma 3 GGUF files (llama.cpp's `gemma2`, `gemma3`): their metadata as the
HF-style config tessellm.models.gemma reads, and their tensor names.

What llama.cpp's converter writes, and what it leaves to fixed rules its loader applies:
- Norm weights are stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w), every one of them
  (attn_norm, post_attention_norm, ffn_norm = the pre-feed-forward norm, post_ffw_norm,
  attn_q_norm / attn_k_norm, output_norm): they are read as they are
  (gemma.adapt_gemma_gguf_weights adds no 1).
- `attention.key_length` is head_dim; `attention.sliding_window` the window (gemma2: 4096 when
  absent, as llama.cpp and transformers default; gemma3: absent means no sliding layer, the
  converter leaves it out for sliding_window_pattern 1).
- Which layers slide: `attention.sliding_window_pattern` where written (a period p: layer i
  slides iff p == 0 or i % p < p - 1; or one bool per layer, true = sliding); else llama.cpp's
  fixed periods, 2 for gemma2 and 6 for gemma3, which are transformers' defaults too.
- `attn_logit_softcapping` / `final_logit_softcapping`: gemma2's, 50 / 30 when absent (llama.cpp's
  and transformers' defaults); gemma3's final cap only where written (none by default), and an
  attention cap the converter never writes (read where present, as transformers applies it).
- Rope: `rope.freq_base` (10000 when absent, llama.cpp's default; gemma2's converter writes
  none) and `rope.scaling.*` are the global layers' (gemma3 applies the scaling to full layers
  only); gemma3's sliding layers rotate with `rope.freq_base_swa`, 10000 when absent (the
  converter writes none), unscaled. A gemma2 file whose freq_base_swa differs from freq_base
  is refused (Gemma 2 has one rope table).
- query_pre_attn_scalar is not stored: llama.cpp derives the attention scale from the layer
  count, hidden / heads for the 27B models (gemma2 46 layers, gemma3 62) and head_dim for every
  other size; tessellm derives it alike, which is what every released checkpoint's config
  says (256, 144 = 4608 / 32, 168 = 5376 / 32). transformers' GGUF loader reads no such key and
  takes its class default 256, which is wrong for the 27B models.
Refused by name: biases (no Gemma checkpoint has any), `rope_freqs`, value / key lengths that
differ from head_dim (key_length_swa and the like).
"""
from __future__ import annotations

from typing import Any, Callable

from tessellm.errors import ModelLoadError, UnsupportedModelError

GEMMA_GGUF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_DEFAULT_PERIOD = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}   # llama.cpp's 27B, scaled by hidden / heads

GEMMA_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}


def sliding_layer_flags(arch: str, layers: int, pattern: Any) -> list[bool]:
    """Per layer, whether it slides: `pattern` is the file's sliding_window_pattern (None:
    the architecture's fixed period)."""
    if pattern is None:
        pattern = _DEFAULT_PERIOD[arch]
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise ModelLoadError(f"GGUF {arch}: attention.sliding_window_pattern must be one "
                                 f"bool per layer ({layers}), got {pattern!r}")
        return list(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ModelLoadError(f"GGUF {arch}: attention.sliding_window_pattern must be a period "
                             f"(an integer >= 0) or one bool per layer, got {pattern!r}")
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def gemma_config(arch: str, config: dict[str, Any], num: Callable[..., Any],
                 field: Callable[[str], Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The Gemma keys of the HF-style config, over the generic ones gguf_file read (`num`:
    a numeric `{arch}.` key, `field`: any `{arch}.` key's raw value)."""
    gemma3 = arch == "gemma3"
    head_dim, layers = config["head_dim"], config["num_hidden_layers"]
    biases = sorted(n for n in tensors if n.endswith(".bias"))
    if biases:
        raise UnsupportedModelError(f"GGUF {arch}: bias tensors are not supported "
                                    f"({', '.join(biases[:3])})")
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError(f"GGUF {arch}: rope_freqs is not supported")
    for key in ("attention.value_length", "attention.key_length_swa",
                "attention.value_length_swa"):
        value = num(key, int, head_dim)
        if value != head_dim:
            raise UnsupportedModelError(f"GGUF {arch}: {key} {value} differs from key_length "
                                        f"{head_dim} (not supported)")
    out = {k: v for k, v in config.items() if k not in ("hidden_act", "sliding_window")}
    out["architectures"] = [GEMMA_GGUF_ARCHITECTURES[arch]]
    out["hidden_activation"] = "gelu_pytorch_tanh"
    window = num("attention.sliding_window", int, None if gemma3 else 4096)
    flags = sliding_layer_flags(arch, layers, field("attention.sliding_window_pattern"))
    if window:
        out["sliding_window"] = window
    out["layer_types"] = ["sliding_attention" if f and window else "full_attention"
                          for f in flags]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = num(key, float, None)
        if cap is not None or gemma3:   # gemma2: absent keys take the 50 / 30 defaults
            out[key] = cap or None
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    out["query_pre_attn_scalar"] = hidden // heads if layers == _LAYERS_27B[arch] else head_dim
    local = num("rope.freq_base_swa", float, None)
    if gemma3:
        out["rope_local_base_freq"] = 10000.0 if local is None else local
    elif local is not None and local != config["rope_theta"]:
        raise UnsupportedModelError(f"GGUF gemma2: rope.freq_base_swa {local} differs from "
                                    f"rope.freq_base {config['rope_theta']} (Gemma 2 has one "
                                    "rope table)")
    return out


def gemma_expected_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Gemma stems beyond the Llama family's (whose shapes they share)."""
    h = c["hidden_size"]
    return {"blk.{i}.post_attention_norm": (h,), "blk.{i}.post_ffw_norm": (h,)}


def gemma_required(arch: str) -> list[str]:
    """The per-layer stems every layer of a Gemma file must have."""
    return (["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm",
             "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
            + (["attn_q_norm", "attn_k_norm"] if arch == "gemma3" else []))
