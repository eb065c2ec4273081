"""The HF-style config dict of a GGUF file's metadata (`architectures`, `hidden_size`, ...), so
the architectures' spec readers serve GGUF and safetensors alike. A missing required key or a
value of the wrong kind is a ModelLoadError naming it; an architecture or rope scaling
tessellm does not run is an UnsupportedModelError. Small F32 tensors that are settings, not
weights (CONFIG_TENSORS: Llama 3.1's rope_freqs, phi3's longrope factors), are read into the
config here."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.gguf_gemma import GEMMA_GGUF_ARCHITECTURES, gemma_config
from tessellm.models.gguf_moe import MOE_GGUF_ARCHITECTURES, is_moe_file, moe_config
from tessellm.models.gguf_reader import metadata_field

GGUF_ARCHITECTURES = {**MOE_GGUF_ARCHITECTURES, **GEMMA_GGUF_ARCHITECTURES,
                      "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gpt2": "GPT2LMHeadModel", "phi3": "Phi3ForCausalLM"}
_PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
CONFIG_TENSORS = ("rope_freqs.weight",) + _PHI3_ROPE_FACTORS   # read into the config
_REQUIRED = object()


def _architecture(reader: Any) -> str:
    arch = metadata_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))})")
    return arch


def gguf_config(reader: Any) -> dict[str, Any]:
    """The HF-style config dict of the file's metadata."""
    a = _architecture(reader)

    def num(key: str, kind: type, default: Any = _REQUIRED) -> Any:
        """Metadata `{arch}.{key}` as `kind` (int or float); a per-layer array's first value."""
        value = metadata_field(reader, f"{a}.{key}")
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"GGUF metadata lacks {a}.{key}")
            return default
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, (str, bytes, list, bool)) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"GGUF metadata {a}.{key} must be a number, got {value!r}")
        return kind(value)

    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    # the embedding's rows are the model's vocabulary (they may exceed the tokenizer's)
    vocab = (int(embd.shape[-1]) if embd is not None and len(embd.shape) == 2
             else num("vocab_size", int, len(tokens.data) if tokens else None))
    if vocab is None:
        raise ModelLoadError(f"GGUF metadata lacks {a}.vocab_size and tokenizer.ggml.tokens")
    hidden, heads = num("embedding_length", int), num("attention.head_count", int)
    kv_heads = num("attention.head_count_kv", int, heads)
    layers = num("block_count", int)
    for key, value in (("embedding_length", hidden), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("block_count", layers)):
        if value < 1:
            raise ModelLoadError(f"GGUF metadata {a}.{key} must be >= 1, got {value}")
    if heads % kv_heads:
        raise ModelLoadError(f"GGUF metadata {a}.attention.head_count ({heads}) is not a "
                             f"multiple of {a}.attention.head_count_kv ({kv_heads})")
    special = {k: v for k in ("bos_token_id", "eos_token_id")
               if isinstance(v := metadata_field(reader, f"tokenizer.ggml.{k}"), int) and 0 <= v < vocab}
    common = {"vocab_size": vocab, "torch_dtype": "float32", **special}
    if a == "gpt2":
        return {"architectures": [GGUF_ARCHITECTURES[a]], "n_embd": hidden,
                "n_layer": layers, "n_head": heads,
                "n_positions": num("context_length", int),
                "n_inner": num("feed_forward_length", int),
                "layer_norm_epsilon": num("attention.layer_norm_epsilon", float),
                "activation_function": "gelu_new", **common}
    head_dim = num("attention.key_length", int, hidden // heads)
    rope_dims = num("rope.dimension_count", int, head_dim)
    if rope_dims != head_dim:
        raise UnsupportedModelError(f"GGUF {a}: partial rotary ({rope_dims} of {head_dim} "
                                    "dims) is not supported")
    config = {
        "architectures": [GGUF_ARCHITECTURES[a]], "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": num("feed_forward_length", int),
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", float),
        "max_position_embeddings": num("context_length", int),
        "rope_theta": num("rope.freq_base", float, 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu", **common}
    window = metadata_field(reader, f"{a}.attention.sliding_window")
    if window:
        config["sliding_window"] = num("attention.sliding_window", int)
    scaling = metadata_field(reader, f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear",
                                      "factor": num("rope.scaling.factor", float)}
        elif scaling == "yarn":
            yarn = {"rope_type": "yarn", "factor": num("rope.scaling.factor", float),
                    "original_max_position_embeddings":
                        num("rope.scaling.original_context_length", int)}
            for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                value = num(f"rope.scaling.{key}", float, None)
                if value is not None:
                    yarn[name] = value
            config["rope_scaling"] = yarn
            config["max_position_embeddings"] = max(
                config["max_position_embeddings"],
                int(yarn["original_max_position_embeddings"] * yarn["factor"]))
        else:
            raise UnsupportedModelError(f"GGUF {a}: rope scaling {scaling!r} is not supported "
                                        "(supported: none, linear, yarn, and rope_freqs "
                                        "factors)")
    if a == "phi3":
        _phi3_rope(config, tensors, num)
    if a in GEMMA_GGUF_ARCHITECTURES:   # tessellm.models.gguf_gemma
        return gemma_config(a, config, num, lambda key: metadata_field(reader, f"{a}.{key}"),
                            tensors)
    if is_moe_file(a, num):
        config.update(moe_config(a, num, tensors, layers))
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:   # llama.cpp's Llama 3.1+ files: a divisor per rotary frequency
        if "rope_scaling" in config:
            raise UnsupportedModelError(f"GGUF {a}: rope_freqs together with rope scaling "
                                        f"{scaling!r} is not supported")
        if int(freqs.tensor_type) != 0 or int(np.prod(freqs.shape)) != head_dim // 2:
            raise ModelLoadError(f"GGUF {a}: rope_freqs.weight must be {head_dim // 2} F32 "
                                 f"values (head_dim / 2), got {list(freqs.shape)} of type "
                                 f"{freqs.tensor_type.name}")
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelLoadError(f"GGUF {a}: rope_freqs.weight holds factors that are not "
                                 "finite and positive")
        config["rope_scaling"] = {"rope_type": "freq_factors",
                                  "factors": [float(f) for f in factors]}
    return config


def _phi3_rope(config: dict[str, Any], tensors: dict[str, Any], num: Callable) -> None:
    """llama.cpp's phi3 files: longrope as two F32 tensors of head_dim / 2 factors
    (rope_factors_long / _short, both or neither) with `rope.scaling.attn_factor` and
    `rope.scaling.original_context_length` (no rope.scaling.type)."""
    found = [n for n in _PHI3_ROPE_FACTORS if n in tensors]
    if not found:
        return
    if len(found) == 1:
        raise ModelLoadError(f"GGUF phi3: {found[0]} without its pair "
                             f"({', '.join(n for n in _PHI3_ROPE_FACTORS if n not in found)})")
    half = config["head_dim"] // 2
    factors = {}
    for name, key in zip(_PHI3_ROPE_FACTORS, ("long_factor", "short_factor")):
        t = tensors[name]
        if int(t.tensor_type) != 0 or int(np.prod(t.shape)) != half:
            raise ModelLoadError(f"GGUF phi3: {name} must be {half} F32 values (head_dim / "
                                 f"2), got {list(t.shape)} of type {t.tensor_type.name}")
        factors[key] = [float(f) for f in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    config["original_max_position_embeddings"] = num("rope.scaling.original_context_length",
                                                     int)
    config["rope_scaling"] = {"rope_type": "longrope", **factors}
    attn = num("rope.scaling.attn_factor", float, None)
    if attn is not None:
        config["rope_scaling"]["attention_factor"] = attn
