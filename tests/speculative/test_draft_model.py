"""The draft_model method: a draft engine with the target's tokenizer drafts greedily; the
target's outputs are exactly what they are without speculation (greedy and seeded, mixed
batches, preemption), the draft's blocks all return, and a draft with another vocabulary is
refused at load naming the difference."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.errors import ConfigError, ModelLoadError
from tessellm.models.source import default_model_file

PROMPTS = ["Once upon a time, there was a little girl named Lily. She",
           "Tom and his dog went to the park.", "The sun was"]
BASE = dict(dtype="float32", load_progress=False)


def draft_config(model: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k,
            "adaptive": False, **extra}


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(stories_dir) -> LLM:
    return LLM(str(stories_dir), **BASE)


def test_a_model_drafting_for_itself_is_always_accepted_and_exact(stories_dir, plain):
    llm = LLM(str(stories_dir), speculative_config=draft_config(str(stories_dir)), **BASE)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert tokens(llm, PROMPTS, greedy) == tokens(plain, PROMPTS, greedy)
    stats = llm.engine.speculator.stats
    assert stats.verify_steps > 0 and stats.accepted_tokens == stats.draft_tokens
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    assert tokens(llm, PROMPTS, seeded) == tokens(plain, PROMPTS, seeded)
    draft = llm.engine.speculator.proposer.engine
    assert not draft.has_unfinished() and draft.kv.num_free_blocks == draft.kv.num_blocks


def test_a_quantized_draft_with_a_tiny_pool_keeps_the_tokens(stories_dir, plain):
    """The draft quantized to q4_0 at load (so it disagrees now and then), the target's
    pool small enough to preempt: tokens identical, some drafts rejected."""
    llm = LLM(str(stories_dir), block_size=4, num_kv_blocks=30, max_num_seqs=3,
              speculative_config=draft_config(str(stories_dir), 4, quantization="q4_0"),
              **BASE)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    assert tokens(llm, PROMPTS, params) == tokens(plain, PROMPTS, params)
    assert llm.engine.stats.num_preemptions > 0
    stats = llm.engine.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens   # (106 of 129 when written)


def test_a_draft_with_another_vocabulary_is_refused(stories_dir, qwen3_random_dir):
    with pytest.raises(ConfigError, match="does not share the target's vocabulary"):
        LLM(str(stories_dir), speculative_config=draft_config(str(qwen3_random_dir)), **BASE)


def test_a_missing_draft_model_is_a_clear_error(stories_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-draft.*is not a directory"):
        LLM(str(stories_dir), speculative_config=draft_config(str(tmp_path / "no-such-draft")),
            **BASE)


@pytest.mark.slow
def test_smollm2_q4_drafting_for_smollm2_bf16():
    """The issue's pairing: SmolLM2's Q4_1 GGUF (packed) drafting for the same file
    dequantized to bfloat16: greedy tokens identical to the bf16 target alone."""
    model = str(default_model_file())
    # kernel_selection "first": the same kernels in both engines whatever the timings say
    target = dict(quantization="none", dtype="bfloat16", load_progress=False, max_num_seqs=2,
                  kernel_selection="first")
    prompts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n   ", "The capital of"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(model, **target), prompts, params)
    llm = LLM(model, speculative_config=draft_config(model, 3), **target)
    assert tokens(llm, prompts, params) == want
    assert llm.engine.speculator.stats.accepted_tokens > 0


def test_a_request_the_draft_engine_cannot_take_decodes_without_drafts(stories_dir, plain):
    """A draft whose embedding is narrower than the target's (as if its vocabulary were
    padded differently): requests with ids it lacks are refused by the draft engine and get
    no drafts; the step, and the target's tokens, are unaffected."""
    from dataclasses import replace
    llm = LLM(str(stories_dir), speculative_config=draft_config(str(stories_dir)), **BASE)
    draft = llm.engine.speculator.proposer.engine
    draft.limits = replace(draft.limits, vocab_size=2)   # every real token id is refused
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert tokens(llm, PROMPTS, params) == tokens(plain, PROMPTS, params)
    assert llm.engine.speculator.stats.verify_steps == 0
    assert not draft.has_unfinished()
