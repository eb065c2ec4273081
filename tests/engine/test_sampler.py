"""Tests of tessellm.engine.sampler: greedy, filters, distribution, seeded reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

from tessellm.engine.sampler import Sampler, row_seed
from tessellm.sampling_params import SamplingParams

VOCAB = 64


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample_each_position(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Sample one row n times, as one batch of n copies at output positions 0..n-1."""
    logits = logits_row.unsqueeze(0).expand(n, -1)
    return Sampler()(logits, [params] * n, list(range(n)))


def test_greedy_equals_argmax_and_returns_int64() -> None:
    logits = _logits(5)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_ties_take_lowest_index() -> None:
    logits = torch.zeros(2, 8)
    logits[0, [3, 5]] = 1.0
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert out.tolist() == [3, 0]


def test_top_k_one_equals_greedy_in_mixed_batch() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.5, top_k=1)
              for i in range(6)]
    out = Sampler()(logits, params, list(range(6)))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_is_greedy_even_with_tied_top_values() -> None:
    logits = torch.zeros(50, 8)
    logits[:, [2, 6]] = 1.0
    params = [SamplingParams(temperature=3.0, top_k=1, seed=i) for i in range(50)]
    assert set(Sampler()(logits, params, [0] * 50).tolist()) == {2}


def test_top_k_keeps_ties_at_the_cut_off() -> None:
    logits = torch.zeros(200, 8)
    logits[:, [1, 4, 7]] = 1.0
    out = Sampler()(logits, [SamplingParams(top_k=2, seed=4)] * 200, list(range(200)))
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
    out = Sampler()(row.expand(4 * n, -1), params, list(range(4 * n))).view(4, n)
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
    out = Sampler()(row.expand(2000, -1), [SamplingParams()] * 2000, [0] * 2000)
    frac = out.double().mean().item()
    assert abs(frac - 1 / (1 + math.exp(-1))) < 0.05


def test_seeded_rows_independent_of_batch_composition_and_order() -> None:
    logits = _logits(4, seed=5)
    seeded = [SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=0.8, top_p=0.9, seed=7)]
    alone = [Sampler()(logits[i:i + 1], [seeded[i]], [9])[0].item() for i in range(2)]

    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=3, min_p=0.2)]
    mixed = Sampler()(logits[[2, 1, 3, 0]], [others[0], seeded[1], others[1], seeded[0]], [1, 9, 4, 9])
    assert [mixed[3].item(), mixed[1].item()] == alone

    for trial in range(5):  # many different positions, all distinct under both batch layouts
        pos = 100 + trial
        solo = Sampler()(logits[:1], [seeded[0]], [pos])
        batched = Sampler()(logits[[1, 0, 0]], [seeded[1], seeded[0], SamplingParams()], [3, pos, pos])
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
    out = Sampler()(logits, params, [0, 1, 2])
    assert out.dtype == torch.int64 and out.shape == (3,)
    if temperature == 0.0:
        assert torch.equal(out, logits.argmax(dim=-1))
    else:
        assert torch.equal(out, Sampler()(logits.float(), params, [0, 1, 2]))


def test_empty_batch_and_shape_errors() -> None:
    assert Sampler()(torch.zeros(0, VOCAB), [], []).shape == (0,)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, VOCAB), [SamplingParams()], [0])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(VOCAB), [SamplingParams()], [0])


def test_masked_logits_never_sampled() -> None:
    row = _logits(1)[0]
    row[::2] = float("-inf")  # e.g. a logits processor banned the even tokens
    for params in (SamplingParams(seed=1), SamplingParams(top_k=40, top_p=0.95, seed=2),
                   SamplingParams(top_p=0.999999, min_p=0.01, seed=3)):
        out = _sample_each_position(row, params, 200)
        assert all(t % 2 == 1 for t in out.tolist())
