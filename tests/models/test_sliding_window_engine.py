"""Released sliding-window KV blocks through the whole engine, on the mistral_window case (a
window of 8 on every layer, tests/models/hf_fixtures.py) in float32 on the CPU: generating far
past the window, each sequence holds at most the blocks its window and its step's tokens
overlap (read from the engine's KV manager after every schedule), and the greedy tokens equal
transformers' and an engine's that holds every block (the release switched off). Concurrent
requests under a small pool (preemption by recompute and by swap, chunked prefill), n > 1
(copy-on-write forks), prefix-cache hits on blocks released by an earlier request, and async
scheduling change no token, and every block is free at the end. A request whose whole
context exceeds the pool runs within its window's bound."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hf_fixtures import CASES, build_hf_model, hf_greedy, save_model_dir
from tessellm import SamplingParams
from window_fixtures import (BLOCK, WINDOW, Recorder, bound, make, no_release,  # noqa: F401
                             run_mixed, tokens_alone)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    c = CASES["mistral_window"]
    tok = c.tokenizer()
    hf = build_hf_model(c, tok)
    assert hf.config.sliding_window == WINDOW
    hf.generation_config.eos_token_id = None
    return hf, save_model_dir(hf, tok, tmp_path_factory.mktemp("mistral_window"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One kernel-profile cache for the module: kernels are ranked once."""
    return tmp_path_factory.mktemp("tessellm-cache")


def test_long_generation_holds_the_window_and_matches_transformers(
        case, cache_dir: Path, no_release) -> None:
    hf, path = case
    rng = random.Random(3)
    vocab = hf.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(30)]
    params = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    want = hf_greedy(hf, prompt, 90)
    assert len(set(want)) >= 4

    # the prompt in chunks of 24 and 6; the pool holds 64 of the 120 tokens, but a request
    # needs only the window's bound for steps of 24 (ceil(46 / 4) + 1 = 13 blocks) to run
    llm = make(path, cache_dir, num_kv_blocks=16)
    assert llm.engine.kv.sliding_window == WINDOW
    rec = Recorder(llm)
    free0 = llm.engine.kv.num_free_blocks
    assert llm.generate([prompt], params)[0].token_ids == want
    # chunk 0..23: 6 blocks; chunk 24..29 reads keys 17..29: blocks 4..7; then the decodes
    # hold bound(1) = ceil(7 / 4) + 1 = 3 blocks at most (positions c - 7 .. c)
    assert rec.held_per_step[:2] == [6, 4] and len(rec.held_per_step) == 91
    assert max(rec.held_per_step[2:]) == bound(1) == 3
    assert llm.engine.kv.num_free_blocks == free0 == llm.engine.kv.num_blocks

    no_release()
    full = make(path, cache_dir)
    assert full.engine.kv.sliding_window == 0
    rec_full = Recorder(full)
    assert full.generate([prompt], params)[0].token_ids == want
    assert rec_full.held_per_step[-1] == -(-(30 + 90 - 1) // BLOCK)   # the whole context


ALONE: list[list[int]] = []   # the greedy tokens of each prompt alone, holding every block


@pytest.mark.parametrize("mode, async_scheduling", [
    ("recompute", False), ("swap", False), ("recompute", True)])
def test_concurrent_preempted_forked_and_cached_requests_match_alone(
        case, cache_dir: Path, no_release, mode: str, async_scheduling: bool) -> None:
    """Ten requests, four of them sharing a 20-token prefix (prefix-cache hits on blocks the
    first one released out of its window), one of them n = 2, 30..40 new tokens each, eight
    at a time in a pool of 20 blocks (what the longest needs alone) with 24 tokens a step:
    preemption happens, and every output equals the request's greedy tokens alone in an
    engine that holds every block."""
    hf, path = case
    rng = random.Random(11)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(20)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
               for _ in range(4)]
    prompts += [[rng.randrange(vocab) for _ in range(rng.randint(5, 36))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(30, 40), temperature=0.0, ignore_eos=True)
              for _ in prompts]

    llm = make(path, cache_dir, num_kv_blocks=20, preemption_mode=mode,
               num_host_kv_blocks=40 if mode == "swap" else None,
               async_scheduling=async_scheduling)
    rec = Recorder(llm, 24 if async_scheduling else 0)
    got, forked = run_mixed(llm, prompts, params, fork=5, swap=mode == "swap")
    assert rec.most_held <= bound(24, 24)

    no_release()
    want = tokens_alone(ALONE, path, cache_dir, prompts, params)
    assert got == want
    assert forked == [want[5], want[5]]
