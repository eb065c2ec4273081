"""llama.cpp's `phi3` GGUF files (gguf_fixtures.write_gguf writes them as convert_hf_to_gguf.py's
Phi3MiniModel does: fused attn_qkv, ffn_up holding [gate | up], longrope as the
rope_factors_long / _short tensors with rope.scaling.attn_factor and original_context_length).

- Default rope (Phi-3-mini-4k's layout): equal to transformers' own GGUF loader on the file and
  to the HF model it was written from (greedy tokens, prefill logits within 1e-4).
- Longrope (Phi-3-mini-128k / Phi-3.5-mini): equal to the HF model it was written from
  (transformers' GGUF loader reads no rope factors for phi3, so it is no reference there).
- Q8_0: the fused tensors split by rows stay packed; "auto" equals "none", which equals
  transformers on the dequantized numbers.
- Damaged rope factors, a missing fused tensor and partial rotary are refused by name.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VT

from gguf_fixtures import STORIES_GGUF, dequantized_state_dict, vocab_of, write_gguf
from hf_fixtures import ModelCase, _phi3_config, build_hf_model
from test_gguf_file import (FP32_LOGITS_ATOL, assert_matches_hf, make_llm, packed_in_plan,
                            prefill_logits_and_greedy, prompts_of)
from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.architectures import resolve_architecture
from tessellm.models.gguf_config import gguf_config
from tessellm.models.gguf_file import load_gguf, open_gguf
from tessellm.quant.formats import PackedWeight

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# transformers' GGUF loader builds its embedding with the file's padding id: a real one
PAD = {"tokenizer.ggml.padding_token_id": (0, VT.UINT32)}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tessellm-cache")


def _hf(seed: int, **overrides: Any) -> torch.nn.Module:
    vocab = vocab_of(STORIES_GGUF)
    case = ModelCase("phi3", lambda: vocab, lambda tok: _phi3_config(tok, **overrides), seed)
    hf = build_hf_model(case, vocab)
    hf.generation_config.eos_token_id = None   # HF greedy must not stop or mask EOS
    return hf


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf = _hf(41)
    return hf, write_gguf(tmp_path_factory.mktemp("phi3") / "phi3-longrope.gguf", hf, "phi3")


def test_default_rope_file_equals_transformers_gguf_loader(tmp_path: Path,
                                                           cache_dir: Path) -> None:
    from transformers import AutoModelForCausalLM
    hf = _hf(42, rope_parameters=DEFAULT_ROPE)
    path = write_gguf(tmp_path / "phi3.gguf", hf, "phi3", metadata=PAD)
    config = gguf_config(open_gguf(path))
    assert config["architectures"] == ["Phi3ForCausalLM"] and "rope_scaling" not in config
    assert config["sliding_window"] == 2047
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    llm = make_llm(path, cache_dir)
    assert not packed_in_plan(llm)
    prompts = prompts_of(llm, hf.config.vocab_size)
    tokens = assert_matches_hf(llm, theirs, prompts)
    assert assert_matches_hf(llm, hf, prompts) == tokens
    assert len(set(tokens)) >= 4, tokens


def test_longrope_file_equals_the_hf_model(longrope: tuple[torch.nn.Module, Path],
                                           cache_dir: Path) -> None:
    hf, path = longrope
    config = gguf_config(open_gguf(path))
    rope = config["rope_scaling"]
    assert rope["rope_type"] == "longrope" and config["original_max_position_embeddings"] == 4
    assert rope["long_factor"] == pytest.approx(hf.config.rope_parameters["long_factor"])
    assert rope["attention_factor"] == pytest.approx(hf.model.rotary_emb.attention_scaling)
    llm = make_llm(path, cache_dir)
    tokens = assert_matches_hf(llm, hf, prompts_of(llm, hf.config.vocab_size))
    assert len(set(tokens)) >= 4, tokens


def test_q8_0_file_keeps_the_split_tensors_packed(longrope: tuple[torch.nn.Module, Path],
                                                  cache_dir: Path) -> None:
    hf, f32 = longrope
    path = write_gguf(f32.with_name("phi3-q8_0.gguf"), hf, "phi3", qtype="Q8_0")
    gg = load_gguf(path, torch.float32, keep_packed=True)
    arch = resolve_architecture(gg.config)
    weights = arch.adapt_gguf_weights(gg.weights, arch.spec(gg.config))
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        assert isinstance(weights[f"model.layers.1.{part}.weight"], PackedWeight), part
    auto, none = make_llm(path, cache_dir), make_llm(path, cache_dir, quantization="none")
    assert packed_in_plan(auto) and not packed_in_plan(none)
    hf_deq = copy.deepcopy(hf)
    hf_deq.load_state_dict(dequantized_state_dict(path, hf, "phi3"))
    prompts = prompts_of(none, hf.config.vocab_size)
    assert_matches_hf(none, hf_deq, prompts)
    for ids in prompts:
        a_logits, a_tokens = prefill_logits_and_greedy(auto, ids)
        n_logits, n_tokens = prefill_logits_and_greedy(none, ids)
        assert a_tokens == n_tokens, ids
        torch.testing.assert_close(a_logits, n_logits, atol=FP32_LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("change, error, words", [
    ({"omit": ["rope_factors_short.weight"]}, ModelLoadError,
     ("rope_factors_long.weight", "rope_factors_short.weight")),
    ({"extra_tensors": {"rope_factors_long.weight": np.ones(5, np.float32)}}, ModelLoadError,
     ("rope_factors_long.weight", "8 F32")),
    ({"omit": ["blk.1.attn_qkv.weight"]}, ModelLoadError, ("blk.1.attn_qkv.weight",)),
    ({"metadata": {"phi3.rope.dimension_count": (12, VT.UINT32)}}, UnsupportedModelError,
     ("partial rotary",)),
])
def test_damaged_phi3_files_are_refused_by_name(change: dict[str, Any], error: type,
                                                words: tuple[str, ...],
                                                longrope: tuple[torch.nn.Module, Path],
                                                tmp_path: Path) -> None:
    hf, _ = longrope
    path = write_gguf(tmp_path / "bad.gguf", hf, "phi3", **change)
    with pytest.raises(error) as exc:
        load_gguf(path, torch.float32, keep_packed=True)
    for word in words:
        assert word in str(exc.value), (word, str(exc.value))
