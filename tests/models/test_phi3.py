"""Phi-3 (`Phi3ForCausalLM`, tessellm.models.phi3) beyond the parity matrix.

test_hf_parity.py runs hf_fixtures' `phi3` case (longrope, context 128 past the original
length 4, so transformers and tessellm both use the long factors: fp32 greedy and logits,
bf16). Here: the fused checkpoint tensors split by rows (packed ones stay packed), the short
factors of a context within the original length equal transformers too, the rope scaling
changes the parity case's logits (so its parity says something about it), continuous batching
with preemption changes no output, the sliding window takes the Llama family's path and equals
transformers past the window, and what tessellm does not run is refused by name.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_fixtures import Vocab
from hf_fixtures import (CASES, PHI3_LONG_FACTOR, PHI3_SHORT_FACTOR, ModelCase, _phi3_config,
                         build_hf_model, hf_greedy, phi3_tokenizer, save_model_dir)
from tessellm import LLM, SamplingParams
from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.phi3 import adapt_phi3_weights, phi3_spec
from tessellm.models.spec import llama_family_spec
from tessellm.quant.formats import Q8_0, PackedWeight, quantize

PHI3_VOCAB = Vocab(32064, 1, 32000)   # what _phi3_config reads of the tokenizer
HELLO = [1, 15043, 29892, 590, 1024, 338]   # "Hello, my name is" (Phi-3's tokenizer)
ENGINE_OPTIONS = dict(max_num_seqs=4, block_size=16, num_kv_blocks=64)


def _config_dict(**overrides: Any) -> dict[str, Any]:
    config = _phi3_config(PHI3_VOCAB, **overrides).to_dict()
    config["architectures"] = ["Phi3ForCausalLM"]
    return config


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return phi3_tokenizer()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tessellm-cache")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[Any]:
    """saved(name, **config overrides) -> (HF model, its checkpoint directory), made once."""
    made: dict[str, tuple[torch.nn.Module, Path]] = {}

    def get(name: str, seed: int = 31, **overrides: Any) -> tuple[torch.nn.Module, Path]:
        if name not in made:
            case = ModelCase(name, lambda: tokenizer,
                             lambda tok: _phi3_config(tok, **overrides), seed)
            hf = build_hf_model(case, tokenizer)
            hf.generation_config.eos_token_id = None   # HF greedy must not stop or mask EOS
            made[name] = hf, save_model_dir(hf, tokenizer, tmp_path_factory.mktemp(name))
        return made[name]

    yield get
    made.clear()


@torch.inference_mode()
def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0, -1]


# --------------------------------------------------------------------------- weights


def test_fused_weights_split_by_rows() -> None:
    hf = build_hf_model(CASES["phi3"], PHI3_VOCAB)
    spec = phi3_spec(_config_dict())
    state = hf.state_dict()
    out = adapt_phi3_weights(dict(state), spec)
    assert not any(k.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for k in out)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        qkv = state[f"{p}.self_attn.qkv_proj.weight"]
        gate_up = state[f"{p}.mlp.gate_up_proj.weight"]
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        assert torch.equal(out[f"{p}.self_attn.q_proj.weight"], qkv[:q])
        assert torch.equal(out[f"{p}.self_attn.k_proj.weight"], qkv[q:q + kv])
        assert torch.equal(out[f"{p}.self_attn.v_proj.weight"], qkv[q + kv:])
        inter = spec.intermediate_size
        assert torch.equal(out[f"{p}.mlp.gate_proj.weight"], gate_up[:inter])   # gate first
        assert torch.equal(out[f"{p}.mlp.up_proj.weight"], gate_up[inter:])
    assert torch.equal(out["rope.cos_sin"], spec.rope_cos_sin())


def test_packed_fused_weights_stay_packed() -> None:
    """A Q8_0 qkv / gate_up split by rows: PackedWeights holding the fused tensor's own bytes
    (views), equal to quantizing each part alone (blocks lie within rows)."""
    hf = build_hf_model(CASES["phi3"], PHI3_VOCAB)
    spec = phi3_spec(_config_dict())
    state = hf.state_dict()
    packed = {k: quantize(v, Q8_0) if k.endswith(("qkv_proj.weight", "gate_up_proj.weight"))
              else v for k, v in state.items()}
    out = adapt_phi3_weights(packed, spec)
    fused = packed["model.layers.0.self_attn.qkv_proj.weight"]
    dense = adapt_phi3_weights(dict(state), spec)
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        name = f"model.layers.0.{part}.weight"
        w = out[name]
        assert isinstance(w, PackedWeight) and w.format is Q8_0
        assert torch.equal(w.data, quantize(dense[name], Q8_0).data), part
    q = out["model.layers.0.self_attn.q_proj.weight"]
    assert q.data.untyped_storage().data_ptr() == fused.data.untyped_storage().data_ptr()


def test_missing_or_misshapen_fused_weight_is_a_load_error() -> None:
    hf = build_hf_model(CASES["phi3"], PHI3_VOCAB)
    spec = phi3_spec(_config_dict())
    state = dict(hf.state_dict())
    state.pop("model.layers.1.mlp.gate_up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        adapt_phi3_weights(state, spec)
    state = dict(hf.state_dict())
    name = "model.layers.0.self_attn.qkv_proj.weight"
    state[name] = state[name][:-16]
    with pytest.raises(ModelLoadError, match="qkv_proj.weight has 112 rows"):
        adapt_phi3_weights(state, spec)


# --------------------------------------------------------------------------- spec


@pytest.mark.parametrize("where", ["rope_parameters", "top_level"])
def test_partial_rotary_is_refused_by_name(where: str) -> None:
    """Phi-4-mini rotates 3/4 of each head: refused, naming the field."""
    config = _config_dict()
    if where == "top_level":
        config["rope_parameters"].pop("partial_rotary_factor", None)
        config["partial_rotary_factor"] = 0.75
    else:
        config["rope_parameters"]["partial_rotary_factor"] = 0.75
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        phi3_spec(config)


@pytest.mark.parametrize("change, word", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_fields_are_refused_by_name(change: dict[str, Any], word: str) -> None:
    with pytest.raises(UnsupportedModelError, match=word):
        phi3_spec({**_config_dict(), **change})


@pytest.mark.parametrize("window", [40, 2047, None])
def test_sliding_window_takes_the_llama_family_path(window: int | None) -> None:
    """Phi-3 applies `sliding_window` whenever it is set; its spec is what the Llama family's
    reader makes of the same window with use_sliding_window."""
    config = _config_dict(sliding_window=window)
    ours = phi3_spec(config)
    mistral = {**config, "architectures": ["MistralForCausalLM"], "use_sliding_window": True,
               "rope_parameters": None, "rope_scaling": dict(ours.rope_scaling)}
    theirs = llama_family_spec(mistral)
    assert ours == dataclasses.replace(theirs, architecture="Phi3ForCausalLM")
    if window is None or window >= 128:
        assert ours.max_position_embeddings == 128


# --------------------------------------------------------------------------- against HF


def test_short_factors_within_the_original_length_equal_transformers(
        saved: Any, cache_dir: Path) -> None:
    """Context 64 = the original length (factor 8 given, attention factor sqrt(1 + ln 8 /
    ln 64)): transformers uses the short factors for every call, as tessellm's table does;
    greedy tokens equal, and the short factors matter (the long ones in their place answer
    otherwise)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 8.0,
            "short_factor": PHI3_SHORT_FACTOR, "long_factor": PHI3_LONG_FACTOR}
    hf, path = saved("phi3_short", max_position_embeddings=64,
                     original_max_position_embeddings=64, rope_parameters=rope)
    llm = LLM(model=str(path), device="cpu", dtype="float32", load_progress=False,
              cache_dir=str(cache_dir), **ENGINE_OPTIONS)
    table = llm.engine.parts.spec.rope_cos_sin()
    assert table.shape[0] == 64 and float(table[0, 0]) == pytest.approx((1.5) ** 0.5)
    rng = random.Random(5)
    prompts = [HELLO] + [[1] + [rng.randrange(32064) for _ in range(n)] for n in (11, 27)]
    n = 24
    long_hf, _ = saved("phi3_short_as_long", max_position_embeddings=64,
                       original_max_position_embeddings=64,
                       rope_parameters={**rope, "short_factor": PHI3_LONG_FACTOR})
    differs = 0
    for ids in prompts:
        assert len(ids) + n <= 64
        want = hf_greedy(hf, ids, n)
        got = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
        assert got == want, ids
        differs += hf_greedy(long_hf, ids, n) != want
    assert differs >= 1


def test_sliding_window_equals_transformers(saved: Any, cache_dir: Path) -> None:
    """Phi-3-mini-4k's sliding window (2047 there; 16 here, every layer): greedy runs past it
    equal transformers', which masks keys 16 or more positions back; full attention differs."""
    hf, path = saved("phi3_window", seed=33, sliding_window=16)
    llm = LLM(model=str(path), device="cpu", dtype="float32", load_progress=False,
              cache_dir=str(cache_dir), **ENGINE_OPTIONS)
    rng = random.Random(3)
    n = 30
    for ids in (HELLO, [1] + [rng.randrange(32064) for _ in range(39)]):
        want = hf_greedy(hf, ids, n)
        got = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
        assert got == want, ids
        hf.config.sliding_window = None
        try:
            assert hf_greedy(hf, ids, n) != want, ids
        finally:
            hf.config.sliding_window = 16


def test_longrope_changes_the_parity_case() -> None:
    """The parity case's weights with default rope, or with its short factors in place of the
    long ones, give other logits: its parity checks the long factors and attention factor."""
    longrope = build_hf_model(CASES["phi3"], PHI3_VOCAB)
    for other in ({"rope_type": "default", "rope_theta": 10000.0},
                  {"rope_type": "longrope", "rope_theta": 10000.0,
                   "short_factor": PHI3_SHORT_FACTOR, "long_factor": PHI3_SHORT_FACTOR}):
        case = ModelCase("phi3", lambda: PHI3_VOCAB,
                         lambda tok, o=other: _phi3_config(tok, rope_parameters=dict(o)),
                         CASES["phi3"].seed)
        diff = (_hf_logits(longrope, HELLO) - _hf_logits(build_hf_model(case, PHI3_VOCAB),
                                                         HELLO)).abs().max().item()
        assert diff > 1e-2, other


def test_continuous_batching_with_preemption_matches_alone(saved: Any, cache_dir: Path) -> None:
    """12 prompts through a 40-block pool (4 tokens a block, 32 tokens a step): chunked
    prefills and preemptions, outputs equal each prompt's alone (and transformers' for two)."""
    hf, path = saved("phi3_batch", seed=32)
    rng = random.Random(99)
    lengths = [5, 60] + [rng.randint(5, 60) for _ in range(10)]
    prompts = [[rng.randrange(32064) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=rng.randint(8, 16), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    alone_llm = LLM(model=str(path), device="cpu", dtype="float32", load_progress=False,
                    cache_dir=str(cache_dir), **ENGINE_OPTIONS)
    alone = [alone_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    for p, sp, got in list(zip(prompts, params, alone))[:2]:
        assert got == hf_greedy(hf, p, sp.max_tokens)
    tight = LLM(model=str(path), device="cpu", dtype="float32", load_progress=False,
                cache_dir=str(cache_dir), block_size=4, num_kv_blocks=40,
                max_num_batched_tokens=32, max_num_seqs=6)
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert tight.engine.stats.num_preemptions > 0
