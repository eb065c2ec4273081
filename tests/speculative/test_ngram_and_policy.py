"""Prompt lookup (NgramIndex against a brute-force oracle), the acceptance rule, the
speculative config's validation, and the never-slower policy's choices on measured costs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tessellm.config import EngineConfig
from tessellm.errors import ConfigError
from tessellm.speculative.ngram import NgramIndex
from tessellm.speculative.policy import (MAX_BACKOFF, Acceptance, Candidate, SpeculationPolicy,
                                         StepCosts)
from tessellm.speculative.proposer import known_proposer
from tessellm.speculative.verification import num_accepted


def oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix that has one."""
    size = len(tokens)
    for n in range(min(max_n, size), min_n - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 1, n - 1, -1):   # occurrence tokens[end-n:end], end < size
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


@given(tokens=st.lists(st.integers(0, 3), max_size=60), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 6), cuts=st.lists(st.integers(0, 60)))
@settings(max_examples=300, deadline=None)
def test_ngram_index_equals_the_oracle_however_it_grows(tokens, min_n, extra, k, cuts):
    index = NgramIndex(min_n, min_n + extra)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c < len(tokens))})
    for a, b in zip(bounds, bounds[1:]):
        index.extend(tokens[a:b])
        assert index.propose(k) == oracle(tokens[:b], min_n, min_n + extra, k)


def test_ngram_proposes_what_followed_the_latest_occurrence():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7])
    assert index.propose(2) == [9, 5]          # latest (5 6 7) is followed by 9
    index = NgramIndex(2, 2)
    index.extend([1, 2, 3, 1])
    assert index.propose(4) == []              # no earlier bigram (3 1)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_acceptance_is_the_longest_matching_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4], [3, 4]) == 0
    with pytest.raises(ValueError):
        num_accepted([4, 5], [4, 5])


@pytest.mark.parametrize("bad", [
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram", "num_speculative_tokens": 17},
    {"method": "ngram", "num_speculative_tokens": "four"},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 10**9},
    {"method": "ngram", "num_speculative_tokens": 4, "model": "x"},
    {"method": "draft_model", "num_speculative_tokens": 4},
    {"method": "", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 4, "nested": {"a": [1]}},
    {"method": ["ngram"], "num_speculative_tokens": 4},
])
def test_bad_speculative_configs_are_refused(bad):
    with pytest.raises(ValidationError):
        EngineConfig(speculative_config=bad)


def test_speculation_with_tensor_parallelism_is_refused():
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                     tensor_parallel_size=2)


def test_an_unknown_method_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown speculative method 'eagle'.*draft_model.*ngram"):
        known_proposer("eagle")


def _candidate(drafts: int, accepted: float, rejected: float) -> Candidate:
    return Candidate(object(), list(range(drafts)), Acceptance(accepted, rejected))


def test_policy_explores_then_refuses_a_loss_and_takes_a_gain():
    policy = SpeculationPolicy(adaptive=True)
    assert len(policy.choose([_candidate(4, 0, 0)], 1, 1)) == 1   # nothing measured: explore
    policy.costs.observe(5, True, 0.030)      # a verify step of 5 tokens: 30 ms
    assert policy.choose([_candidate(4, 50, 0)], 1, 1) == []   # the plain step's cost next
    policy.costs.observe(1, False, 0.010)     # a decode step: 10 ms for 1 token
    # acceptance ~0: 1 token in 30 ms < 1 in 10 ms: refused
    assert policy.choose([_candidate(4, 0, 50)], 1, 1) == []
    # acceptance ~1: up to 5 tokens in 30 ms > 1 in 10 ms: taken
    assert len(policy.choose([_candidate(4, 50, 0)], 1, 1)) == 1


def test_policy_under_load_takes_fewer_drafts():
    policy = SpeculationPolicy(adaptive=True)
    policy.costs.observe(16, False, 0.016)
    for t in range(17, 33):                   # compute-bound: cost grows with every token
        policy.costs.observe(t, True, 0.001 * t * 1.5)
    good = [_candidate(4, 3, 1) for _ in range(4)]
    assert len(policy.choose(good, 16, 16)) < len(good)


def test_a_refused_request_is_probed_ever_less_often():
    """Probes after 3, then 6, 12, .. refused steps (up to MAX_BACKOFF x 3); a proposal
    that pays resets the interval."""
    policy = SpeculationPolicy(adaptive=True, probe_interval=3)
    policy.costs.observe(1, False, 0.010)
    policy.costs.observe(3, True, 0.030)
    c = _candidate(2, 0, 50)
    taken = [bool(policy.choose([c], 1, 1)) for _ in range(3 + 1 + 6 + 1 + 12 + 1)]
    assert [i for i, t in enumerate(taken) if t] == [3, 10, 23]
    assert c.acceptance.backoff == 8
    probes = sum(bool(policy.choose([c], 1, 1)) for _ in range(10 * 3 * MAX_BACKOFF))
    assert probes == 1 + 10 - 1 and c.acceptance.backoff == MAX_BACKOFF   # 24, 48, 48, ..
    c.acceptance.accepted, c.acceptance.rejected = 50.0, 0.0    # the text became predictable
    policy.costs = StepCosts()                                  # ... and verifying cheap
    policy.costs.observe(1, False, 0.010)
    policy.costs.observe(3, True, 0.012)
    assert policy.choose([c], 1, 1) == [c] and c.acceptance.backoff == 1


def test_non_adaptive_takes_everything():
    policy = SpeculationPolicy(adaptive=False)
    policy.costs.observe(1, False, 0.001)
    policy.costs.observe(5, True, 1.0)
    assert len(policy.choose([_candidate(4, 0, 50)], 1, 1)) == 1


def test_policy_cuts_a_proposal_to_the_length_that_pays():
    """Verify steps cost the same up to 4 rows and double past them (a kernel's row tile):
    a well-accepted proposal of 6 drafts is cut to 3 (4 rows)."""
    policy = SpeculationPolicy(adaptive=True)
    policy.costs.observe(1, False, 0.010)
    for rows in range(2, 8):
        policy.costs.observe(rows, True, 0.012 if rows <= 4 else 0.024)
    c = _candidate(6, 40, 2)
    assert policy.choose([c], 1, 1) == [c] and len(c.drafts) == 3


def test_a_costly_proposers_time_is_priced_apart():
    """A draft model: its proposal time (learned in the steady state) is added to a verify
    step's cost; until it is known proposals are explored."""
    policy = SpeculationPolicy(adaptive=True, costly=True)
    policy.costs.observe(1, False, 0.010)
    policy.costs.observe(4, True, 0.012)
    assert len(policy.choose([_candidate(3, 50, 0)], 1, 1)) == 1    # drafting cost unknown
    policy.observe_proposal(0.060)           # 4 tokens in 72 ms < 1 in 10 ms: refused
    assert policy.choose([_candidate(3, 50, 0)], 1, 1) == []
    policy.proposal_cost = None
    policy.observe_proposal(0.010)           # 4 tokens in 22 ms > 1 in 10 ms: taken
    assert len(policy.choose([_candidate(3, 50, 0)], 1, 1)) == 1
