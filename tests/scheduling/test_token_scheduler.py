"""Token scheduler: min(missing, budget, threshold); decode is one token."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from scheduling_fixtures import make_request
from tessellm.errors import ConfigError
from tessellm.scheduling import SchedulerError, TokenScheduler


def test_prefill_chunk_decode_and_hit() -> None:
    r = make_request("a", 50, 4)
    plain, capped = TokenScheduler(), TokenScheduler(8)
    assert plain.num_new_tokens(r, 64) == 50
    assert plain.num_new_tokens(r, 16) == 16
    assert capped.num_new_tokens(r, 64) == 8
    assert plain.num_new_tokens(r, 64, num_computed=48) == 2     # after a prefix-cache hit
    r.num_computed_tokens = 50
    r.output_token_ids.append(3)
    assert plain.num_new_tokens(r, 64) == capped.num_new_tokens(r, 64) == 1
    r.num_computed_tokens = 51
    with pytest.raises(SchedulerError, match="'a'"):
        plain.num_new_tokens(r, 64)


@given(prompt=st.integers(1, 300), done=st.integers(0, 299), budget=st.integers(1, 500),
       threshold=st.integers(0, 64))
def test_grant_bounds(prompt: int, done: int, budget: int, threshold: int) -> None:
    r = make_request("a", prompt, 1)
    done = min(done, prompt - 1)
    n = TokenScheduler(threshold).num_new_tokens(r, budget, done)
    assert 1 <= n <= min(prompt - done, budget)
    assert threshold == 0 or n <= threshold
    assert n == min(prompt - done, budget, threshold or budget)


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_threshold_validation(bad) -> None:
    with pytest.raises(ConfigError):
        TokenScheduler(bad)
