"""Mixture-of-experts GGUF files (tessellm.models.gguf_moe): files written from random-weight
transformers models as llama.cpp's converter writes them (stacked `ffn_*_exps` experts, the
router as `ffn_gate_inp`, Qwen2-MoE's shared expert as `*_shexp`) give transformers' greedy
tokens and logits: through transformers' own GGUF loader for qwen2moe / qwen3moe (which it
reads), and against the HF model the file was written from for Mixtral (`llama` with
`expert_count`, which transformers' GGUF loader does not read). Quantized files keep their
experts packed and equal the same file dequantized at load."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_fixtures import STORIES_GGUF, dequantized_state_dict, vocab_of, write_gguf
from hf_fixtures import (ModelCase, _mixtral_config, _qwen2_moe_config, _qwen3_moe_config,
                         build_hf_model)
from logits_probe import recorded_logits
from tessellm import LLM, SamplingParams
from tessellm.errors import ModelLoadError
from tessellm.models.gguf_config import gguf_config
from tessellm.models.gguf_file import load_gguf, open_gguf
from tessellm.quant.formats import PackedWeight

pytestmark = pytest.mark.skipif(not STORIES_GGUF.is_file(),
                                reason="../shared models not available")

NUM_GREEDY = 12
GREEDY = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True)
PROMPTS = ([1, 403, 407, 261, 378, 30, 77, 12], [5, 99, 300, 7, 42, 8, 11, 250, 17, 3, 400])
CASES = {"mixtral": ("llama", _mixtral_config), "qwen2_moe": ("qwen2moe", _qwen2_moe_config),
         "qwen3_moe": ("qwen3moe", _qwen3_moe_config)}


def _all_expert_layers(config_fn):
    """The config without dense layers: llama.cpp's MoE files route every layer."""
    def build(tok: Any) -> Any:
        config = config_fn(tok)
        if hasattr(config, "mlp_only_layers"):
            config.mlp_only_layers = []
        return config
    return build


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    vocab = vocab_of(STORIES_GGUF)
    d = tmp_path_factory.mktemp("moe-gguf")
    for i, (name, (arch, config)) in enumerate(CASES.items()):
        hf = build_hf_model(ModelCase(name, lambda: vocab, _all_expert_layers(config), 40 + i),
                            vocab)
        hf.generation_config.eos_token_id = None
        out[name] = (hf, write_gguf(d / f"{name}.gguf", hf, arch))
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


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


@pytest.mark.parametrize("name", list(CASES))
def test_moe_gguf_config(name: str, files) -> None:
    hf, path = files[name]
    config = gguf_config(open_gguf(path))
    c = hf.config
    assert config["architectures"] == [type(hf).__name__]
    assert config["num_experts_per_tok"] == c.num_experts_per_tok
    experts = config.get("num_experts") or config.get("num_local_experts")
    assert experts == (getattr(c, "num_local_experts", None) or c.num_experts)
    if name != "mixtral":
        assert config["moe_intermediate_size"] == c.moe_intermediate_size
        assert config["norm_topk_prob"] == c.norm_topk_prob   # llama.cpp's routing rule
        assert config["mlp_only_layers"] == []


@pytest.mark.parametrize("name", list(CASES))
def test_moe_gguf_matches_the_hf_model(name: str, files, cache_dir: Path) -> None:
    hf, path = files[name]
    llm = _llm(path, cache_dir)
    for ids in PROMPTS:
        ours, got = _ours(llm, ids)
        theirs, want = _hf(hf, ids)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert got == want


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_moe_gguf_equals_transformers_gguf_loader(name: str, files, tmp_path: Path,
                                                 cache_dir: Path) -> None:
    """transformers reads qwen2moe / qwen3moe GGUF files itself: the same file, two loaders
    (its config mapping lacks the expert sizes, which the test passes it)."""
    from transformers import AutoModelForCausalLM
    hf, _ = files[name]
    # stories260K's vocabulary has no pad token (llama.cpp's 2^32 - 1), which transformers'
    # loader would make a padding index: the file leaves the key out
    path = write_gguf(tmp_path / f"{name}.gguf", hf, CASES[name][0],
                      metadata={"tokenizer.ggml.padding_token_id": None})
    # transformers' GGUF config mapping does not read expert_feed_forward_length (nor the
    # shared expert's): those sizes are passed to it; the tensors are its loader's own
    sizes = {k: getattr(hf.config, k) for k in ("moe_intermediate_size",
                                                "shared_expert_intermediate_size")
             if getattr(hf.config, k, None)}
    theirs_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                        dtype=torch.float32, **sizes).eval()
    theirs_model.generation_config.eos_token_id = None
    llm = _llm(path, cache_dir)
    for ids in PROMPTS:
        ours, got = _ours(llm, ids)
        theirs, want = _hf(theirs_model, ids)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert got == want


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_quantized_moe_gguf_keeps_experts_packed(name: str, files, tmp_path: Path,
                                                cache_dir: Path) -> None:
    """Q8_0 experts stay packed (fused_moe_packed) and equal the file dequantized at load,
    which equals transformers on the dequantized numbers. Mixtral's expert width (48) is not
    a multiple of Q8_0's block: its down stacks stay F32 in the file, so its gate/up stacks
    are expanded at load (one expert op reads one kind of weights)."""
    hf, _ = files[name]
    arch = CASES[name][0]
    path = write_gguf(tmp_path / f"{name}-q8.gguf", hf, arch, qtype="Q8_0")
    gg = load_gguf(path, torch.float32, keep_packed=True)
    stacks = [w for n, w in gg.weights.items() if ".mlp.experts." in n]
    assert len(stacks) == 3 * hf.config.num_hidden_layers and all(
        isinstance(w, PackedWeight) == (name != "mixtral" or "down" not in n)
        for n, w in gg.weights.items() if ".mlp.experts." in n)
    auto, none = _llm(path, cache_dir), _llm(path, cache_dir, quantization="none")
    run = {n: w for n, w in auto.engine.parts.weights.items() if ".experts." in n}
    assert len(run) == 2 * hf.config.num_hidden_layers
    assert all(isinstance(w, PackedWeight) == (name != "mixtral") for w in run.values())
    assert not any(isinstance(w, PackedWeight) for w in none.engine.parts.weights.values())
    import copy
    hf_deq = copy.deepcopy(hf)
    hf_deq.load_state_dict(dequantized_state_dict(path, hf, arch))
    for ids in PROMPTS:
        a_logits, a_tokens = _ours(auto, ids)
        n_logits, n_tokens = _ours(none, ids)
        h_logits, h_tokens = _hf(hf_deq, ids)
        assert a_tokens == n_tokens == h_tokens
        torch.testing.assert_close(a_logits, n_logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(n_logits, h_logits, atol=1e-4, rtol=0)


def test_q8_activations_reach_the_experts(files, tmp_path: Path, cache_dir: Path) -> None:
    """packed_activations="q8_0" on a MoE file: the experts op becomes fused_moe_packed_q8act
    too; its C (VNNI) kernel and its torch form give the same tokens (logits within the
    effect of one int8 rounding step, as tests/engine/test_quantization.py explains), and
    against float activations the logits move by the rounding."""
    hf, _ = files["qwen3_moe"]
    path = write_gguf(tmp_path / "qwen3_moe-q8.gguf", hf, CASES["qwen3_moe"][0], qtype="Q8_0")
    float_logits, _ = _ours(_llm(path, cache_dir), PROMPTS[0])
    runs = []
    for kernel in ("fused_moe_q8act_vnni", "fused_moe_packed_q8act_torch"):
        llm = _llm(path, cache_dir, packed_activations="q8_0",
                   kernel_selection={"fused_moe_packed_q8act": kernel})
        report = llm.engine.parts.pass_report
        assert {"q8_activations", "q8_activations_experts"} <= set(report.applied)
        labels = llm.engine.parts.plan.describe()
        assert sum("ops.fused_moe_packed_q8act]" in x for x in labels) == \
            hf.config.num_hidden_layers
        assert not any("ops.fused_moe_packed]" in x for x in labels)
        runs.append(_ours(llm, PROMPTS[0]))
    (a_logits, a_tokens), (b_logits, b_tokens) = runs
    assert a_tokens == b_tokens
    torch.testing.assert_close(a_logits, b_logits, atol=0.3, rtol=0)
    assert 1e-4 < (a_logits - float_logits).abs().max().item() < 1.0


def test_moe_gguf_with_bad_expert_counts_is_a_load_error(files, tmp_path: Path) -> None:
    import gguf
    hf, _ = files["qwen3_moe"]
    path = write_gguf(tmp_path / "bad.gguf", hf, "qwen3moe", metadata={
        "qwen3moe.expert_used_count": (99, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ModelLoadError, match="expert_used_count 99"):
        gguf_config(open_gguf(path))
