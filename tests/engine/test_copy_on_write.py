"""n > 1 through the whole engine (stories260K, float32, 4-token blocks): the samples of one
prompt share its KV blocks (copy-on-write), the prompt is computed once, and sample i gives
exactly the tokens of the prompt run alone with seed + i."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.llm_engine import LLMEngine
from tessellm.errors import InvalidRequestError

PARAMS = SamplingParams(max_tokens=10, temperature=1.5, seed=11)


def make_llm(stories_dir, device: str = "cpu", **options) -> LLM:
    return LLM(str(stories_dir), device=device, dtype="float32", load_progress=False,
               block_size=4, **options)


@pytest.fixture(scope="module")
def llm(stories_dir) -> LLM:
    return make_llm(stories_dir, max_num_seqs=4)


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    ids = llm.encode("Once upon a time, there was a little girl named Lily.")[:10]
    assert len(ids) == 10 and len(ids) % 4 != 0   # 2 full blocks and a partial one
    return ids


def run_group(engine: LLMEngine, prompt: list[int], params: SamplingParams, n: int
              ) -> tuple[list, int, int, int]:
    """Run one group to the end; returns its requests, the most blocks shared at once by its
    tables, the block copies made and the prompt tokens computed."""
    kv, sched = engine.kv, engine.scheduler
    copies = 0
    schedule = sched.schedule

    def counting_schedule():
        nonlocal copies
        out = schedule()
        copies += len(out.block_copies)
        return out

    sched.schedule = counting_schedule
    try:
        p0 = engine.stats.num_prompt_tokens
        group = engine.add_request_group(prompt, params, n)
        max_shared = 0
        while engine.has_unfinished():
            engine.step()
            tables = {b for r in group for b in kv.block_table(r.request_id)}
            max_shared = max(max_shared, sum(kv.pool.ref_count(b) > 1 for b in tables))
    finally:
        del sched.schedule
    return group, max_shared, copies, engine.stats.num_prompt_tokens - p0


def alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_n2_shares_prompt_blocks_and_equals_separate_seeded_runs(stories_dir, llm, prompt,
                                                                 device):
    engine = (llm if device == "cpu" else make_llm(stories_dir, device, max_num_seqs=4)).engine
    group, max_shared, copies, prompt_tokens = run_group(engine, prompt, PARAMS, 2)
    assert [r.request_id for r in group] == [group[0].request_id, group[1].request_id]
    assert [r.params.seed for r in group] == [11, 12]
    for i, r in enumerate(group):
        assert r.output_token_ids == alone(llm, prompt, replace(PARAMS, seed=11 + i))
    assert max_shared >= len(prompt) // 4          # at least the 2 full prompt blocks
    assert copies >= 1                             # the partial block was copied
    assert prompt_tokens == len(prompt)            # the prompt was computed once
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.has_unfinished


def test_generate_n_returns_all_samples(llm, prompt):
    (out,) = llm.generate([prompt], PARAMS, n=3)
    assert len(out.samples) == 3
    assert (out.token_ids, out.text, out.finish_reason) == \
        (out.samples[0].token_ids, out.samples[0].text, out.samples[0].finish_reason)
    for i, s in enumerate(out.samples):
        assert s.token_ids == alone(llm, prompt, replace(PARAMS, seed=11 + i))
    (single,) = llm.generate([prompt], PARAMS)
    assert single.samples == [] and single.token_ids == out.token_ids
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_prompt_of_whole_blocks_and_greedy(llm):
    prompt = llm.encode("Tom and his dog went to the big park to play")[:8]
    assert len(prompt) == 8
    greedy = SamplingParams(max_tokens=6, temperature=0)
    group, max_shared, copies, prompt_tokens = run_group(llm.engine, prompt, greedy, 3)
    expected = alone(llm, prompt, greedy)
    assert all(r.output_token_ids == expected for r in group)
    assert max_shared == 2 and copies == 0 and prompt_tokens == 8
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_siblings_beyond_the_sequence_cap_run_as_ordinary_requests(stories_dir, prompt):
    small = make_llm(stories_dir, max_num_seqs=2)
    group, max_shared, _, prompt_tokens = run_group(small.engine, prompt, PARAMS, 3)
    for i, r in enumerate(group):
        assert r.output_token_ids == alone(small, prompt, replace(PARAMS, seed=11 + i))
    assert max_shared >= 2
    # the third sample is computed again, less what it finds in the prefix cache
    assert len(prompt) < prompt_tokens <= 2 * len(prompt)
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


def test_aborted_parent_lets_its_siblings_run(llm, prompt):
    engine = llm.engine
    group = engine.add_request_group(prompt, PARAMS, 2)
    engine.abort(group[0].request_id)
    while engine.has_unfinished():
        engine.step()
    assert group[0].finish_reason.value == "abort"
    assert group[1].output_token_ids == alone(llm, prompt, replace(PARAMS, seed=12))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_invalid_n(llm, prompt):
    for n in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError):
            llm.generate([prompt], PARAMS, n=n)
    assert not llm.engine.has_unfinished()
