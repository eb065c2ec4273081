"""Gemma 2 / Gemma 3 GGUF files (tessellm.models.gguf_gemma): files written from random-weight
transformers models as llama.cpp's converter writes them (norms as 1 + w, post_attention_norm /
ffn_norm / post_ffw_norm, soft-caps, window; no query_pre_attn_scalar, which llama.cpp derives:
the HF models here are built with the value it derives, head_dim) give the HF model's greedy
tokens and prefill logits, and equal transformers' own GGUF loader on the same file (given the
settings that loader does not read). The sliding-layer pattern is read as a bool per layer, as
a period, or implied (gemma3's fixed period 6). Q8_0 files keep their matrices packed and
equal the same file dequantized at load; a damaged file is refused by name."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_fixtures import STORIES_GGUF, dequantized_state_dict, vocab_of, write_gguf
from hf_fixtures import ModelCase, _gemma2_config, _gemma3_config, build_hf_model
from logits_probe import recorded_logits
from tessellm import LLM, SamplingParams
from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.gemma import gemma_spec
from tessellm.models.gguf_config import gguf_config
from tessellm.models.gguf_file import load_gguf, open_gguf
from tessellm.quant.formats import PackedWeight

pytestmark = pytest.mark.skipif(not STORIES_GGUF.is_file(),
                                reason="../shared models not available")

NUM_GREEDY = 12
GREEDY = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True)
# longer than the window of 8 (with the greedy tokens too), so sliding layers mask
PROMPTS = ([1, 403, 407, 261, 378, 30, 77, 12], [5, 99, 300, 7, 42, 8, 11, 250, 17, 3, 400])


def _llama_cpp_scalar(config_fn, **changes: Any):
    """The fixture's config with the query scalar a llama.cpp file implies (head_dim)."""
    def build(tok: Any) -> Any:
        config = config_fn(tok)
        config.query_pre_attn_scalar = config.head_dim
        for key, value in changes.items():
            setattr(config, key, value)
        return config
    return build


def _gemma3_seven_layers(tok: Any) -> Any:
    """7 layers in transformers' default Gemma 3 pattern (layer 5 full): what a llama.cpp
    file implies without a sliding_window_pattern key."""
    from transformers import Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, max_position_embeddings=512, sliding_window=8,
                           query_pre_attn_scalar=32, rope_theta=1_000_000.0,
                           rope_local_base_freq=10_000.0,
                           rope_scaling={"rope_type": "linear", "factor": 2.0},
                           rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=0,
                           attn_implementation="eager")
    cfg.architectures = ["Gemma3ForCausalLM"]
    assert [t == "full_attention" for t in cfg.layer_types] == [i == 5 for i in range(7)]
    return cfg


CASES = {"gemma2": ("gemma2", _llama_cpp_scalar(_gemma2_config)),
         "gemma3": ("gemma3", _llama_cpp_scalar(_gemma3_config)),
         "gemma3_period6": ("gemma3", _gemma3_seven_layers)}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    vocab = vocab_of(STORIES_GGUF)
    d = tmp_path_factory.mktemp("gemma-gguf")
    for i, (name, (arch, config)) in enumerate(CASES.items()):
        hf = build_hf_model(ModelCase(name, lambda: vocab, config, 60 + i), vocab)
        hf.generation_config.eos_token_id = None
        # stories260K has no pad token (llama.cpp's 2^32 - 1): transformers' GGUF loader
        # would take it as a padding index, so the key is left out
        out[name] = (hf, write_gguf(d / f"{name}.gguf", hf, arch,
                                    metadata={"tokenizer.ggml.padding_token_id": None}))
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def engines(files, cache_dir: Path) -> dict[str, LLM]:
    """One engine per written file, shared by the tests that read it unchanged."""
    return {name: _llm(path, cache_dir) for name, (_, path) in files.items()}


def _llm(path: Path, cache_dir: Path, **options: Any) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", load_progress=False,
               cache_dir=str(cache_dir), max_num_seqs=4, block_size=16, num_kv_blocks=64,
               **options)


def _ours(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    with recorded_logits(llm) as seen:
        out = llm.generate([ids], GREEDY)[0]
    return seen[0][0], out.token_ids


@torch.inference_mode()
def _hf(hf: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    prompt = torch.tensor([ids])
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      max_new_tokens=NUM_GREEDY, min_new_tokens=NUM_GREEDY)
    return hf(prompt).logits[0, -1], out[0, len(ids):].tolist()


def _assert_matches(llm: LLM, hf: torch.nn.Module) -> None:
    for ids in PROMPTS:
        ours, got = _ours(llm, ids)
        theirs, want = _hf(hf, ids)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert got == want


@pytest.mark.parametrize("name", list(CASES))
def test_gemma_gguf_config(name: str, files) -> None:
    hf, path = files[name]
    config = gguf_config(open_gguf(path))
    c = hf.config
    assert config["architectures"] == [type(hf).__name__]
    assert config["layer_types"] == list(c.layer_types)
    assert "full_attention" in config["layer_types"] and "sliding_attention" in config[
        "layer_types"]
    for key in ("sliding_window", "query_pre_attn_scalar", "head_dim", "attn_logit_softcapping",
                "final_logit_softcapping", "hidden_activation"):
        assert config[key] == getattr(c, key), key
    spec = gemma_spec(config)
    assert spec.sliding_layers == tuple(i for i, t in enumerate(c.layer_types)
                                        if t == "sliding_attention")
    if name == "gemma2":
        assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (5.0, 10.0)
        assert not spec.gemma3
    else:
        rope = c.rope_parameters
        assert spec.gemma3 and spec.qk_norm
        assert spec.rope_theta == rope["full_attention"]["rope_theta"]
        assert dict(spec.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
        assert spec.local_rope_theta == rope["sliding_attention"]["rope_theta"]
        assert spec.local_rope_scaling == ()


@pytest.mark.parametrize("name", list(CASES))
def test_gemma_gguf_matches_the_hf_model(name: str, files, engines) -> None:
    hf, _ = files[name]
    _assert_matches(engines[name], hf)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_gguf_equals_transformers_gguf_loader(name: str, files, engines) -> None:
    """The same file read by transformers' GGUF loader (its tensors and the config keys it
    maps). Its config mapping reads no soft-caps, query scalar, sliding pattern or gemma3 rope
    scaling: those are set from the HF model (and the keys it does read are checked)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    hf, path = files[name]
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for key in ("head_dim", "sliding_window", "num_key_value_heads", "intermediate_size"):
        assert getattr(config, key) == getattr(hf.config, key), key
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "layer_types", "rope_parameters"):
        setattr(config, key, copy.deepcopy(getattr(hf.config, key)))
    theirs_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32).eval()
    theirs_model.generation_config.eos_token_id = None
    _assert_matches(engines[name], theirs_model)


def test_sliding_pattern_as_a_period(files, tmp_path: Path) -> None:
    """`attention.sliding_window_pattern` as llama.cpp's period (layer i slides iff
    i % p < p - 1) reads as the bool-per-layer form; a list of the wrong length is refused."""
    import gguf
    hf, path = files["gemma3"]
    period = write_gguf(tmp_path / "period.gguf", hf, "gemma3", metadata={
        "gemma3.attention.sliding_window_pattern": (2, gguf.GGUFValueType.UINT32)})
    assert open_gguf(period).fields["gemma3.attention.sliding_window_pattern"].contents() == 2
    assert gguf_config(open_gguf(period))["layer_types"] == gguf_config(open_gguf(path))[
        "layer_types"]
    all_full = write_gguf(tmp_path / "p1.gguf", hf, "gemma3", metadata={
        "gemma3.attention.sliding_window_pattern": (1, gguf.GGUFValueType.UINT32)})
    assert gemma_spec(gguf_config(open_gguf(all_full))).sliding_layers == ()
    short = write_gguf(tmp_path / "short.gguf", hf, "gemma3", metadata={
        "gemma3.attention.sliding_window_pattern": ([True, False], gguf.GGUFValueType.ARRAY)})
    with pytest.raises(ModelLoadError, match="sliding_window_pattern must be one bool per layer"):
        gguf_config(open_gguf(short))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_quantized_gemma_gguf_keeps_matrices_packed(name: str, files, tmp_path: Path,
                                                    cache_dir: Path) -> None:
    """Q8_0 matrices (embedding = tied head, q/k/v/o, gate/up/down) stay packed and equal the
    file dequantized at load, which equals transformers on the dequantized numbers."""
    hf, _ = files[name]
    arch = CASES[name][0]
    path = write_gguf(tmp_path / f"{name}-q8.gguf", hf, arch, qtype="Q8_0")
    gg = load_gguf(path, torch.float32, keep_packed=True)
    matrices = {n: w for n, w in gg.weights.items() if not n.endswith("norm.weight")}
    assert len(matrices) == 1 + 7 * hf.config.num_hidden_layers
    assert all(isinstance(w, PackedWeight) for w in matrices.values())
    assert not any(isinstance(w, PackedWeight) for n, w in gg.weights.items()
                   if n.endswith("norm.weight"))
    auto, none = _llm(path, cache_dir), _llm(path, cache_dir, quantization="none")
    assert isinstance(auto.engine.parts.weights["model.embed_tokens.weight"], PackedWeight)
    assert sum(isinstance(w, PackedWeight) for w in auto.engine.parts.weights.values()) >= (
        1 + 3 * hf.config.num_hidden_layers)   # qkv and gate/up may be fused
    assert not any(isinstance(w, PackedWeight) for w in none.engine.parts.weights.values())
    hf_deq = copy.deepcopy(hf)
    hf_deq.load_state_dict(dequantized_state_dict(path, hf, arch))
    for ids in PROMPTS:
        a_logits, a_tokens = _ours(auto, ids)
        n_logits, n_tokens = _ours(none, ids)
        h_logits, h_tokens = _hf(hf_deq, ids)
        assert a_tokens == n_tokens == h_tokens
        torch.testing.assert_close(a_logits, n_logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(n_logits, h_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name,missing", [("gemma2", "blk.1.post_ffw_norm.weight"),
                                          ("gemma3", "blk.2.attn_k_norm.weight"),
                                          ("gemma3", "blk.0.post_attention_norm.weight")])
def test_gemma_gguf_missing_tensor_is_a_load_error(name: str, missing: str, files,
                                                   tmp_path: Path, cache_dir: Path) -> None:
    hf, _ = files[name]
    path = write_gguf(tmp_path / "damaged.gguf", hf, CASES[name][0], omit=[missing])
    with pytest.raises(ModelLoadError, match=f"lacks tensor.*{missing.replace('.', '[.]')}"):
        load_gguf(path, torch.float32, keep_packed=True)
    with pytest.raises(ModelLoadError, match=missing.replace(".", "[.]")):
        _llm(path, cache_dir)


def test_gemma_gguf_settings_it_cannot_run_are_refused(files, tmp_path: Path) -> None:
    import gguf
    import numpy as np
    hf, _ = files["gemma2"]
    local = write_gguf(tmp_path / "swa-theta.gguf", hf, "gemma2", metadata={
        "gemma2.rope.freq_base_swa": (5000.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(UnsupportedModelError, match="freq_base_swa 5000.0 differs"):
        gguf_config(open_gguf(local))
    bias = write_gguf(tmp_path / "bias.gguf", hf, "gemma2", extra_tensors={
        "blk.0.attn_q.bias": np.zeros(64, np.float32)})
    with pytest.raises(UnsupportedModelError, match="bias tensors are not supported"):
        gguf_config(open_gguf(bias))
