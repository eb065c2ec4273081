"""RequestLimits, the one rule set a request meets where it enters (the front end of an
engine-core process and LLMEngine): priority classes, the prompt, token ids in the vocabulary,
max_model_len, KV that fits the pool alone, n, and prompt logprobs on static-shape devices.
The scheduler trusts what passed (tests/scheduling runs validated requests only)."""
from __future__ import annotations

import pytest

from tessellm.engine.request_limits import RequestLimits
from tessellm.errors import InvalidRequestError
from tessellm.request import max_kv_tokens
from tessellm.sampling_params import SamplingParams


def limits(num_kv_blocks: int = 4, block_size: int = 4, max_model_len: int = 20,
           levels: int = 3, prompt_logprobs: bool = True) -> RequestLimits:
    return RequestLimits(levels, 100, max_model_len, block_size, num_kv_blocks, prompt_logprobs)


def check(lim: RequestLimits, n_prompt: int, max_tokens: int, priority: int = 0,
          n: int = 1, **params) -> None:
    lim.validate([7] * n_prompt, SamplingParams(max_tokens=max_tokens, **params), priority, n)


@pytest.mark.parametrize("bad", [-1, 3, True, 1.0, None])
def test_priority_outside_the_classes_is_refused(bad) -> None:
    with pytest.raises(InvalidRequestError, match="priority"):
        check(limits(levels=3), 4, 2, priority=bad)
    check(limits(levels=3), 4, 2, priority=2)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None])
def test_n_must_be_a_positive_integer(bad) -> None:
    with pytest.raises(InvalidRequestError, match="n must be"):
        check(limits(), 4, 2, n=bad)
    check(limits(), 4, 2, n=3)


def test_prompt_length_and_kv_fit() -> None:
    lim = limits(num_kv_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(InvalidRequestError, match="empty"):
        check(lim, 0, 4)
    with pytest.raises(InvalidRequestError, match="context is 20"):
        check(lim, 21, 4)                          # longer than max_model_len
    with pytest.raises(InvalidRequestError, match="context is 20"):
        check(lim, 20, 4)                          # nothing left to generate
    with pytest.raises(InvalidRequestError, match="5 KV blocks"):
        check(lim, 10, 8)                          # 17 KV tokens > 16 slots
    check(lim, 10, 7)                              # 16 KV tokens (the last is never computed)
    capped = limits(num_kv_blocks=4, block_size=4, max_model_len=17)
    check(capped, 15, 100)                         # stops at 17 tokens: 16 in KV
    with pytest.raises(InvalidRequestError):
        check(capped, 17, 100)


def test_windowed_groups_need_only_their_window_bound() -> None:
    """A windowed block-table group needs at most ceil((max(W - 1, T) + T - 1) / bs) + 1
    blocks (T the step's tokens), a full group the whole context; max_model_len still rules."""
    def windowed(windows: tuple[int, ...], blocks: int) -> RequestLimits:
        return RequestLimits(3, 100, 200, 4, blocks, kv_windows=windows, step_tokens=4)
    # 100 KV tokens: 25 blocks whole; a window of 8 with steps of 4: ceil(10 / 4) + 1 = 4
    check(windowed((8,), 4), 60, 41)
    with pytest.raises(InvalidRequestError, match="needs 4 KV blocks but the pool has 3"):
        check(windowed((8,), 3), 60, 41)
    check(windowed((0, 8, 8), 33), 60, 41)     # 25 + 4 + 4: hybrid, two windowed groups
    with pytest.raises(InvalidRequestError, match="needs 33 KV blocks but the pool has 32"):
        check(windowed((0, 8, 8), 32), 60, 41)
    check(windowed((8,), 2), 3, 2)             # a short context: its own 2 blocks
    with pytest.raises(InvalidRequestError, match="context is 200"):
        check(windowed((8,), 100), 200, 4)


def test_max_kv_tokens() -> None:
    assert max_kv_tokens(10, 7, 256) == 16         # the last sampled token is never computed
    assert max_kv_tokens(15, 100, 17) == 16        # it stops at max_model_len tokens
    assert max_kv_tokens(4, 1, 256) == 4           # one token: the prompt alone


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    lim = limits()
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        lim.validate([1, 100], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        check(lim, 4, 2, stop_token_ids=[100])
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        check(lim, 4, 2, logit_bias={100: 1.0})


def test_prompt_logprobs_only_where_steps_have_dynamic_shapes() -> None:
    check(limits(), 4, 2, prompt_logprobs=0)
    with pytest.raises(InvalidRequestError, match="static shapes"):
        check(limits(prompt_logprobs=False), 4, 2, prompt_logprobs=0)
    check(limits(prompt_logprobs=False), 4, 2)
