"""GGUF files written from Hugging Face models, as llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf` converts a transformers model (random weights from hf_fixtures, or any HF model
directory) of the llama, qwen2, qwen3, gpt2, phi3, MoE or gemma2 / gemma3 family into a GGUF
file:
- tensor names: token_embd, blk.N.attn_q/k/v/output (+ .bias where HF has one),
  attn_q_norm/attn_k_norm (qwen3), attn_norm, ffn_norm, ffn_gate/up/down, output_norm, output
  (left out when the head is tied, as the converter does); gpt2: position_embd, the fused
  attn_qkv [3 * hidden, hidden], attn_output, ffn_up, ffn_down (HF Conv1D weights are
  [in, out] and get transposed), norms with biases, and `output` (the converter writes the tied
  head out as its own tensor);
- phi3 (Phi3MiniModel): the fused attn_qkv and ffn_up ([gate | up] rows) as HF stores them,
  `rope.scaling.original_context_length`, `attention.sliding_window` (0 for none) and, for
  longrope, `rope.scaling.attn_factor` with the F32 tensors rope_factors_long / _short; no
  key_length / value_length / vocab_size (the converter writes none for phi3);
- gemma2 / gemma3 (Gemma2Model / Gemma3Model): norms stored as 1 + w, post_attention_norm,
  ffn_norm (the pre-feed-forward norm), post_ffw_norm, the soft-caps and window; see
  `_gemma_hparams` for what a llama.cpp file cannot hold (refused) and what is written beyond
  the converter (a sliding pattern other than llama.cpp's fixed one);
- the rotary row permutation of Q and K for arch "llama" only (llama.cpp's LlamaModel.permute;
  qwen2/qwen3 files keep HF's row order);
- metadata `{arch}.*` as the converter sets it;
- the tokenizer: every `tokenizer.*` field copied from an existing GGUF (the 512-token
  SentencePiece vocabulary of stories260K.gguf, or GPT-2's vocab-only GGUF), so the HF model
  must be built with that vocabulary's size (`vocab_of`).
`qtype` (Q8_0, Q4_0, Q4_1) stores 2-D matrices whose width is a multiple of 32 quantized by the
`gguf` package's reference quantizer (llama.cpp's bytes); norms, biases and GPT-2's position
table stay float32.

`dequantized_state_dict` gives an HF model the numbers a (quantized) file stores;
`small_bpe_vocab_gguf` a 512-token cut of GPT-2's vocabulary; `tensor_type_offset`,
`patched_copy` and `truncated_copy` make damaged files.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_fixtures import GPT2_GGUF, SHARED

STORIES_GGUF = SHARED / "models" / "stories260K" / "stories260K.gguf"
LLAMA_FAMILY = ("llama", "qwen2", "qwen3")
MOE_ARCHS = ("qwen2moe", "qwen3moe")   # and "llama" of a Mixtral model
GEMMA_ARCHS = ("gemma2", "gemma3")
ARCHS = LLAMA_FAMILY + ("gpt2", "phi3") + MOE_ARCHS + GEMMA_ARCHS
NONE_ID = 2**32 - 1   # llama.cpp's "no such token" special-token id

_LLAMA_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # mixtures of experts (transformers 5 names; the stacked experts: _expert_tensors)
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_PHI3_LAYER = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GPT2_LAYER = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
               "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass(frozen=True)
class Vocab:
    """What an HF config builder (hf_fixtures._llama_config, ...) reads from a tokenizer."""

    size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def __len__(self) -> int:
        return self.size


def default_tokenizer_gguf(arch: str) -> Path:
    return GPT2_GGUF if arch == "gpt2" else STORIES_GGUF


def vocab_of(path: str | Path) -> Vocab:
    """The size and BOS/EOS ids of a GGUF file's vocabulary (ids outside it read as None)."""
    import gguf
    reader = gguf.GGUFReader(path)
    size = len(reader.fields["tokenizer.ggml.tokens"].data)

    def special(key: str) -> int | None:
        f = reader.fields.get(f"tokenizer.ggml.{key}")
        value = None if f is None else int(f.contents())
        return value if value is not None and 0 <= value < size else None

    return Vocab(size, special("bos_token_id"), special("eos_token_id"))


# --------------------------------------------------------------------------- conversion


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's half-split rotary rows -> interleaved pairs."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _is_rotary(gguf_name: str) -> bool:
    """Q or K of a layer (weight or bias): the tensors llama.cpp permutes for `llama`."""
    return gguf_name.split(".")[-2] in ("attn_q", "attn_k")


def _hparams(config: Any, arch: str) -> dict[str, Any]:
    if arch == "gpt2":
        return dict(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head,
                    ctx=config.n_positions, ffn=config.n_inner or 4 * config.n_embd,
                    eps=config.layer_norm_epsilon)
    heads = config.num_attention_heads
    if arch == "phi3":
        rope = dict(config.rope_parameters)
        orig = int(config.original_max_position_embeddings)
        scale = config.max_position_embeddings / orig
        phi3 = dict(orig_ctx=orig, window=config.sliding_window or 0,
                    long_factor=rope.get("long_factor"), short_factor=rope.get("short_factor"),
                    # the converter's attention factor: from the lengths, whatever the config says
                    attn_factor=math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1
                    else 1.0)
    else:
        phi3 = {}
    if arch in GEMMA_ARCHS:
        phi3 = _gemma_hparams(config, arch)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        phi3 = dict(experts=experts, experts_used=config.num_experts_per_tok,
                    expert_ffn=getattr(config, "moe_intermediate_size", None)
                    or config.intermediate_size,
                    shared_ffn=getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return dict(phi3, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                kv_heads=config.num_key_value_heads or heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                ctx=config.max_position_embeddings, ffn=config.intermediate_size,
                eps=config.rms_norm_eps, rope_theta=float(
                    getattr(config, "rope_theta", None)
                    or config.rope_parameters.get("full_attention", config.rope_parameters)
                    ["rope_theta"]),
                tied=bool(config.tie_word_embeddings))


def _gemma_hparams(config: Any, arch: str) -> dict[str, Any]:
    """What llama.cpp's Gemma2Model / Gemma3Model write, and the HF settings a llama.cpp file
    cannot hold refused (ValueError): a query_pre_attn_scalar other than the one llama.cpp
    derives (head_dim; hidden / heads at the 27B layer counts), gemma2's rope theta other than
    10000 (no freq_base is written), gemma3's attention soft-cap (its converter refuses it).
    Beyond the converter: the sliding pattern as one bool per layer where the layer types are
    not llama.cpp's fixed period (2 / 6), and gemma3's local rope base where it is not 10000."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = config.head_dim
    derived = (config.hidden_size // heads if layers == {"gemma2": 46, "gemma3": 62}[arch]
               else head_dim)
    if config.query_pre_attn_scalar != derived:
        raise ValueError(f"{arch}: query_pre_attn_scalar {config.query_pre_attn_scalar} cannot "
                         f"be stored (llama.cpp derives {derived})")
    rope = dict(config.rope_parameters)
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", rope)
    if full.get("rope_type", "default") not in ("default", "linear"):
        raise ValueError(f"{arch}: rope_type {full['rope_type']!r} is not written by the fixture")
    period = 2 if arch == "gemma2" else 6
    sliding = [t == "sliding_attention" for t in config.layer_types]
    gemma3 = arch == "gemma3"
    if not gemma3 and float(full["rope_theta"]) != 10000.0:
        raise ValueError("gemma2: llama.cpp's converter writes no rope theta (10000 is assumed)")
    if gemma3 and config.attn_logit_softcapping is not None:
        raise ValueError("gemma3: llama.cpp's converter refuses attn_logit_softcapping")
    return dict(window=config.sliding_window,
                pattern=None if sliding == [i % period < period - 1 for i in range(layers)]
                else sliding,
                attn_cap=config.attn_logit_softcapping, final_cap=config.final_logit_softcapping,
                linear=full.get("factor") if full.get("rope_type") == "linear" else None,
                local_theta=float(local["rope_theta"]) if gemma3 else None)


def gguf_tensors(state_dict: Mapping[str, torch.Tensor], config: Any,
                 arch: str) -> dict[str, np.ndarray]:
    """The HF state dict under GGUF names, float32 numpy arrays in the file's row order."""
    hp = _hparams(config, arch)
    out: dict[str, np.ndarray] = {}
    for name, t in state_dict.items():
        w = t.detach().to(torch.float32).cpu().numpy().copy()
        if ".mlp.experts." in name:
            out.update(_expert_tensors(name, w))
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):
            w = w.reshape(-1)   # the converter squeezes [1, H] to [H]
        gguf_name = _gguf_name(name, hp, arch)
        if gguf_name is None:
            continue
        if arch == "gpt2" and name.endswith(_GPT2_CONV1D):
            w = np.ascontiguousarray(w.T)   # Conv1D [in, out] -> [out, in]
        if arch == "llama" and _is_rotary(gguf_name):
            w = llama_permute(w, hp["heads"] if ".attn_q." in gguf_name else hp["kv_heads"])
        if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
            w = w + np.float32(1.0)   # llama.cpp stores Gemma's norms as 1 + w
        out[gguf_name] = np.ascontiguousarray(w)
    if arch == "gpt2" and "output.weight" not in out:
        out["output.weight"] = out["token_embd.weight"].copy()
    if arch == "phi3" and hp["long_factor"] is not None:
        out["rope_factors_long.weight"] = np.asarray(hp["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(hp["short_factor"], np.float32)
    return out


def _expert_tensors(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """transformers 5's stacked experts -> llama.cpp's ffn_{gate,up,down}_exps (3-D)."""
    layer = name.split(".")[2]
    if name.endswith("experts.gate_up_proj"):   # [E, 2I, H]: gate rows, then up rows
        half = w.shape[1] // 2
        return {f"blk.{layer}.ffn_gate_exps.weight": np.ascontiguousarray(w[:, :half]),
                f"blk.{layer}.ffn_up_exps.weight": np.ascontiguousarray(w[:, half:])}
    if name.endswith("experts.down_proj"):
        return {f"blk.{layer}.ffn_down_exps.weight": np.ascontiguousarray(w)}
    raise KeyError(f"no GGUF name for HF tensor {name!r}")


def _gguf_name(name: str, hp: dict[str, Any], arch: str) -> str | None:
    layer_names = {"phi3": _PHI3_LAYER, **dict.fromkeys(GEMMA_ARCHS, _GEMMA_LAYER)}
    return _gpt2_name(name) if arch == "gpt2" else _llama_name(
        name, hp, layer_names.get(arch, _LLAMA_LAYER))


def _llama_name(name: str, hp: dict[str, Any],
                layer_names: Mapping[str, str] = _LLAMA_LAYER) -> str | None:
    if name.endswith("rotary_emb.inv_freq"):
        return None
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return None if name == "lm_head.weight" and hp["tied"] else top[name]
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer, stem, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
        if stem in layer_names:
            return f"blk.{layer}.{layer_names[stem]}.{suffix}"
    raise KeyError(f"no GGUF name for HF tensor {name!r}")


def _gpt2_name(name: str) -> str | None:
    name = name.removeprefix("transformer.")
    if name.endswith((".attn.bias", ".attn.masked_bias")):   # causal-mask buffers
        return None
    top = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
           "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")
    if parts[0] == "h":
        layer, stem, suffix = parts[1], ".".join(parts[2:-1]), parts[-1]
        if stem in _GPT2_LAYER:
            return f"blk.{layer}.{_GPT2_LAYER[stem]}.{suffix}"
    raise KeyError(f"no GGUF name for HF tensor {name!r}")


def _add_metadata(writer: Any, hp: dict[str, Any], arch: str, vocab_size: int) -> None:
    writer.add_block_count(hp["layers"])
    writer.add_context_length(hp["ctx"])
    writer.add_embedding_length(hp["hidden"])
    writer.add_feed_forward_length(hp["ffn"])
    writer.add_head_count(hp["heads"])
    if arch == "gpt2":
        writer.add_layer_norm_eps(hp["eps"])
        return
    if arch in GEMMA_ARCHS:
        _add_gemma_metadata(writer, hp, arch)
        return
    writer.add_head_count_kv(hp["kv_heads"])
    writer.add_rope_freq_base(hp["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["eps"])
    writer.add_rope_dimension_count(hp["head_dim"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(hp["orig_ctx"])
        writer.add_sliding_window(hp["window"])
        if hp["long_factor"] is not None:
            writer.add_rope_scaling_attn_factors(hp["attn_factor"])
        return
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_vocab_size(vocab_size)
    if "experts" in hp:
        writer.add_expert_count(hp["experts"])
        writer.add_expert_used_count(hp["experts_used"])
        if arch in MOE_ARCHS:
            writer.add_expert_feed_forward_length(hp["expert_ffn"])
        if hp["shared_ffn"]:
            writer.add_expert_shared_feed_forward_length(hp["shared_ffn"])


def _add_gemma_metadata(writer: Any, hp: dict[str, Any], arch: str) -> None:
    """Gemma2Model / Gemma3Model's keys (no vocab_size or rope dimension count; gemma2 no rope
    theta), see _gemma_hparams."""
    import gguf
    writer.add_head_count_kv(hp["kv_heads"])
    writer.add_layer_norm_rms_eps(hp["eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hp["attn_cap"])
        writer.add_final_logit_softcapping(hp["final_cap"])
        writer.add_sliding_window(hp["window"])
    else:
        writer.add_rope_freq_base(hp["rope_theta"])   # the global layers'
        if hp["final_cap"]:
            writer.add_final_logit_softcapping(hp["final_cap"])
        writer.add_sliding_window(hp["window"])
        if hp["linear"] is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(hp["linear"])
        if hp["local_theta"] != 10000.0:
            writer.add_rope_freq_base_swa(hp["local_theta"])
    if hp["pattern"] is not None:
        writer.add_sliding_window_pattern(hp["pattern"])


def copy_tokenizer_fields(writer: Any, source: str | Path) -> int:
    """Every `tokenizer.*` field of `source` (a GGUF file), with its value type, into
    `writer`; returns the vocabulary size."""
    import gguf
    reader = gguf.GGUFReader(source)
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, f.contents(), f.types[0], f.types[-1] if array else None)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def small_bpe_vocab_gguf(out_path: str | Path, size: int = 512,
                         source: str | Path = GPT2_GGUF) -> Path:
    """A vocab-only GGUF of GPT-2's byte-level BPE cut to `size` tokens: the 256 byte tokens,
    the first size - 257 merges (GPT-2's token 256 + i is the result of merge i, so the cut
    vocabulary is closed under its merges) and <|endoftext|> as the last id (BOS = EOS).
    transformers builds GPT-2's full 50257-token tokenizer in seconds, this one at once
    (reading the source file still takes ~2 s: make it once)."""
    import gguf
    reader = gguf.GGUFReader(source)
    keep = size - 1 - 256

    def items(key: str, index: list[int]) -> list[Any]:
        # array element i is parts[data[i]]; contents() would decode all 50257 (seconds)
        f = reader.fields[key]
        values = [f.parts[f.data[i]] for i in index]
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(v).decode("utf-8") for v in values]
        return [int(v[0]) for v in values]

    eot = len(reader.fields["tokenizer.ggml.tokens"].data) - 1
    tokens = items("tokenizer.ggml.tokens", list(range(size - 1)) + [eot])
    merges = items("tokenizer.ggml.merges", list(range(keep)))
    assert tokens[-1] == "<|endoftext|>", tokens[-1]
    for i, merge in enumerate(merges):
        assert merge.replace(" ", "") == tokens[256 + i], (i, merge, tokens[256 + i])
    writer = gguf.GGUFWriter(out_path, "gpt2")
    writer.add_tokenizer_model(reader.fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(reader.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(items("tokenizer.ggml.token_type", list(range(size - 1)) + [eot]))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(size - 1)
    writer.add_eos_token_id(size - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return Path(out_path)


def _quantizable(name: str, w: np.ndarray) -> bool:
    return (w.ndim in (2, 3) and w.shape[-1] % 32 == 0 and name.endswith(".weight")
            and not name.startswith("position_embd"))


def write_gguf(out_path: str | Path, model: torch.nn.Module | str | Path, arch: str, *,
               qtype: Any = None, omit: Sequence[str] = (),
               extra_tensors: Mapping[str, np.ndarray] | None = None,
               tokenizer_gguf: str | Path | None = None,
               architecture: str | None = None,
               metadata: Mapping[str, tuple[Any, Any]] | None = None,
               raw_tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None) -> Path:
    """Write `model` (a transformers model or an HF model directory) as a GGUF file of `arch`.

    qtype: a gguf.GGMLQuantizationType (or its name) for the matrices (see the module
    docstring); omit: GGUF tensor names of the model to leave out; extra_tensors: GGUF
    name -> float32 array, added after the model's (replacing one of the same name);
    tokenizer_gguf: where the tokenizer fields come from (default: by arch);
    architecture: the `general.architecture` (and metadata prefix) to write, when it should
    differ from `arch` (an unknown architecture); metadata: key -> (value,
    GGUFValueType) written over the converter's keys, or key -> None to leave a key out;
    raw_tensors: GGUF name -> (uint8 blocks [rows, row bytes], GGMLQuantizationType) stored
    as given in place of the model's tensor (K-quants, which the gguf package cannot
    quantize).
    """
    import gguf
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if not isinstance(model, torch.nn.Module):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    if isinstance(qtype, str):
        qtype = gguf.GGMLQuantizationType[qtype.upper()]
    tensors = gguf_tensors(model.state_dict(), model.config, arch)
    unknown_omit = set(omit) - set(tensors)
    if unknown_omit:
        raise KeyError(f"omit names tensors the model lacks: {sorted(unknown_omit)}")
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(out_path, architecture or arch)
    writer.add_name(f"tessellm-test-{arch}")
    hp = _hparams(model.config, arch)
    vocab = copy_tokenizer_fields(writer, tokenizer_gguf or default_tokenizer_gguf(arch))
    if vocab != tensors["token_embd.weight"].shape[0]:
        raise ValueError(f"the tokenizer has {vocab} tokens, the model's embedding "
                         f"{tensors['token_embd.weight'].shape[0]}")
    _add_metadata(writer, hp, arch, vocab)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype.name}"] if qtype is not None
                         else gguf.LlamaFileType.ALL_F32)
    for key, entry in (metadata or {}).items():
        if entry is None:
            writer.kv_data[0].pop(key, None)
        else:
            writer.add_key_value(key, *entry)
    kept = {name: w for name, w in tensors.items() if name not in omit}
    for name, w in {**kept, **(extra_tensors or {})}.items():
        if raw_tensors and name in raw_tensors:
            blocks, raw_type = raw_tensors[name]
            writer.add_tensor(name, np.ascontiguousarray(blocks), raw_dtype=raw_type)
        elif qtype is not None and _quantizable(name, w):
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def dequantized_state_dict(path: str | Path, model: torch.nn.Module,
                           arch: str) -> dict[str, torch.Tensor]:
    """`model`'s state dict with every tensor replaced by the numbers stored in the GGUF file
    at `path` (dequantized by the `gguf` package), mapped back to HF names and layout."""
    import gguf
    reader = gguf.GGUFReader(path)
    stored = {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
              for t in reader.tensors}
    state = model.state_dict()
    ours = gguf_tensors(state, model.config, arch)
    hp = _hparams(model.config, arch)
    out = dict(state)
    for hf_name, t in state.items():
        if ".mlp.experts." in hf_name:
            parts = [stored[n].reshape(ours[n].shape).astype(np.float32)
                     for n in _expert_tensors(hf_name, t.numpy())]
            out[hf_name] = torch.from_numpy(np.concatenate(parts, axis=1)).reshape(t.shape)
            continue
        gguf_name = _gguf_name(hf_name, hp, arch)
        if gguf_name is None or gguf_name not in stored:
            continue
        w = stored[gguf_name].reshape(ours[gguf_name].shape).astype(np.float32)
        if arch == "llama" and _is_rotary(gguf_name):
            n_head = hp["heads"] if ".attn_q." in gguf_name else hp["kv_heads"]
            w = unpermute(w, n_head)
        if arch == "gpt2" and hf_name.removeprefix("transformer.").endswith(_GPT2_CONV1D):
            w = w.T
        if arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        out[hf_name] = torch.from_numpy(np.ascontiguousarray(w)).reshape(t.shape)
    if arch != "gpt2" and hp["tied"]:   # one parameter under two names: load both alike
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `llama_permute`."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


# --------------------------------------------------------------------------- damaged files


def tensor_type_offset(path: str | Path, tensor_name: str) -> int:
    """The file offset of the uint32 GGML type id in `tensor_name`'s tensor-info entry.

    The entry is: name (uint64 length + bytes), n_dims (uint32), dims (n_dims x uint64),
    type (uint32), data offset (uint64). It is located by the reader's parsed parts and checked
    against the type the reader reports."""
    import gguf
    reader = gguf.GGUFReader(path)
    (t,) = [t for t in reader.tensors if t.name == tensor_name]
    parts = t.field.parts
    assert len(parts) == 6, [p.shape for p in parts]
    offset = t.field.offset + sum(int(p.nbytes) for p in parts[:4])
    raw = Path(path).read_bytes()[offset:offset + 4]
    assert int.from_bytes(raw, "little") == int(t.tensor_type), (raw, t.tensor_type)
    return offset


def patched_copy(src: Path, dst: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[offset:offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def truncated_copy(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


def llama3_rope_factors(config: Any) -> np.ndarray:
    """`rope_freqs` as llama.cpp's converter writes it for an HF model with rope_type llama3
    (Llama 3.1+): per rotary frequency the divisor of its base value: 1 for short wavelengths,
    `factor` for long ones, a smooth ramp between."""
    import math
    rope = dict(getattr(config, "rope_parameters", None) or config.rope_scaling)
    theta, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def split_gguf(src: str | Path, out_dir: str | Path, count: int,
               stem: str | None = None) -> list[Path]:
    """`src` written as llama.cpp's gguf-split writes it: `STEM-0000i-of-0000N.gguf`, the
    first part with every metadata field, each part with split.no (0-based), split.count and
    split.tensors.count, the tensors dealt out in order (raw, as stored)."""
    import gguf
    reader = gguf.GGUFReader(src)
    tensors = list(reader.tensors)
    arch = reader.fields["general.architecture"].contents()
    stem = stem or Path(src).stem
    per = -(-len(tensors) // count)
    paths = []
    for i in range(count):
        path = Path(out_dir) / f"{stem}-{i + 1:05d}-of-{count:05d}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        if i == 0:
            for key, f in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                array = f.types[0] == gguf.GGUFValueType.ARRAY
                writer.add_key_value(key, f.contents(), f.types[0],
                                     f.types[-1] if array else None)
        writer.add_uint16("split.no", i)
        writer.add_uint16("split.count", count)
        writer.add_int32("split.tensors.count", len(tensors))
        for t in tensors[i * per:(i + 1) * per]:
            data = np.asarray(t.data)
            if int(t.tensor_type) in (0, 1):   # F32 / F16: the values, in the file's shape
                writer.add_tensor(t.name, data)
            else:
                writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths
