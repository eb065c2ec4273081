"""`tessellm convert HF_DIR OUT.gguf`: a Hugging Face safetensors checkpoint of the Llama
family (Llama, Mistral, Qwen2, Qwen3) or its mixtures of experts (Mixtral as `llama` with
`expert_count`, Qwen2-MoE, Qwen3-MoE: per-expert tensors stacked as llama.cpp's
`ffn_*_exps`) written as a GGUF file that llama.cpp reads (and
quantizes: `llama_model_quantize`), as its convert_hf_to_gguf.py lays one out.

Invariants:
- tensors under GGUF names (the inverse of tessellm.models.gguf_file's map); matrices in F16
  (or F32 / BF16 as asked), norms and biases in F32; the Q and K rows of `llama` files
  permuted to llama.cpp's interleaved rotary layout (the loader undoes it);
- metadata `{arch}.*` from config.json; Llama 3.1 rope scaling (rope_type llama3) becomes a
  `rope_freqs` tensor, linear and yarn scalings their `rope.scaling.*` keys, others refused;
- the tokenizer from the directory: SentencePiece (tokenizer.model: pieces, scores, types;
  `tokenizer.ggml.model = llama`; a SentencePiece BPE saved only as tokenizer.json, with
  byte fallback, the same with each merged piece's score minus its merge's rank), or
  byte-level BPE (tokenizer.json: vocab, merges; `gpt2` with the pre-tokenizer of the
  family: `llama-bpe` for Llama 3, `qwen2` for Qwen);
  the chat template and BOS/EOS ids from tokenizer_config.json / config.json.
Refused with a clear error: other architectures, other tokenizers, tied heads that are not
tied in config, missing tensors.
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessellm.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
         "Qwen3MoeForCausalLM": "qwen3moe"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}
OUT_TYPES = ("f16", "bf16", "f32")


def gguf_name(hf_name: str) -> str | None:
    """The GGUF name of an HF tensor (None: a buffer the file does not hold)."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:-1]) in _LAYER:
        return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
    raise UnsupportedModelError(f"no GGUF name for tensor {hf_name!r}")


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_STACK = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def stack_experts(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, np.ndarray]:
    """Pop every per-expert tensor of `weights` (HF's `experts.{e}.gate_proj`, Mixtral's
    `w1/w3/w2`); return llama.cpp's stacks `blk.N.ffn_{gate,up,down}_exps.weight`
    [E, rows, cols], experts in order (a missing expert is a ModelLoadError)."""
    found: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in weights if _EXPERT.match(n)]:
        layer, expert, part = _EXPERT.match(name).groups()
        found.setdefault(f"blk.{layer}.{_EXPERT_STACK[part]}.weight", {})[int(expert)] = \
            weights.pop(name)
    out = {}
    for name, by_expert in found.items():
        if sorted(by_expert) != list(range(num_experts)):
            raise ModelLoadError(f"convert: {name} has experts {sorted(by_expert)[:8]}..., "
                                 f"the config says {num_experts}")
        out[name] = torch.stack([by_expert[e] for e in range(num_experts)]).float().numpy()
    return out


def _add_moe_metadata(writer: Any, arch: str, spec: Any, config: dict[str, Any]) -> None:
    """expert_count & co.; what llama.cpp's graphs cannot express is refused (they route
    every layer; qwen3moe renormalizes the chosen weights, qwen2moe does not)."""
    moe = spec.moe
    if len(moe.layers) != spec.num_layers:
        raise UnsupportedModelError(f"convert: {spec.architecture} with dense layers "
                                    "(mlp_only_layers / decoder_sparse_step) has no GGUF form "
                                    "(llama.cpp routes every layer)")
    if arch != "llama" and moe.renormalize != (arch == "qwen3moe"):
        raise UnsupportedModelError(f"convert: {spec.architecture} with norm_topk_prob="
                                    f"{moe.renormalize} has no GGUF form ({arch} files "
                                    f"{'always' if arch == 'qwen3moe' else 'never'} "
                                    "renormalize)")
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if arch != "llama":
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if moe.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)


def interleave_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's half-split rotary rows of each head -> llama.cpp's interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_frequency_divisors(theta: float, head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """`rope_freqs` for rope_type llama3: each rotary frequency's divisor (1 for short
    wavelengths, `factor` for long ones, a smooth ramp between)."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir} holds no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _add_tokenizer(writer: Any, model_dir: Path, arch: str, config: dict[str, Any]) -> None:
    import gguf
    tok_config = _read_json(model_dir / "tokenizer_config.json") \
        if (model_dir / "tokenizer_config.json").is_file() else {}
    spm, tok_json = model_dir / "tokenizer.model", model_dir / "tokenizer.json"
    types = gguf.TokenType
    if spm.is_file():
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_file=str(spm))
        tokens, scores, kinds = [], [], []
        for i in range(sp.get_piece_size()):
            tokens.append(sp.id_to_piece(i))
            scores.append(sp.get_score(i))
            kinds.append(types.UNKNOWN if sp.is_unknown(i) else types.CONTROL
                         if sp.is_control(i) else types.UNUSED if sp.is_unused(i)
                         else types.BYTE if sp.is_byte(i) else types.NORMAL)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(kinds)
        writer.add_unk_token_id(sp.unk_id())
        vocab_size = len(tokens)
    elif tok_json.is_file():
        tj = _read_json(tok_json)
        model = tj.get("model") or {}
        if model.get("type") != "BPE":
            raise UnsupportedModelError(f"{tok_json}: tokenizer type {model.get('type')!r} "
                                        "cannot be converted (SentencePiece or BPE)")
        added = {t["id"]: t for t in tj.get("added_tokens", [])}
        vocab = dict(model["vocab"])
        for t in added.values():
            vocab.setdefault(t["content"], t["id"])
        size = max(int(config.get("vocab_size", 0)), max(vocab.values()) + 1)
        tokens = [f"[PAD{i}]" for i in range(size)]
        kinds = [types.UNUSED] * size
        for text, i in vocab.items():
            tokens[i] = text
            kinds[i] = (types.CONTROL if added.get(i, {}).get("special") else
                        types.USER_DEFINED if i in added else types.NORMAL)
        if model.get("byte_fallback"):
            # a SentencePiece BPE saved as tokenizer.json (Llama 2, Mistral): llama.cpp's
            # `llama` vocabulary, whose merges follow the scores (the merge ranks)
            unk = model.get("unk_token")
            scores = [0.0] * size     # a merged piece: minus its merge's rank (1-based)
            for rank, merge in enumerate(model.get("merges", [])):
                a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
                i = vocab.get(a + b)
                if i is not None and i not in added and scores[i] == 0.0:
                    scores[i] = -float(rank + 1)
            for i, text in enumerate(tokens):
                if text == unk:
                    kinds[i] = types.UNKNOWN
                elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    kinds[i] = types.BYTE
            writer.add_tokenizer_model("llama")
            writer.add_tokenizer_pre("default")
            writer.add_token_list(tokens)
            writer.add_token_scores(scores)
            writer.add_token_types(kinds)
            if unk in vocab:
                writer.add_unk_token_id(vocab[unk])
        else:
            pre = {"qwen2": "qwen2", "qwen3": "qwen2", "qwen2moe": "qwen2", "qwen3moe": "qwen2",
                   "llama": "llama-bpe"}[arch]
            merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(pre)
            writer.add_token_list(tokens)
            writer.add_token_types(kinds)
            writer.add_token_merges(merges)
        vocab_size = size
    else:
        raise UnsupportedModelError(f"{model_dir} has neither tokenizer.model (SentencePiece) "
                                    "nor tokenizer.json (BPE)")
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id)):
        value = config.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and 0 <= value < vocab_size:
            add(value)
    bos, eos = _special_tokens_added(model_dir)
    writer.add_add_bos_token(bos)
    writer.add_add_eos_token(eos)
    template = tok_config.get("chat_template")
    if isinstance(template, str):
        writer.add_chat_template(template)


def _special_tokens_added(model_dir: Path) -> tuple[bool, bool]:
    """Whether the directory's tokenizer (as transformers loads it) adds BOS / EOS when it
    encodes a text: what the GGUF's add_bos_token / add_eos_token must say."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc
    ids = tok("a").input_ids
    return (tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id],
            tok.eos_token_id is not None and len(ids) > 1 and ids[-1:] == [tok.eos_token_id])


def convert_hf_to_gguf(model_dir: str | Path, out: str | Path, out_type: str = "f16") -> Path:
    """Write the HF checkpoint in `model_dir` as the GGUF file `out`; returns its path."""
    import gguf
    model_dir, out = Path(model_dir), Path(out)
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type must be one of {OUT_TYPES}, got {out_type!r}")
    config = _read_json(model_dir / "config.json")
    hf_arch = (config.get("architectures") or [None])[0]
    if hf_arch not in ARCHS:
        raise UnsupportedModelError(f"convert: architecture {hf_arch!r} is not supported "
                                    f"(supported: {', '.join(sorted(ARCHS))})")
    arch = ARCHS[hf_arch]
    from tessellm.models.architectures import resolve_architecture
    spec = resolve_architecture(config).spec(config)
    rope = dict(spec.rope_scaling)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(model_dir.name)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_vocab_size(spec.vocab_size)
    if spec.moe is not None:
        _add_moe_metadata(writer, arch, spec, config)
    file_types = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                  "f32": gguf.LlamaFileType.ALL_F32}
    writer.add_file_type(file_types[out_type])
    extra: dict[str, np.ndarray] = {}
    kind = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if kind == "llama3":
        extra["rope_freqs.weight"] = llama3_frequency_divisors(spec.rope_theta, spec.head_dim, rope)
    elif kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        raise UnsupportedModelError(f"convert: rope scaling {kind!r} has no GGUF form here")
    _add_tokenizer(writer, model_dir, arch, config)
    weights = _weights(model_dir)
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if spec.moe is not None:
        extra.update(stack_experts(weights, spec.moe.num_experts))
    for hf_name, t in weights.items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        w = t.float().numpy()
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = spec.num_heads if ".attn_q." in name else spec.num_kv_heads
            w = interleave_rotary_rows(w, heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)   # llama.cpp's [H] for HF's [1, H]
        if w.ndim == 2 and out_type == "f16":
            writer.add_tensor(name, np.ascontiguousarray(w.astype(np.float16)))
        elif w.ndim == 2 and out_type == "bf16":
            bits = torch.from_numpy(np.ascontiguousarray(w)).bfloat16().view(torch.int16)
            writer.add_tensor(name, bits.numpy().view(np.uint8).reshape(w.shape[0], -1),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    for name, w in extra.items():
        if w.ndim == 3 and out_type != "f32":   # stacked experts: matrices, as the others
            w = w.astype(np.float16) if out_type == "f16" else w
            if out_type == "bf16":
                bits = torch.from_numpy(np.ascontiguousarray(w)).bfloat16().view(torch.int16)
                writer.add_tensor(name, bits.numpy().view(np.uint8).reshape(*w.shape[:-1], -1),
                                  raw_dtype=gguf.GGMLQuantizationType.BF16)
                continue
        writer.add_tensor(name, np.ascontiguousarray(w))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("convert: wrote %s (%s, %d tensors)", out, out_type, len(weights) + len(extra))
    return out
