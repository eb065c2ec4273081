"""Sampling parameters through the whole engine (stories260K, float32, CPU)."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False)


def test_same_seed_same_text_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    alone = llm.generate(["Once upon a time"], p)[0].token_ids
    batched = llm.generate(["The dog", "Once upon a time", "A bird"],
                           [SamplingParams(max_tokens=20, temperature=1.0), p,
                            SamplingParams(max_tokens=5, temperature=0.0)])
    assert batched[1].token_ids == alone
    other = llm.generate(["Once upon a time"],
                         SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=8))
    assert other[0].token_ids != alone


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))[0]
    stop_at = greedy.token_ids[5]
    out = llm.generate(["Once upon a time"],
                       SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    first = greedy.token_ids.index(stop_at)
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm, monkeypatch):
    """Greedy stories260K never emits </s> early, so the model's EOS is set to a token greedy
    decoding is known to produce."""
    greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))[0]
    eos = greedy.token_ids[4]
    monkeypatch.setattr(llm.engine.parts, "eos_token_ids", frozenset({eos}))
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[:greedy.token_ids.index(eos) + 1]
    ignored = llm.generate(["Once upon a time"],
                           SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == greedy.token_ids and ignored.finish_reason == "length"


def test_token_id_prompts_equal_text_prompts(llm):
    p = SamplingParams(max_tokens=8, temperature=0)
    by_text = llm.generate(["Once upon a time"], p)[0]
    by_ids = llm.generate([llm.encode("Once upon a time")], p)[0]
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text


@pytest.mark.parametrize("prompts, params, match", [
    ([[]], SamplingParams(), "empty"),
    ([[1, 99999]], SamplingParams(), "out of range"),
    ([[1] * 600], SamplingParams(), "context"),
    (["a", "b"], [SamplingParams()], "2 prompts but 1"),
])
def test_bad_requests_are_refused_and_nothing_is_queued(llm, prompts, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()


def test_invalid_sampling_params_are_refused():
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1)
