"""Rope variants of GGUF files: Llama 3.1+ files carry their rope scaling as a `rope_freqs`
tensor (a divisor per rotary frequency, no rope metadata); long-context Qwen2.5 files as
`rope.scaling.type = yarn` metadata. Both equal transformers' model with the matching HF
rope_scaling, greedy tokens and logits, past the original context length (32 here)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VT

from gguf_fixtures import STORIES_GGUF, llama3_rope_factors, vocab_of, write_gguf
from hf_fixtures import (ModelCase, _llama3_rope_config, _llama_config, _llama_yarn_config,
                         build_hf_model)
from test_gguf_file import assert_matches_hf, make_llm, prompts_of
from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.gguf_config import gguf_config
from tessellm.models.gguf_file import open_gguf


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tessellm-cache")


def _hf(config, seed: int = 21) -> torch.nn.Module:
    vocab = vocab_of(STORIES_GGUF)
    hf = build_hf_model(ModelCase("rope", lambda: vocab, config, seed), vocab)
    hf.generation_config.eos_token_id = None   # HF greedy must not stop or mask EOS
    return hf


def test_llama3_rope_freqs_file_equals_transformers(tmp_path: Path, cache_dir: Path) -> None:
    hf = _hf(_llama3_rope_config)
    factors = llama3_rope_factors(hf.config)
    assert factors.min() == 1.0 and factors.max() == 8.0   # all three bands are present
    path = write_gguf(tmp_path / "llama31.gguf", hf, "llama",
                      extra_tensors={"rope_freqs.weight": factors})
    config = gguf_config(open_gguf(path))
    assert config["rope_scaling"]["rope_type"] == "freq_factors"
    llm = make_llm(path, cache_dir)
    prompts = prompts_of(llm, hf.config.vocab_size)
    assert max(len(p) for p in prompts) + 16 > 32      # the greedy run passes position 32
    assert_matches_hf(llm, hf, prompts)
    # the factors matter: the same weights without them answer otherwise
    plain = write_gguf(tmp_path / "plain.gguf", _hf(_llama_config), "llama")
    plain_llm = make_llm(plain, cache_dir)
    ids = prompts[-1]
    greedy = llm.generate([ids], _greedy())[0].token_ids
    assert plain_llm.generate([ids], _greedy())[0].token_ids != greedy


def _greedy():
    from tessellm import SamplingParams
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_yarn_metadata_file_equals_transformers(tmp_path: Path, cache_dir: Path) -> None:
    hf = _hf(_llama_yarn_config)
    meta = {"llama.rope.scaling.type": ("yarn", VT.STRING),
            "llama.rope.scaling.factor": (4.0, VT.FLOAT32),
            "llama.rope.scaling.original_context_length": (32, VT.UINT32),
            "llama.context_length": (32, VT.UINT32)}
    path = write_gguf(tmp_path / "yarn.gguf", hf, "llama", metadata=meta)
    config = gguf_config(open_gguf(path))
    assert config["rope_scaling"]["rope_type"] == "yarn"
    assert config["max_position_embeddings"] == 128        # 32 stretched by the factor
    llm = make_llm(path, cache_dir)
    assert_matches_hf(llm, hf, prompts_of(llm, hf.config.vocab_size))


@pytest.mark.parametrize("factors, word", [
    (np.ones(3, np.float32), "must be 8 F32"),
    (np.array([1, 1, 1, 0, 1, 1, 1, 1], np.float32), "finite and positive"),
    (np.array([1, 1, 1, np.nan, 1, 1, 1, 1], np.float32), "finite and positive")])
def test_bad_rope_freqs_are_load_errors(factors, word: str, tmp_path: Path) -> None:
    hf = _hf(_llama_config)
    path = write_gguf(tmp_path / "bad.gguf", hf, "llama",
                      extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(ModelLoadError, match=word):
        gguf_config(open_gguf(path))


def test_unknown_rope_scaling_type_is_refused_by_name(tmp_path: Path) -> None:
    hf = _hf(_llama_config)
    path = write_gguf(tmp_path / "su.gguf", hf, "llama",
                      metadata={"llama.rope.scaling.type": ("longrope", VT.STRING)})
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        gguf_config(open_gguf(path))
