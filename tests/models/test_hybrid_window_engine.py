"""Hybrid sliding-window models through the whole engine (tessellm.cache.kv_groups): the
gemma2 and gemma3 cases (tests/models/hf_fixtures.py: 3 layers, a window of 8 on layers 0 and
2, layer 1 full; three block-table groups over one KV tensor) in float32 on the CPU.

Generating far past the window, each windowed group's table holds at most the window's bound
while the full group's grows with the context (read from the engine's KV manager after every
schedule), and the greedy tokens equal transformers' and an engine's without groups (one
table for every layer, holding every block). Concurrent requests under a small pool
(preemption by recompute and by swap), prefix-cache hits after a first run, n > 1, async
scheduling and ngram speculation change no token, and every block is free at the end."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hf_fixtures import CASES, build_hf_model, hf_greedy, save_model_dir
from tessellm import SamplingParams
from tessellm.errors import ConfigError
from window_fixtures import (BLOCK, WINDOW, Recorder, bound, make, no_release,  # noqa: F401
                             run_mixed, tokens_alone)


def _case(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    c = CASES[name]
    tok = c.tokenizer()
    hf = build_hf_model(c, tok)
    assert hf.config.sliding_window == WINDOW
    hf.generation_config.eos_token_id = None
    return hf, save_model_dir(hf, tok, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return _case("gemma2", tmp_path_factory)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One kernel-profile cache for the module: kernels are ranked once."""
    return tmp_path_factory.mktemp("tessellm-cache")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_windowed_groups_stay_bounded_and_tokens_match_transformers(
        name: str, gemma2, tmp_path_factory, cache_dir: Path, no_release) -> None:
    hf, path = gemma2 if name == "gemma2" else _case(name, tmp_path_factory)
    prompt = _prompt(3, 30, hf.config.vocab_size)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = hf_greedy(hf, prompt, 60)
    assert len(set(want)) >= 4

    llm = make(path, cache_dir)   # the prompt in chunks of 24 and 6
    kv = llm.engine.kv
    assert [m.sliding_window for m in kv.groups] == [0, WINDOW, WINDOW]
    assert len(llm.engine.parts.kv_caches) == 1   # one layer per group: one shared tensor
    rec = Recorder(llm)
    assert llm.generate([prompt], params)[0].token_ids == want
    full = [held[0] for held in rec.group_held_per_step]
    windowed = [held[1:] for held in rec.group_held_per_step]
    # chunk 0..23: 6 blocks everywhere; chunk 24..29: the full group 8, each windowed group
    # blocks 4..7; the decodes then hold bound(1) = 3 in each windowed group (positions
    # c - 7 .. c) while the full group holds ceil((c + 1) / 4)
    assert windowed[:2] == [(6, 6), (4, 4)] and len(windowed) == 61
    assert max(max(w) for w in windowed[2:]) == bound(1) == 3
    assert full[:2] == [6, 8] and full[-1] == -(-(30 + 60 - 1) // BLOCK)
    assert kv.num_free_blocks == kv.num_blocks

    no_release()
    flat = make(path, cache_dir)
    assert len(flat.engine.kv.groups) == 1 and flat.engine.kv.sliding_window == 0
    assert flat.generate([prompt], params)[0].token_ids == want


ALONE: list[list[int]] = []   # the greedy tokens of each prompt alone, without groups


@pytest.mark.parametrize("mode, async_scheduling", [
    ("recompute", False), ("swap", False), ("recompute", True)])
def test_concurrent_preempted_forked_and_cached_requests_match_alone(
        gemma2, cache_dir: Path, no_release, mode: str, async_scheduling: bool) -> None:
    """Eight requests, three of them sharing a 20-token prefix (prefix-cache hits after the
    first ran alone), one of them n = 2, 30..40 new tokens each, all at once in a pool of 48
    blocks (the longest alone needs 19 full blocks and 2 x 13 windowed ones): preemption
    happens, and every output equals the request's greedy tokens alone in an engine without
    groups."""
    hf, path = gemma2
    rng = random.Random(11)
    vocab = hf.config.vocab_size
    shared = _prompt(5, 20, vocab)
    prompts = [shared + _prompt(20 + i, rng.randint(1, 9), vocab) for i in range(3)]
    prompts += [_prompt(30 + i, rng.randint(5, 36), vocab) for i in range(5)]
    params = [SamplingParams(max_tokens=rng.randint(30, 40), temperature=0.0, ignore_eos=True)
              for _ in prompts]

    llm = make(path, cache_dir, num_kv_blocks=48, preemption_mode=mode,
               num_host_kv_blocks=96 if mode == "swap" else None,
               async_scheduling=async_scheduling)
    rec = Recorder(llm, 24 if async_scheduling else 0)
    got, forked = run_mixed(llm, prompts, params, fork=4, swap=mode == "swap")
    assert rec.most_in_use <= 48

    no_release()
    want = tokens_alone(ALONE, path, cache_dir, prompts, params)
    assert got == want
    assert forked == [want[4], want[4]]


def test_ngram_speculation_trims_every_group_and_changes_no_token(
        gemma2, cache_dir: Path) -> None:
    """A repetitive prompt (drafts get accepted and rejected): the same tokens as without
    speculation, every windowed table bounded by its verify steps, every block free."""
    hf, path = gemma2
    prompt = _prompt(8, 6, hf.config.vocab_size) * 5
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = make(path, cache_dir).generate([prompt], params)[0].token_ids
    spec = make(path, cache_dir, max_num_seqs=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    Recorder(spec)   # checks the windowed groups' bound at every step
    assert spec.generate([prompt], params)[0].token_ids == want
    assert spec.engine.stats.num_generated_tokens >= 40
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


def test_a_pool_too_small_for_one_window_fails_at_start(gemma2, cache_dir: Path) -> None:
    """A sequence one block past the window needs 3 full blocks and 3 in each windowed
    group: 9."""
    _, path = gemma2
    with pytest.raises(ConfigError, match="8 blocks.*window of 8 tokens needs 9"):
        make(path, cache_dir, num_kv_blocks=8)
