"""Prefix caching through the whole engine (stories260K, float32, CPU, 4-token blocks): shared
prefixes compute fewer prompt tokens and give exactly the tokens of a run without caching,
also when a tiny pool forces eviction and preemption."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def make_llm(stories_dir, **options) -> LLM:
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
               block_size=4, **options)


@pytest.fixture(scope="module")
def cached(stories_dir) -> LLM:
    return make_llm(stories_dir, max_num_seqs=2)


@pytest.fixture(scope="module")
def plain(stories_dir) -> LLM:
    return make_llm(stories_dir, max_num_seqs=2, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def workload(cached: LLM) -> list[list[int]]:
    """Six prompts sharing a 24-token prefix (6 full blocks), with different endings."""
    prefix = cached.encode("Once upon a time, there was a little girl named Lily. She loved "
                           "to play outside in the park with her")[:24]
    assert len(prefix) == 24
    endings = ["dog.", "friends every day.", "ball.", "mom and dad.", "cat Tom.", "toys."]
    return [prefix + cached.encode(e)[1:] for e in endings]   # [1:]: drop the BOS token


def counters(llm: LLM) -> tuple[int, int, int]:
    e = llm.engine
    return e.stats.num_prompt_tokens, e.scheduler.prefix_cache_queries, \
        e.scheduler.prefix_cache_hits


def test_shared_prefix_computes_fewer_prompt_tokens_and_same_tokens(cached, plain, workload):
    p0, q0, h0 = counters(cached)
    with_cache = cached.generate(workload, GREEDY)
    p1, q1, h1 = counters(cached)
    pp0 = plain.engine.stats.num_prompt_tokens
    without = plain.generate(workload, GREEDY)
    plain_prompt = plain.engine.stats.num_prompt_tokens - pp0
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
    # max_num_seqs=2: the first two run together (no hit); the four others find the 6 blocks.
    assert h1 - h0 >= 4 * 24
    assert q1 - q0 == sum(len(p) for p in workload)
    assert p1 - p0 == plain_prompt - (h1 - h0)            # every hit token is one not computed
    assert plain.engine.scheduler.prefix_cache_queries == 0


def test_a_second_identical_request_hits(cached):
    prompt = cached.encode("The little bird sang a happy song in the tall green tree.")
    first = cached.generate([prompt], GREEDY)[0]
    _, q0, h0 = counters(cached)
    again = cached.generate([prompt], GREEDY)[0]
    _, q1, h1 = counters(cached)
    assert again.token_ids == first.token_ids
    assert q1 - q0 == len(prompt)
    assert h1 - h0 == (len(prompt) - 1) // 4 * 4               # never the last prompt token
    assert 0 < cached.engine.scheduler.prefix_cache_hit_rate <= 1


def test_seeded_sampling_is_unchanged_by_hits(cached, plain, workload):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    assert [o.token_ids for o in cached.generate(workload[:3], params)] == \
        [o.token_ids for o in plain.generate(workload[:3], params)]


def test_cache_salt_separates_requests(cached):
    engine = cached.engine
    prompt = cached.encode("A small red fox ran across the snowy field to find food.")

    def run(salt: str | None) -> tuple[list[int], int]:
        before = engine.scheduler.prefix_cache_hits
        r = engine.add_request(prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        return r.output_token_ids, engine.scheduler.prefix_cache_hits - before

    first, hit = run("tenant-a")
    assert hit == 0
    assert run("tenant-b")[1] == 0 and run(None)[1] == 0
    same, hit = run("tenant-a")
    assert same == first and hit == (len(prompt) - 1) // 4 * 4
    with pytest.raises(InvalidRequestError):
        engine.add_request(prompt, GREEDY, cache_salt=7)  # type: ignore[arg-type]


def test_tiny_pool_with_eviction_and_preemption_gives_the_same_tokens(stories_dir, plain,
                                                                     workload):
    """16 blocks of 4 tokens for 6 requests of 37 to 40 tokens (10 blocks): they preempt each
    other, and cached blocks are evicted to make room."""
    params = SamplingParams(max_tokens=10, temperature=0)
    reference = [o.token_ids for o in plain.generate(workload, params)]
    for caching in (True, False):
        tight = make_llm(stories_dir, num_kv_blocks=16, max_num_seqs=4,
                         max_num_batched_tokens=32, enable_prefix_caching=caching)
        out = tight.generate(workload, params)
        assert [o.token_ids for o in out] == reference
        assert tight.engine.stats.num_preemptions > 0
        if caching:
            assert tight.engine.scheduler.prefix_cache_hits > 0
            assert tight.engine.kv.pool.num_evictions > 0
        assert tight.engine.kv.num_free_blocks == tight.engine.kv.num_blocks
