"""Speculative decoding end to end on the trained stories260K: whatever is proposed, the
tokens (greedy and seeded), logprobs, stop strings, max_tokens, EOS, penalties, n > 1,
preemption and prefix hits are what the engine gives without speculation; rejected drafts'
blocks are freed and never cached; and the policy backs off where proposals miss."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from tessellm import LLM, SamplingParams
from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError

STORY = ("Once upon a time, there was a little girl named Lily. She liked to play with her "
         "ball. One day, Lily went to the park with her mom. ")
PROMPTS = [STORY + STORY[:60],
           "Tom had a red ball. Tom had a red ball. Tom had a red",
           "The sun was",
           STORY + "Lily and her mom"]
BASE = dict(dtype="float32", load_progress=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def speculating(stories_dir, **options) -> LLM:
    return LLM(str(stories_dir), speculative_config=options.pop("spec", NGRAM),
               **BASE, **options)


@pytest.fixture(scope="module")
def plain(stories_dir) -> LLM:
    return LLM(str(stories_dir), **BASE)


@pytest.fixture(scope="module")
def spec(stories_dir) -> LLM:
    return speculating(stories_dir)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_greedy_tokens_are_identical_and_drafts_were_accepted(plain, spec):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    before = spec.engine.speculator.stats.accepted_tokens
    assert tokens(spec, PROMPTS, params) == tokens(plain, PROMPTS, params)
    for p in PROMPTS:   # one at a time too (decode-only verify steps)
        assert tokens(spec, [p], params) == tokens(plain, [p], params)
    stats = spec.engine.speculator.stats
    assert stats.accepted_tokens > before and stats.verify_steps > 0
    assert 1.0 < stats.mean_accepted_length <= 5.0


@pytest.mark.parametrize("k", [1, 2, 7])
def test_every_k_gives_the_same_tokens(stories_dir, plain, k):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = speculating(stories_dir, spec={**NGRAM, "num_speculative_tokens": k,
                                         "prompt_lookup_min": 2})
    assert tokens(llm, PROMPTS, params) == tokens(plain, PROMPTS, params)


def test_seeded_sampling_penalties_and_n_are_identical(plain, spec):
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=s, ignore_eos=True,
                             top_k=20, top_p=0.95) for s in range(3)]
    params.append(SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2,
                                 frequency_penalty=0.3, ignore_eos=True))
    for sp in params:
        assert tokens(spec, PROMPTS, sp) == tokens(plain, PROMPTS, sp)
    n3 = SamplingParams(n=3, max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    a, b = spec.generate(PROMPTS[:2], n3), plain.generate(PROMPTS[:2], n3)
    assert [[c.token_ids for c in o.outputs] for o in a] == \
        [[c.token_ids for c in o.outputs] for o in b]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_max_tokens_and_eos_finish_as_without_speculation(plain, spec, max_tokens):
    for ignore_eos in (True, False):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        a, b = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
        assert [(o.token_ids, o.finish_reason) for o in a] == \
            [(o.token_ids, o.finish_reason) for o in b]
        assert all(len(o.token_ids) <= max_tokens for o in a)
    eos = SamplingParams(max_tokens=200, temperature=0.0)   # runs to the story's EOS
    a, b = spec.generate(PROMPTS, eos), plain.generate(PROMPTS, eos)
    assert [(o.token_ids, o.finish_reason) for o in a] == \
        [(o.token_ids, o.finish_reason) for o in b]


def test_stop_strings_cut_where_they_would_without_speculation(plain, spec):
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    texts = [o.text for o in plain.generate(PROMPTS, greedy)]
    for text in texts[:2]:
        stop = text[len(text) // 2:len(text) // 2 + 4]
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop])
        a, b = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
        assert [(o.text, o.token_ids, o.finish_reason) for o in a] == \
            [(o.text, o.token_ids, o.finish_reason) for o in b]


def _run_engine(llm: LLM, params: SamplingParams, check=None):
    engine = llm.engine
    requests = [engine.add_request(llm.encode(p), params) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
        if check is not None:
            check(engine)
    return requests


def test_logprobs_match_and_follow_the_accepted_tokens(plain, spec):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    got, want = _run_engine(spec, params), _run_engine(plain, params)
    for g, w in zip(got, want):
        assert g.output_token_ids == w.output_token_ids
        assert len(g.output_logprobs) == len(g.output_token_ids)
        for lg, lw, t in zip(g.output_logprobs, w.output_logprobs, g.output_token_ids):
            assert lg.token_id == lw.token_id == t
            assert lg.logprob == pytest.approx(lw.logprob, abs=1e-4)
            assert [i for i, _ in lg.top] == [i for i, _ in lw.top]


def test_rejected_drafts_blocks_are_freed_and_never_cached(stories_dir, plain):
    llm = speculating(stories_dir, block_size=4)
    kv = llm.engine.kv

    def only_own_blocks(engine):   # after every step: no block past a request's tokens
        for r in engine.scheduler.running:
            assert len(kv.block_table(r.request_id)) <= kv.num_blocks_needed(r.num_tokens)

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = _run_engine(llm, params, only_own_blocks)
    assert llm.engine.speculator.stats.draft_tokens > llm.engine.speculator.stats.accepted_tokens
    # every cached block holds the tokens its hash says: a prompt extending a finished
    # request's whole sequence hits its blocks and continues exactly as without the cache
    follow = [llm.decode(r.prompt_token_ids + r.output_token_ids) for r in first]
    more = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    hits = llm.engine.scheduler.prefix_cache_stats.hits
    assert tokens(llm, follow, more) == tokens(plain, follow, more)
    assert llm.engine.scheduler.prefix_cache_stats.hits > hits


def test_preemption_with_a_tiny_kv_pool_keeps_the_tokens(stories_dir, plain):
    llm = speculating(stories_dir, block_size=4, num_kv_blocks=40, max_num_seqs=4)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[1:3] * 2
    assert tokens(llm, prompts, params) == tokens(plain, prompts, params)
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.speculator.stats.verify_steps > 0


def test_constrained_requests_decode_without_drafts_beside_speculating_ones(plain, spec):
    regex = SamplingParams(max_tokens=20, temperature=0.0,
                           structured_outputs=StructuredOutputs(regex="(ball )+"))
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for params in (regex, free):
        assert tokens(spec, PROMPTS, params) == tokens(plain, PROMPTS, params)
    text = spec.generate([PROMPTS[1]], regex)[0].text
    assert set(text.split()) <= {"ball"}


class FixedProposer:
    """Proposes one fixed token for every request: a plausible token that is often wrong."""

    method = "fixed"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, requests, max_drafts):
        return [[self.token] for _ in requests]

    def release(self, request) -> None:
        return None


def chi_square_same(a: list[int], b: list[int]) -> tuple[float, float]:
    """Two-sample chi-square statistic over the tokens of a and b (rare ones pooled) and its
    critical value at p = 0.001 (Wilson-Hilferty)."""
    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    cells = [(ca[t], cb[t]) for t in common]
    cells.append((len(a) - sum(x for x, _ in cells), len(b) - sum(y for _, y in cells)))
    cells = [c for c in cells if sum(c) > 0]
    k1, k2 = math.sqrt(len(b) / len(a)), math.sqrt(len(a) / len(b))
    chi2 = sum((x * k1 - y * k2) ** 2 / (x + y) for x, y in cells)
    dof = max(1, len(cells) - 1)
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    return chi2, critical


def test_sampled_distribution_is_the_targets(stories_dir, plain):
    """Unseeded samples at temperature 1, every request given one draft after its first
    token (a fixed token the target gives some but not most of its mass): the 2nd and 3rd
    tokens (verified in one step) have the target's distribution, by a two-sample
    chi-square test at p = 0.001 over 600 samples each against runs without speculation."""
    prompt = ["Tom had a red ball. Tom had a red ball. Tom had a"]
    params = SamplingParams(n=600, max_tokens=3, temperature=1.0, ignore_eos=True)
    b = [c.token_ids for c in plain.generate(prompt, params)[0].outputs]
    ranked = [t for t, _ in Counter(t[1] for t in b).most_common()]
    llm = speculating(stories_dir)
    llm.engine.speculator.proposer = FixedProposer(ranked[1])
    a = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    stats = llm.engine.speculator.stats
    assert stats.verify_steps == 600 and 0 < stats.accepted_tokens < 600
    for pos in (1, 2):
        chi2, critical = chi_square_same([t[pos] for t in a], [t[pos] for t in b])
        assert chi2 < critical, (pos, chi2, critical)


def test_adaptive_speculation_backs_off_where_proposals_miss(stories_dir):
    """Text with repeats but no predictable continuation: the adaptive policy learns the loss
    and refuses most proposals (probing now and then). Step costs are fed from a fixed model
    of a CPU (10 ms a row-1 step, +5 ms a row), not the clock, so the test does not depend on
    the machine's load."""
    llm = speculating(stories_dir, spec={"method": "ngram", "num_speculative_tokens": 4})
    costs = llm.engine.speculator.policy.costs
    llm.engine.speculator.observe_step = lambda seconds, rows, with_drafts: costs.observe(
        rows, with_drafts, 0.010 + 0.005 * (rows - 1))
    params = SamplingParams(max_tokens=80, temperature=1.5, seed=3, ignore_eos=True)
    llm.generate(["a b a b a b a b"], params)
    stats = llm.engine.speculator.stats
    assert stats.proposals > 20
    assert stats.refused_proposals > stats.proposals / 2, stats


def test_a_request_caps_or_turns_off_its_own_speculation(stories_dir, plain):
    llm = speculating(stories_dir)
    stats = llm.engine.speculator.stats
    base = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = tokens(plain, PROMPTS[:1], SamplingParams(**base))
    assert tokens(llm, PROMPTS[:1], SamplingParams(**base, num_speculative_tokens=0)) == want
    assert stats.verify_steps == 0
    assert tokens(llm, PROMPTS[:1], SamplingParams(**base, num_speculative_tokens=1)) == want
    assert stats.verify_steps > 0 and stats.draft_tokens == stats.verify_steps
    with pytest.raises(InvalidRequestError, match="exceeds this engine's 4"):
        llm.generate(PROMPTS[:1], SamplingParams(**base, num_speculative_tokens=5))
    with pytest.raises(InvalidRequestError, match="does not speculate"):
        plain.generate(PROMPTS[:1], SamplingParams(**base, num_speculative_tokens=2))
    assert tokens(plain, PROMPTS[:1], SamplingParams(**base, num_speculative_tokens=0)) == want


def test_verify_steps_wider_than_the_decode_programs_run_eagerly(stories_dir):
    """20 sequences x (1 + 4) rows: verify steps of up to 100 rows, past the 64 rows decode
    programs cover; every bucket they meet (the LM head's sampled rows included) had its
    kernel chosen, and its weight layout made, before the first request."""
    prompts = [f"{PROMPTS[1]} {i}" for i in range(20)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(str(stories_dir), dtype="bfloat16", load_progress=False,
                      max_num_seqs=20), prompts, params)
    llm = LLM(str(stories_dir), load_progress=False, dtype="bfloat16", max_num_seqs=20,
              speculative_config=NGRAM)
    chosen = dict(llm.engine.parts.selector.chosen())
    assert tokens(llm, prompts, params) == want
    assert llm.engine.speculator.stats.verify_steps > 0
    assert llm.engine.parts.selector.chosen() == chosen   # nothing chosen while serving


def test_a_token_budget_below_the_verify_rows_keeps_the_tokens(stories_dir):
    """8 sequences x (1 + 4) rows is 40 rows, past a 16-token step budget: the engine starts
    (decode graphs and buffers are made for steps the budget allows) and verify steps are
    cut to the budget, with the tokens of the engine without speculation."""
    prompts = [f"{PROMPTS[1]} {i}" for i in range(8)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    limits = dict(max_num_seqs=8, max_num_batched_tokens=16)
    want = tokens(LLM(str(stories_dir), **BASE, **limits), prompts, params)
    llm = speculating(stories_dir, **limits)
    assert tokens(llm, prompts, params) == want
    assert llm.engine.speculator.stats.verify_steps > 0


def test_async_scheduling_speculates_and_keeps_the_tokens(stories_dir, plain):
    """With async scheduling a step stays in flight only when the speculator does not want
    its ids: requests still get drafts, and the tokens are the plain engine's."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = speculating(stories_dir, async_scheduling=True)
    assert tokens(llm, PROMPTS, params) == tokens(plain, PROMPTS, params)
    assert llm.engine.speculator.stats.accepted_tokens > 0
    off = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                         num_speculative_tokens=0)
    steps = llm.engine.stats.num_overlapped_steps
    assert tokens(llm, PROMPTS, off) == tokens(plain, PROMPTS, off)
    assert llm.engine.stats.num_overlapped_steps > steps   # nothing to draft: overlapped


def test_a_random_qwen3_gives_the_same_tokens(qwen3_random_dir):
    """A random-weight Qwen3 of small shape (GQA, qk-norm) with the real Qwen3 tokenizer:
    its repetitive greedy outputs are drafted and verified, tokens identical."""
    prompts = ["The quick brown fox", "def add(a, b):\n    return a + b\n\ndef add(a, b):",
               "1, 2, 3, 4, 5, 6,"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(str(qwen3_random_dir), **BASE), prompts, params)
    llm = LLM(str(qwen3_random_dir), speculative_config=NGRAM, **BASE)
    assert tokens(llm, prompts, params) == want
    assert llm.engine.speculator.stats.accepted_tokens > 0
