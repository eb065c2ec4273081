"""Tensor parallelism end to end on this machine: 2 ranks (processes) over gloo, 1 thread each,
against one process, float32.

For stories260K and random-weight Llama (GQA 4/2), Qwen3 (q/k norm), GPT-2 (biases, tied
head, learned positions) and Phi-3 (fused qkv / gate_up checkpoint, longrope) shapes: greedy tokens are identical and prefill logits agree within
1e-5; with one KV head over 2 ranks (replicated) tokens are identical too. A rank's KV pool
holds its KV heads only; killing a rank fails the open requests at once and the engine stays
dead; torchrun's environment (two processes on loopback) runs the same engine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_fixtures import CASES, STORIES_260K, build_hf_model, save_model_dir
from parallel_fixtures import assert_killed_worker_fails_requests
from logits_probe import prefill_logits_and_token
from tessellm import LLM, SamplingParams
from tessellm.errors import ConfigError

pytestmark = pytest.mark.slow

LOGITS_ATOL = 1e-5
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ([1, 403, 407, 261, 378], [1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140,
                                      150, 160, 170, 180, 190, 200])
OPTIONS = dict(device="cpu", dtype="float32", num_threads=1, max_num_seqs=4, block_size=16,
               num_kv_blocks=32, load_progress=False)


def _llm(path: Path, cache: Path, tp: int, **extra) -> LLM:
    return LLM(str(path), cache_dir=str(cache), tensor_parallel_size=tp, **{**OPTIONS, **extra})


def _results(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    tokens = [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], GREEDY)]
    logits = [prefill_logits_and_token(llm, list(p))[0] for p in PROMPTS]
    return tokens, logits


def _compare(path: Path, cache: Path, **extra) -> None:
    with _llm(path, cache, 1, **extra) as one:
        want_tokens, want_logits = _results(one)
    with _llm(path, cache, 2, **extra) as two:
        got_tokens, got_logits = _results(two)
        stats = two.engine.parts.parallel.stats
        assert stats.calls > 0 and stats.seconds > 0
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp-cache")


def test_stories260k_two_ranks_equal_one_and_the_reference(cache):
    ref = json.loads((STORIES_260K / "reference_greedy.json").read_text())
    prompt = ref["token_ids"][:5]
    _compare(STORIES_260K, cache)
    with _llm(STORIES_260K, cache, 2) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0,
                                                    ignore_eos=True))[0]
    assert prompt + out.token_ids == ref["token_ids"][:45]


@pytest.mark.parametrize("case", ["llama", "qwen3", "gpt2", "phi3", "mixtral", "qwen2_moe",
                                  "gemma2"])
def test_random_weight_models_two_ranks_equal_one(case, tmp_path, cache):
    c = CASES[case]
    tok = c.tokenizer()
    path = save_model_dir(build_hf_model(c, tok), tok, tmp_path / case)
    _compare(path, cache)


def test_one_kv_head_is_replicated_on_both_ranks(tmp_path, cache):
    c = CASES["llama"]
    tok = c.tokenizer()
    from transformers import AutoModelForCausalLM
    from hf_fixtures import randomize_weights
    config = c.config(tok)
    config.num_key_value_heads = 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, 11)
    path = save_model_dir(model.eval(), tok, tmp_path / "mqa")
    _compare(path, cache)


def test_a_ranks_kv_pool_holds_its_kv_heads_only(cache):
    with _llm(STORIES_260K, cache, 1) as one:
        one_bytes = sum(c.nbytes for c in one.engine.parts.kv_caches)
        one_blocks = one.engine.kv.num_blocks
    with _llm(STORIES_260K, cache, 2) as two:
        parts = two.engine.parts
        two_bytes = sum(c.nbytes for c in parts.kv_caches)
        assert two.engine.kv.num_blocks == one_blocks
        assert two_bytes * 2 == one_bytes
        assert parts.kv_caches[0].shape[2] == parts.spec.num_kv_heads // 2
        # the sharded graph: one all_reduce per row-parallel linear and one for the embedding,
        # the LM head's logits gathered; the fusion passes still ran on it
        assert "fuse_qkv" in parts.pass_report.applied
        assert "fuse_gate_up" in parts.pass_report.applied


def test_heads_the_ranks_cannot_split_are_a_clear_error(cache):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 cannot split.*heads"):
        _llm(STORIES_260K, cache, 3)


def test_killing_a_rank_fails_the_open_requests_and_the_engine_stays_dead(cache):
    llm = _llm(STORIES_260K, cache, 2, num_kv_blocks=64)
    try:
        assert_killed_worker_fails_requests(llm, "rank")
    finally:
        llm.close()


@pytest.mark.parametrize("split", ["--tensor-parallel-size",
                                   pytest.param("--pipeline-parallel-size",
                                                marks=pytest.mark.slow)])
def test_torchrun_environment_runs_the_same_engine(tmp_path, cache, split):
    """Two processes started by torchrun on loopback: rank 0 runs `tessellm generate`, rank 1
    becomes its worker (the second shard, or pipeline stage 1)."""
    ref = json.loads((STORIES_260K / "reference_greedy.json").read_text())
    env = {**os.environ, "TESSELLM_CACHE_DIR": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tessellm.cli.main",
         "generate", "--model", str(STORIES_260K), "--dtype", "float32", "--threads", "1",
         split, "2", "--num-kv-blocks", "32", "--max-tokens", "40",
         "--temperature", "0", "--ignore-eos", "--prompt", "Once upon a time"],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ref["text"].removeprefix(ref["prompt"]).strip() in proc.stdout



def test_packed_gguf_weights_split_over_two_ranks(tmp_path, cache):
    """A Q8_0 GGUF file stays packed on each rank: rows split for column-parallel linears
    and the vocabulary, whole 32-weight blocks of columns for row-parallel ones."""
    from gguf_fixtures import default_tokenizer_gguf, vocab_of, write_gguf
    from hf_fixtures import ModelCase
    from tessellm.quant.formats import PackedWeight
    tok_path = default_tokenizer_gguf("llama")
    vocab = vocab_of(tok_path)
    c = CASES["llama"]
    hf = build_hf_model(ModelCase(c.name, lambda: vocab, c.config, c.seed), vocab)
    path = write_gguf(tmp_path / "llama-q8_0.gguf", hf, "llama", qtype="Q8_0",
                      tokenizer_gguf=tok_path)
    with _llm(path, cache, 2) as two:
        packed = [w for w in two.engine.parts.weights.values() if isinstance(w, PackedWeight)]
        assert len(packed) >= 2 * 4
    _compare(path, cache)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_copy_on_write_replay_on_every_rank(mode, cache):
    """A pool too small for the batch (preemptions, swapped blocks copied out and back on
    each rank) and n=2 siblings (copy-on-write blocks): the same tokens as one process."""
    prompts = [[1, *range(20 + 7 * i, 60 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
    extra = dict(num_kv_blocks=12, preemption_mode=mode)
    results = []
    for tp in (1, 2):
        with _llm(STORIES_260K, cache, tp, **extra) as llm:
            outs = llm.generate(prompts, params)
            results.append([[s.token_ids for s in o.outputs] for o in outs])
            assert llm.engine.stats.num_preemptions > 0
            if mode == "swap":
                assert llm.engine.stats.num_swapped_in_blocks > 0
    assert results[0] == results[1]
