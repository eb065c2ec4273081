"""Tests of tessellm.engine.sampler: greedy, filters, distribution, seeded reproducibility,
penalties and logprobs."""
from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from tessellm.engine.random_sampling import row_seed
from tessellm.engine.sampler import Sampler, SampleRequest, SamplerOutput
from tessellm.errors import InvalidRequestError
from tessellm.sampling_params import SamplingParams

VOCAB = 64


def _rows(params: Sequence[SamplingParams], positions: Sequence[int]) -> list[SampleRequest]:
    """Rows with no prompt or generated tokens (the sampler needs them only for penalties)."""
    return [SampleRequest(p, pos, [], []) for p, pos in zip(params, positions)]


def _sample(logits: torch.Tensor, params: Sequence[SamplingParams],
            positions: Sequence[int]) -> torch.Tensor:
    return Sampler()(logits, _rows(params, positions)).token_ids


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample_each_position(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Sample one row n times, as one batch of n copies at output positions 0..n-1."""
    logits = logits_row.unsqueeze(0).expand(n, -1)
    return _sample(logits, [params] * n, list(range(n)))


def test_greedy_equals_argmax_and_returns_int64() -> None:
    logits = _logits(5)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_ties_take_lowest_index() -> None:
    logits = torch.zeros(2, 8)
    logits[0, [3, 5]] = 1.0
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert out.tolist() == [3, 0]


def test_top_k_one_equals_greedy_in_mixed_batch() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.5, top_k=1)
              for i in range(6)]
    out = _sample(logits, params, list(range(6)))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_is_greedy_even_with_tied_top_values() -> None:
    logits = torch.zeros(50, 8)
    logits[:, [2, 6]] = 1.0
    params = [SamplingParams(temperature=3.0, top_k=1, seed=i) for i in range(50)]
    assert set(_sample(logits, params, [0] * 50).tolist()) == {2}


def test_top_k_keeps_ties_at_the_cut_off() -> None:
    logits = torch.zeros(200, 8)
    logits[:, [1, 4, 7]] = 1.0
    out = _sample(logits, [SamplingParams(top_k=2, seed=4)] * 200, list(range(200)))
    assert set(out.tolist()) == {1, 4, 7}


def test_top_k_keeps_only_k_largest() -> None:
    row = torch.arange(VOCAB, dtype=torch.float32) / 4  # token VOCAB-1 is the largest
    out = _sample_each_position(row, SamplingParams(temperature=5.0, top_k=3, seed=1), 300)
    assert set(out.tolist()) == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_never_picks_filtered_token() -> None:
    # probs 0.5, 0.3, then the rest tiny: top_p 0.7 keeps exactly {0, 1}.
    probs = torch.full((VOCAB,), 0.2 / (VOCAB - 2))
    probs[0], probs[1] = 0.5, 0.3
    row = probs.log()
    for seed in range(3):
        out = _sample_each_position(row, SamplingParams(top_p=0.7, seed=seed), 300)
        assert set(out.tolist()) == {0, 1}


def test_top_p_keeps_top_token_even_when_tiny() -> None:
    out = _sample_each_position(_logits(1)[0], SamplingParams(top_p=1e-6, seed=3), 50)
    assert set(out.tolist()) == {int(_logits(1)[0].argmax())}


def test_min_p_never_picks_filtered_token() -> None:
    # probs relative to max: 1, 0.5, 0.2, rest 0.01: min_p 0.3 keeps {0, 1}.
    rel = torch.full((VOCAB,), 0.01)
    rel[0], rel[1], rel[2] = 1.0, 0.5, 0.2
    row = rel.log()
    for seed in range(3):
        out = _sample_each_position(row, SamplingParams(min_p=0.3, seed=seed), 300)
        assert set(out.tolist()) == {0, 1}


def test_filters_compose_in_one_batch() -> None:
    row = torch.arange(VOCAB, dtype=torch.float32) / 8
    n = 100
    params = ([SamplingParams(temperature=2.0, top_k=2)] * n + [SamplingParams(top_p=0.5)] * n
              + [SamplingParams(min_p=0.9)] * n + [SamplingParams(top_k=5, top_p=0.9, min_p=0.1)] * n)
    out = _sample(row.expand(4 * n, -1), params, list(range(4 * n))).view(4, n)
    assert set(out[0].tolist()) <= {VOCAB - 1, VOCAB - 2}
    top_p_kept = set(out[1].tolist())
    assert top_p_kept and min(top_p_kept) >= VOCAB - 10  # ~6 tokens carry half the mass
    assert set(out[2].tolist()) == {VOCAB - 1}  # exp(-1/8) < 0.9
    assert set(out[3].tolist()) <= set(range(VOCAB - 5, VOCAB))


def test_temperature_distribution_matches_softmax() -> None:
    row = torch.tensor([0.0, 1.0, 2.0, 0.5])
    temperature = 1.7
    n = 4000
    out = _sample_each_position(row, SamplingParams(temperature=temperature, seed=11), n)
    counts = torch.bincount(out, minlength=4).double()
    expected = torch.softmax(row.double() / temperature, dim=0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.0  # 3 degrees of freedom: P(chi2 > 16.3) ~ 0.001


def test_unseeded_rows_sample_from_softmax() -> None:
    torch.manual_seed(0)
    row = torch.tensor([0.0, 1.0])
    out = _sample(row.expand(2000, -1), [SamplingParams()] * 2000, [0] * 2000)
    frac = out.double().mean().item()
    assert abs(frac - 1 / (1 + math.exp(-1))) < 0.05


def test_seeded_rows_independent_of_batch_composition_and_order() -> None:
    logits = _logits(4, seed=5)
    seeded = [SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=0.8, top_p=0.9, seed=7)]
    alone = [_sample(logits[i:i + 1], [seeded[i]], [9])[0].item() for i in range(2)]

    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=3, min_p=0.2)]
    mixed = _sample(logits[[2, 1, 3, 0]], [others[0], seeded[1], others[1], seeded[0]], [1, 9, 4, 9])
    assert [mixed[3].item(), mixed[1].item()] == alone

    for trial in range(5):  # many different positions, all distinct under both batch layouts
        pos = 100 + trial
        solo = _sample(logits[:1], [seeded[0]], [pos])
        batched = _sample(logits[[1, 0, 0]], [seeded[1], seeded[0], SamplingParams()], [3, pos, pos])
        assert batched[1].item() == solo.item()


def test_different_seeds_differ() -> None:
    row = torch.zeros(VOCAB)
    a = _sample_each_position(row, SamplingParams(seed=1), 64)
    b = _sample_each_position(row, SamplingParams(seed=2), 64)
    assert (a != b).sum() > 32
    assert torch.equal(a, _sample_each_position(row, SamplingParams(seed=1), 64))


def test_row_seed_is_63_bit_and_spreads() -> None:
    seeds = {row_seed(s, p) for s in (-1, 0, 1, 2**40) for p in range(100)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_bfloat16_logits_accepted(temperature: float) -> None:
    logits = _logits(3).to(torch.bfloat16)
    params = [SamplingParams(temperature=temperature, top_k=4, top_p=0.8, seed=i) for i in range(3)]
    out = _sample(logits, params, [0, 1, 2])
    assert out.dtype == torch.int64 and out.shape == (3,)
    if temperature == 0.0:
        assert torch.equal(out, logits.argmax(dim=-1))
    else:
        assert torch.equal(out, _sample(logits.float(), params, [0, 1, 2]))


def test_empty_batch_and_shape_errors() -> None:
    assert _sample(torch.zeros(0, VOCAB), [], []).shape == (0,)
    with pytest.raises(ValueError):
        _sample(torch.zeros(2, VOCAB), [SamplingParams()], [0])
    with pytest.raises(ValueError):
        _sample(torch.zeros(VOCAB), [SamplingParams()], [0])


def test_masked_logits_never_sampled() -> None:
    row = _logits(1)[0]
    row[::2] = float("-inf")  # e.g. a logits processor banned the even tokens
    for params in (SamplingParams(seed=1), SamplingParams(top_k=40, top_p=0.95, seed=2),
                   SamplingParams(top_p=0.999999, min_p=0.01, seed=3)):
        out = _sample_each_position(row, params, 200)
        assert all(t % 2 == 1 for t in out.tolist())


# ---- penalties ----------------------------------------------------------------------------

SMALL_VOCAB = 16  # logprobs=16 then returns the whole distribution


def _expected_penalized(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    """The penalised logits of one row, computed token by token in float64."""
    x = row.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def _full_logprobs(out: SamplerOutput, row: int) -> torch.Tensor:
    """Row `row`'s whole logprob vector, from a top list that covers the vocabulary."""
    lp = out.logprobs[row]
    assert lp is not None and len(lp.top) == SMALL_VOCAB
    vec = torch.full((SMALL_VOCAB,), float("nan"), dtype=torch.float64)
    for token, value in lp.top:
        vec[token] = value
    return vec


def test_penalties_match_direct_computation_in_mixed_batch() -> None:
    logits = _logits(4, SMALL_VOCAB, seed=3)
    logits[:, [1, 2]] = torch.tensor([2.5, -1.5])  # seen tokens of both signs
    prompt, output = [1, 2, 2, 5, 9], [2, 7, 7, 7, 9, 1]
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.7, logprobs=SMALL_VOCAB),
        SamplingParams(temperature=0.0, logprobs=SMALL_VOCAB),  # no penalty: unchanged
        SamplingParams(temperature=0.9, seed=1, frequency_penalty=-0.4, presence_penalty=-1.1,
                       repetition_penalty=1.3, logprobs=SMALL_VOCAB),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, logprobs=SMALL_VOCAB),
    ]
    rows = [SampleRequest(p, len(output), prompt, output) for p in params]
    before = logits.clone()
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are never written to
    for i, p in enumerate(params):
        expected = torch.log_softmax(_expected_penalized(logits[i], p, prompt, output), dim=0)
        assert torch.allclose(_full_logprobs(out, i), expected, atol=1e-5), i


def test_presence_and_frequency_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, SMALL_VOCAB)
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25,
                       logprobs=SMALL_VOCAB)
    out = Sampler()(logits, [SampleRequest(p, 3, [4, 4, 4, 6], [6, 6, 8])])
    lp = _full_logprobs(out, 0)
    raw = lp - lp[0]  # logits up to a constant; token 0 is unpenalised
    assert raw[4].item() == pytest.approx(0.0, abs=1e-6)  # prompt only: untouched
    assert raw[6].item() == pytest.approx(-1.0, abs=1e-6)  # 0.5 + 2 * 0.25
    assert raw[8].item() == pytest.approx(-0.75, abs=1e-6)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.zeros(5, SMALL_VOCAB)
    logits[:, 3], logits[:, 5] = 1.0, 0.9
    logits[4] -= 5.0  # all negative: 3 still the largest
    g = 0.0
    cases = [
        (SamplingParams(temperature=g, presence_penalty=0.2), [], [3], 5),
        (SamplingParams(temperature=g, presence_penalty=0.2), [3], [], 3),  # prompt only
        (SamplingParams(temperature=g, frequency_penalty=0.06), [], [3, 3], 5),
        (SamplingParams(temperature=g, repetition_penalty=1.2), [3], [], 5),  # 1 / 1.2 < 0.9
        (SamplingParams(temperature=g, repetition_penalty=1.1), [3], [], 5),  # -4 * 1.1 < -4.1
    ]
    rows = [SampleRequest(p, len(o), pr, o) for p, pr, o, _ in cases]
    assert Sampler()(logits, rows).token_ids.tolist() == [c[3] for c in cases]


def test_seeded_row_with_penalties_independent_of_batch() -> None:
    logits = _logits(3, seed=8)
    p = SamplingParams(temperature=1.2, seed=5, repetition_penalty=1.5, frequency_penalty=0.3)
    row = SampleRequest(p, 4, [1, 2, 3], [3, 4, 4, 5])
    alone = Sampler()(logits[1:2], [row]).token_ids.item()
    others = _rows([SamplingParams(temperature=0.0), SamplingParams(top_k=5)], [0, 0])
    mixed = Sampler()(logits[[0, 1, 2]], [others[0], row, others[1]]).token_ids
    assert mixed[1].item() == alone


def test_penalty_token_ids_out_of_range_rejected() -> None:
    p = SamplingParams(presence_penalty=1.0)
    with pytest.raises(ValueError, match="token ids"):
        Sampler()(torch.zeros(1, SMALL_VOCAB), [SampleRequest(p, 1, [], [SMALL_VOCAB])])


# ---- logprobs -----------------------------------------------------------------------------

def test_logprobs_of_sampled_token_and_sorted_top() -> None:
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0.7, top_k=3, seed=9, logprobs=5),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0, seed=3, logprobs=20)]
    out = Sampler()(logits, _rows(params, [0, 1, 2, 3]))
    reference = torch.log_softmax(logits.float(), dim=-1)  # before temperature and top-k
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        assert lp is not None
        token = int(out.token_ids[i])
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[i, token].item(), abs=1e-6)
        k = params[i].logprobs
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        expected = reference[i].topk(k).values.tolist() if k else []
        assert values == pytest.approx(expected, abs=1e-6)
        assert all(v == pytest.approx(reference[i, t].item(), abs=1e-6) for t, v in lp.top)
    assert out.logprobs[2].top == []


def test_logprobs_top_capped_at_vocab() -> None:
    out = Sampler()(torch.randn(1, 8), _rows([SamplingParams(temperature=0.0, logprobs=20)], [0]))
    assert len(out.logprobs[0].top) == 8


def test_greedy_fast_path_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=1)] * 3

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the greedy fast path must not build tensors or logprobs")

    for name in ("log_softmax", "tensor", "zeros", "where", "softmax"):
        monkeypatch.setattr(torch, name, forbidden)
    out = Sampler()(logits, _rows(params, range(6)))
    monkeypatch.undo()
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs == [None] * 6


def test_no_log_softmax_without_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("log_softmax called though no row wants logprobs")

    monkeypatch.setattr(torch, "log_softmax", forbidden)
    params = [SamplingParams(seed=1, repetition_penalty=1.2), SamplingParams(temperature=0.0)]
    rows = [SampleRequest(p, 1, [1, 2], [3]) for p in params]
    assert Sampler()(_logits(2), rows).logprobs == [None, None]
    rows[1].params = SamplingParams(temperature=0.0, logprobs=0)  # the patch is the one used
    with pytest.raises(AssertionError, match="log_softmax"):
        Sampler()(_logits(2), rows)


# ---- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 2.5}, {"presence_penalty": -2.01}, {"presence_penalty": float("nan")},
    {"presence_penalty": "1"}, {"frequency_penalty": 3}, {"frequency_penalty": True},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
    {"repetition_penalty": float("inf")}, {"logprobs": -1}, {"logprobs": 21},
    {"logprobs": 1.5}, {"logprobs": True},
])
def test_invalid_penalties_and_logprobs_rejected(kwargs: dict[str, object]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


def test_boundary_penalties_and_logprobs_accepted() -> None:
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                       logprobs=20)
    assert p.presence_penalty == -2.0 and isinstance(p.presence_penalty, float)
    assert p.has_penalties and SamplingParams(logprobs=0).logprobs == 0
    assert not SamplingParams().has_penalties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_reference_follows_argmax_with_ties_and_nan(dtype) -> None:
    from tessellm.kernels.reference import greedy_tokens
    x = torch.randn(16, 5000, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[2, 10] = x[2, 4000] = 50.0          # a tie: the lower index
    x[7, 123] = float("nan")              # NaN wins, as in argmax
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
    assert greedy_tokens(x)[2] == 10 and greedy_tokens(x)[7] == 123


def test_greedy_rows_run_through_the_selected_kernel_once_chosen_per_shape() -> None:
    """select_greedy(rows, vocab, dtype) is asked once per shape; its function then serves
    every all-greedy batch, the greedy rows of a mixed batch and penalised (float32) rows."""
    from tessellm.kernels.reference import greedy_tokens
    asked, ran = [], []

    def select(rows: int, vocab: int, dtype: torch.dtype):
        asked.append((rows, vocab, dtype))

        def fn(x: torch.Tensor) -> torch.Tensor:
            ran.append((tuple(x.shape), x.dtype))
            return greedy_tokens(x)
        return fn

    sampler = Sampler(select_greedy=select)
    logits = _logits(3).to(torch.bfloat16)
    greedy = [SamplingParams(temperature=0.0)] * 3
    for _ in range(2):
        out = sampler(logits, _rows(greedy, [0] * 3)).token_ids
        assert torch.equal(out, logits.argmax(-1))
    assert asked == [(3, VOCAB, torch.bfloat16)] and len(ran) == 2
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
             SamplingParams(temperature=0.0, presence_penalty=1.0)]
    out = sampler(logits, _rows(mixed, [0] * 3)).token_ids
    assert asked[-1] == (3, VOCAB, torch.float32) and ran[-1] == ((3, VOCAB), torch.float32)
    assert out[0] == logits[0].float().argmax()


def test_the_cpu_engine_chooses_a_greedy_kernel_for_every_row_bucket(stories_dir) -> None:
    """The warm-up chooses the device's greedy_tokens kernel for each row bucket up to
    max_num_seqs, in the model's dtype and in float32 (penalised logits), and the runner's
    sampler uses it (test_engine_devices checks the greedy tokens end to end)."""
    from tessellm import LLM
    from tessellm.engine.kernel_warmup import choose_kernels
    from tessellm.engine.sampler import greedy_kernel_query
    llm = LLM(str(stories_dir), dtype="bfloat16", max_num_seqs=4, load_progress=False)
    try:
        choices = choose_kernels(llm.engine.parts)
        greedy = {k.split("|")[1] + "|" + k.split("|")[2]: v for k, v in choices.items()
                  if k.startswith("greedy_tokens|")}
        assert set(greedy) == {f"{dt}|T{b}" for dt in ("bfloat16", "float32")
                               for b in (1, 2, 4)}
        assert set(greedy.values()) <= {"greedy_native", "greedy_torch_max"}
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].token_ids) == 4
        parts = llm.engine.parts
        vocab = parts.spec.vocab_size
        chosen = parts.selector.select(greedy_kernel_query(1, vocab, torch.bfloat16))
        assert llm.engine.runner.sampler._greedy_fns[(1, vocab, torch.bfloat16)] is chosen.fn
    finally:
        llm.close()
