"""A GGUF file with K-quant tensors (Q4_K, Q5_K, Q6_K super-blocks of random bytes with finite
scales, Q5_0 and Q8_0 beside them, as llama.cpp's Q4_K_M mix holds) against transformers' own
GGUF loader, which dequantizes every tensor with the `gguf` package.

- the file loads packed: every matrix a PackedWeight of its stored type, none expanded;
- quantization="none" (float32, dequantized at load): greedy tokens equal transformers';
- the default (packed, the C kernel pinned): logits within 1e-4 of "none" and the same greedy
  tokens. Both compute with the same weights (the kernels' dequantizer is the gguf package's to
  the bit, tests/kernels/test_k_quants.py); they differ only in summation order and, for Q6_K,
  in the order of the two scale products: ~1e-6 per dot product of these widths, below 1e-5 on
  logits of std ~1 after two layers; 1e-4 is the float32 tolerance the other GGUF tests use.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from gguf_fixtures import STORIES_GGUF, gguf_tensors, vocab_of, write_gguf
from hf_fixtures import ModelCase, _llama_config, build_hf_model
from test_gguf_file import (FP32_LOGITS_ATOL, hf_logits_and_greedy, make_llm,
                            prefill_logits_and_greedy, prompts_of)
from tessellm.models.gguf_file import load_gguf
from tessellm.quant.formats import PACKED_FORMATS, PackedWeight, random_packed

# the stored type of each matrix: every K-quant, a legacy fallback type and Q8_0
TYPES = {"token_embd": QT.Q6_K, "output": QT.Q6_K, "attn_q": QT.Q4_K, "attn_k": QT.Q5_K,
         "attn_v": QT.Q8_0, "attn_output": QT.Q5_0, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q5_K,
         "ffn_down": QT.Q6_K}


def _k_config(tok):
    # widths that hold whole 256-weight super-blocks: hidden 256, intermediate 512
    return _llama_config(tok, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2)


@pytest.fixture(scope="module")
def k_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The file and transformers' model of it (from_pretrained(gguf_file=...))."""
    from transformers import AutoModelForCausalLM
    vocab = vocab_of(STORIES_GGUF)
    hf = build_hf_model(ModelCase("llama_k", lambda: vocab, _k_config, 31), vocab)
    g = torch.Generator().manual_seed(5)
    raw = {}
    for name, w in gguf_tensors(hf.state_dict(), hf.config, "llama").items():
        stem = name.rsplit(".", 1)[0].split(".")[-1]
        if w.ndim == 2 and stem in TYPES:
            fmt = PACKED_FORMATS[int(TYPES[stem])]
            scale = 1.0 if stem == "token_embd" else 2 * w.shape[1] ** -0.5
            raw[name] = (random_packed(fmt, w.shape[0], w.shape[1], g, scale=scale).data.numpy(),
                         TYPES[stem])
    out = tmp_path_factory.mktemp("gguf-k") / "llama-k.gguf"
    # stories260K.gguf's padding id is llama.cpp's "none" (2^32 - 1), which transformers'
    # loader takes for an id
    write_gguf(out, hf, "llama", raw_tensors=raw,
               metadata={"tokenizer.ggml.padding_token_id": None})
    theirs = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name,
                                                  dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    return out, theirs


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tessellm-cache")


def test_k_quant_file_loads_packed(k_file) -> None:
    path, _ = k_file
    gg = load_gguf(path, torch.float32, keep_packed=True)
    matrices = {n: w for n, w in gg.weights.items() if isinstance(w, PackedWeight)}
    assert len(matrices) == 2 + 7 * 2 and not gg.dequantized_types
    assert gg.packed_types == Counter({"Q6_K": 4, "Q4_K": 4, "Q5_K": 4, "Q8_0": 2, "Q5_0": 2})
    stored = sum(w.nbytes for w in matrices.values())
    file_bytes = path.stat().st_size
    assert 0.9 * file_bytes < stored < file_bytes     # the packed bytes are the file's


def test_dequantized_greedy_equals_transformers_gguf_loader(k_file, cache_dir: Path) -> None:
    path, theirs = k_file
    none = make_llm(path, cache_dir, quantization="none")
    prompts = prompts_of(none, theirs.config.vocab_size)
    tokens = []
    for ids in prompts:
        ours, got = prefill_logits_and_greedy(none, ids)
        ref, want = hf_logits_and_greedy(theirs, ids)
        assert got == want, ids
        torch.testing.assert_close(ours, ref, atol=FP32_LOGITS_ATOL, rtol=0)
        tokens += got
    assert len(set(tokens)) >= 4, tokens   # not a degenerate model


def test_packed_logits_equal_the_dequantized_ones(k_file, cache_dir: Path) -> None:
    path, _ = k_file
    none = make_llm(path, cache_dir, quantization="none")
    packed = make_llm(path, cache_dir, kernel_selection={"linear_packed": "linear_packed_native"},
                      max_num_batched_tokens=256)
    assert packed.engine.parts.weight_bytes < 0.3 * none.engine.parts.weight_bytes
    for ids in prompts_of(none, 512):
        a_logits, a_tokens = prefill_logits_and_greedy(packed, ids)
        n_logits, n_tokens = prefill_logits_and_greedy(none, ids)
        assert a_tokens == n_tokens, ids
        torch.testing.assert_close(a_logits, n_logits, atol=FP32_LOGITS_ATOL, rtol=0)


def test_k_quant_gguf_numbers_are_the_stored_blocks(k_file) -> None:
    """What transformers and tessellm run is exactly the stored blocks' dequantization."""
    import gguf
    path, _ = k_file
    gg = load_gguf(path, torch.float32, keep_packed=False)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    np.testing.assert_array_equal(gg.weights["model.layers.1.mlp.down_proj.weight"].numpy(),
                                  want.reshape(256, 512))
