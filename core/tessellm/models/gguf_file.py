"""Reading a GGUF file (llama.cpp's format): hyper-parameters and weights (its tokenizer and
chat template: tessellm.models.gguf_tokenizer).

The header is parsed by tessellm.models.gguf_reader and the file memory-mapped copy-on-write,
so tensors kept in their packed form are views of the file, never copies. Invariants:
- The metadata becomes an HF-style config dict (`architectures`, `hidden_size`, ...), so the
  architectures' spec readers serve GGUF and safetensors alike (tessellm.models.gguf_config).
- Tensor names are mapped to the names the graph builders read (HF names for the Llama family,
  the adapted names for GPT-2); a missing tensor is a ModelLoadError naming it.
- phi3's fused `attn_qkv` and `ffn_up` (gate rows, then up rows) keep the HF checkpoint's
  fused names (qkv_proj, gate_up_proj): tessellm.models.phi3 splits them by rows.
- gemma2 / gemma3 files (tessellm.models.gguf_gemma) keep llama.cpp's norms (1 + w) and get
  the settings llama.cpp leaves implied (sliding pattern, query scalar, local rope base).
- llama.cpp's converter permutes the rows of Q and K of `llama` files for its interleaved
  rotary layout; they are permuted back here (rows only, so packed tensors stay packed).
- Every tensor's data must lie inside the file: a truncated file is refused before any read.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tessellm.errors import ModelLoadError
from tessellm.models.gguf_config import CONFIG_TENSORS, gguf_config
from tessellm.models.gguf_gemma import (GEMMA_GGUF_ARCHITECTURES, GEMMA_NAMES,
                                        gemma_expected_shapes, gemma_required)
from tessellm.models.gguf_moe import MOE_NAMES, moe_expected_shapes, moe_required
from tessellm.models.gguf_reader import metadata_field
from tessellm.models.gguf_split import open_split, split_parts
from tessellm.quant.formats import PACKED_FORMATS, PackedWeight

log = logging.getLogger(__name__)

_DENSE_TYPES = {0: np.float32, 1: np.float16}   # F32, F16 (BF16 = 30 handled apart)
_BF16 = 30

Weight = torch.Tensor | PackedWeight


@dataclass
class GGUFModel:
    path: Path
    config: dict[str, Any]
    weights: dict[str, Weight]
    packed_types: Counter       # tensors kept packed, by type name
    dequantized_types: Counter  # tensors expanded to the compute dtype at load, by type name


def open_gguf(path: str | Path) -> Any:
    """The file's parsed header (gguf_reader.GGUFContents; over all its parts for a split
    file, any part named: tessellm.models.gguf_split), or a ModelLoadError saying what is
    wrong with it."""
    p = Path(path).expanduser()
    parts = split_parts(p)
    if parts is not None:
        return open_split(parts, _open_one)
    return _open_one(p)


def _open_one(p: Path) -> Any:
    from tessellm.models.gguf_reader import read_gguf
    if not p.is_file():
        raise ModelLoadError(f"GGUF file {str(p)!r} does not exist")
    return read_gguf(p)


# GGUF tensor-name stem -> graph weight-name stem, per family ("{i}" = layer).
_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
    **MOE_NAMES,
}
_GPT2_NAMES = {
    "token_embd": "wte", "position_embd": "wpe", "output_norm": "ln_f", "output": "lm_head",
    "blk.{i}.attn_norm": "h.{i}.ln_1", "blk.{i}.attn_qkv": "h.{i}.attn.qkv_proj",
    "blk.{i}.attn_output": "h.{i}.attn.c_proj", "blk.{i}.ffn_norm": "h.{i}.ln_2",
    "blk.{i}.ffn_up": "h.{i}.mlp.c_fc", "blk.{i}.ffn_down": "h.{i}.mlp.c_proj",
}


# phi3: the fused tensors under the HF checkpoint's names (tessellm.models.phi3 splits them)
_PHI3_NAMES = {k: v for k, v in _LLAMA_NAMES.items()
               if k.rpartition(".")[2] not in ("attn_q", "attn_k", "attn_v", "attn_q_norm",
                                               "attn_k_norm", "ffn_gate", "ffn_up")}
_PHI3_NAMES["blk.{i}.attn_qkv"] = "model.layers.{i}.self_attn.qkv_proj"
_PHI3_NAMES["blk.{i}.ffn_up"] = "model.layers.{i}.mlp.gate_up_proj"   # [gate | up] rows


def _name_map(arch: str, num_layers: int) -> dict[str, str]:
    table = {"gpt2": _GPT2_NAMES, "phi3": _PHI3_NAMES,
             **dict.fromkeys(GEMMA_GGUF_ARCHITECTURES, GEMMA_NAMES)}.get(arch, _LLAMA_NAMES)
    out: dict[str, str] = {}
    for src, dst in table.items():
        layers = range(num_layers) if "{i}" in src else (0,)
        for i in layers:
            for suffix in (".weight", ".bias"):
                out[src.format(i=i) + suffix] = dst.format(i=i) + suffix
    return out


def _unpermute_rows(num_heads: int) -> Callable[[int], torch.Tensor]:
    """Row order that undoes llama.cpp's rotary permutation of a [heads * head_dim, K] weight."""
    def order(rows: int) -> torch.Tensor:
        half = rows // num_heads // 2
        permuted = torch.arange(rows).reshape(num_heads, 2, half).transpose(1, 2).reshape(-1)
        inverse = torch.empty_like(permuted)
        inverse[permuted] = torch.arange(rows)
        return inverse
    return order


def _tensor(t: Any, dtype: torch.dtype, keep_packed: bool, counts: tuple[Counter, Counter]
            ) -> Weight:
    """One GGUF tensor as a dense tensor of `dtype` or, where kept, a PackedWeight. A 3-D
    tensor (MoE experts, [E, rows, cols]) is read as the 2-D stack of its E * rows rows."""
    dense = _read_tensor(t, dtype, keep_packed, counts)
    if isinstance(dense, torch.Tensor) and dense.dim() == 3:
        return dense.reshape(-1, dense.shape[-1])
    return dense


def _read_tensor(t: Any, dtype: torch.dtype, keep_packed: bool,
                 counts: tuple[Counter, Counter]) -> Weight:
    import gguf
    packed, expanded = counts
    kind = int(t.tensor_type)
    name = gguf.GGMLQuantizationType(kind).name
    if kind in _DENSE_TYPES:
        return torch.from_numpy(np.asarray(t.data)).to(dtype)
    if kind == _BF16:
        raw = torch.from_numpy(np.asarray(t.data).view(np.int16))
        return raw.view(torch.bfloat16).to(dtype)
    if keep_packed and kind in PACKED_FORMATS and len(t.data.shape) in (2, 3):
        packed[name] += 1
        rows = int(np.prod(t.data.shape[:-1]))
        data = torch.from_numpy(np.asarray(t.data)).reshape(rows, -1)
        return PackedWeight(data, PACKED_FORMATS[kind], int(t.shape[0]), dtype)
    try:
        dense = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(kind))
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has type {name}, which cannot be "
                             f"dequantized: {exc}") from exc
    expanded[name] += 1
    return torch.from_numpy(dense).to(dtype)


def _permute(w: Weight, order: torch.Tensor) -> Weight:
    return w.rows(order) if isinstance(w, PackedWeight) else w.index_select(0, order)


def load_gguf(path: str | Path, dtype: torch.dtype, *, keep_packed: bool,
              reader: Any = None) -> GGUFModel:
    """Config, weights (graph names) and chat template of a GGUF file.

    keep_packed: Q8_0 / Q4_0 / Q4_1 matrices stay packed (PackedWeight); every other tensor,
    and all of them when False, is dequantized to `dtype` at load. `reader`: the file's
    open_gguf reader when the caller has one (parsing the header takes seconds: the
    vocabulary's every token is a field part).
    """
    reader = reader if reader is not None else open_gguf(path)
    config = gguf_config(reader)
    arch = metadata_field(reader, "general.architecture")
    num_layers = config.get("num_hidden_layers") or config["n_layer"]
    names = _name_map(arch, num_layers)
    by_name = {t.name: t for t in reader.tensors}
    unknown = sorted(n for n in by_name if n not in names and n not in CONFIG_TENSORS)
    if unknown:
        raise ModelLoadError(f"GGUF file {path} has tensors tessellm does not know for {arch}: "
                             f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    _check_shapes(arch, config, by_name, path)
    counts: tuple[Counter, Counter] = (Counter(), Counter())
    weights: dict[str, Weight] = {}
    for src, t in by_name.items():
        if src not in CONFIG_TENSORS:   # read into the config (gguf_config)
            weights[names[src]] = _tensor(t, dtype, keep_packed, counts)
    _check_required(arch, config, weights, names, path)
    if arch == "llama":  # undo the converter's rotary row permutation of Q and K
        for i in range(num_layers):
            p = f"model.layers.{i}.self_attn"
            for proj, heads in (("q_proj", config["num_attention_heads"]),
                                ("k_proj", config["num_key_value_heads"])):
                for suffix in (".weight", ".bias"):
                    key = f"{p}.{proj}{suffix}"
                    if key in weights:
                        weights[key] = _permute(weights[key],
                                                _unpermute_rows(heads)(weights[key].shape[0]))
    if arch == "gpt2":
        _split_gpt2_qkv(weights, num_layers)
    return GGUFModel(Path(path), config, weights, *counts)


def _expected_shapes(arch: str, c: dict[str, Any], vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF stem ("blk.{i}.attn_q") -> the [rows, cols] (or [width]) its weight must have."""
    if arch == "gpt2":
        h, inter = c["n_embd"], c["n_inner"]
        return {"token_embd": (vocab, h), "position_embd": (c["n_positions"], h),
                "output_norm": (h,), "output": (vocab, h), "blk.{i}.attn_norm": (h,),
                "blk.{i}.attn_qkv": (3 * h, h), "blk.{i}.attn_output": (h, h),
                "blk.{i}.ffn_norm": (h,), "blk.{i}.ffn_up": (inter, h),
                "blk.{i}.ffn_down": (h, inter)}
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    if arch == "phi3":
        return {"token_embd": (vocab, h), "output_norm": (h,), "output": (vocab, h),
                "blk.{i}.attn_norm": (h,), "blk.{i}.attn_qkv": (q + 2 * kv, h),
                "blk.{i}.attn_output": (h, q), "blk.{i}.ffn_norm": (h,),
                "blk.{i}.ffn_up": (2 * inter, h), "blk.{i}.ffn_down": (h, inter)}
    moe = moe_expected_shapes(c) if ("num_experts" in c or "num_local_experts" in c) else {}
    if arch in GEMMA_GGUF_ARCHITECTURES:
        moe = gemma_expected_shapes(c)
    return {**moe, "token_embd": (vocab, h), "output_norm": (h,), "output": (vocab, h),
            "blk.{i}.attn_norm": (h,), "blk.{i}.attn_q": (q, h), "blk.{i}.attn_k": (kv, h),
            "blk.{i}.attn_v": (kv, h), "blk.{i}.attn_output": (h, q),
            "blk.{i}.attn_q_norm": (hd,), "blk.{i}.attn_k_norm": (hd,),
            "blk.{i}.ffn_norm": (h,), "blk.{i}.ffn_gate": (inter, h),
            "blk.{i}.ffn_up": (inter, h), "blk.{i}.ffn_down": (h, inter)}


def _check_shapes(arch: str, config: dict[str, Any], tensors: dict[str, Any],
                  path: str | Path) -> None:
    """Every tensor's shape (from its header, before any data is read) agrees with the
    metadata."""
    expected = _expected_shapes(arch, config, config["vocab_size"])
    for name, t in tensors.items():
        stem, _, suffix = re.sub(r"^blk\.\d+\.", "blk.{i}.", name).rpartition(".")
        want = expected.get(stem)
        if want is None:
            continue
        want = want[:1] if suffix == "bias" else want
        got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
        if got != want:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {name!r} has shape {list(got)}, but the metadata "
                f"(embedding_length, attention.head_count, attention.head_count_kv, "
                f"key_length, feed_forward_length) implies {list(want)}")


def _check_required(arch: str, config: dict[str, Any], weights: dict[str, Weight],
                    names: dict[str, str], path: str | Path) -> None:
    if arch == "gpt2":
        per_layer = ["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
        top = ["token_embd", "position_embd", "output_norm"]
    elif arch in ("phi3", *GEMMA_GGUF_ARCHITECTURES):
        per_layer = (["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
                     if arch == "phi3" else gemma_required(arch))
        top = ["token_embd", "output_norm"] + ([] if config["tie_word_embeddings"] else ["output"])
    else:
        per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
        per_layer += ["attn_q_norm", "attn_k_norm"] if arch in ("qwen3", "qwen3moe") else []
        top = ["token_embd", "output_norm"] + ([] if config["tie_word_embeddings"] else ["output"])
    layers = config.get("num_hidden_layers") or config["n_layer"]
    moe = "num_experts" in config or "num_local_experts" in config

    def mlp(i: int) -> list[str]:
        if arch in ("gpt2", "phi3", *GEMMA_GGUF_ARCHITECTURES):
            return []
        return moe_required(config, i) if moe else ["ffn_gate", "ffn_up", "ffn_down"]
    required = [f"{t}.weight" for t in top] + [
        f"blk.{i}.{t}.weight" for i in range(layers) for t in per_layer + mlp(i)]
    missing = [r for r in required if names[r] not in weights]
    if missing:
        raise ModelLoadError(f"GGUF file {path} lacks tensor(s) {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")


def _split_gpt2_qkv(weights: dict[str, Weight], num_layers: int) -> None:
    """GPT-2's fused qkv rows -> q/k/v rows: graphs are built unfused (the qkv pass fuses)."""
    for i in range(num_layers):
        p = f"h.{i}.attn"
        for suffix in (".weight", ".bias"):
            fused = weights.pop(f"{p}.qkv_proj{suffix}", None)
            if fused is None:
                continue
            third = fused.shape[0] // 3
            for j, name in enumerate("qkv"):
                rows = torch.arange(j * third, (j + 1) * third)
                weights[f"{p}.{name}_proj{suffix}"] = _permute(fused, rows)
