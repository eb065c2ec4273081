"""Turns a batch of logits into one token id per row, on the logits' device.

Pipeline for a row (the order is part of the contract):

    greedy (temperature == 0 or top_k == 1):  argmax(logits); ties go to the lowest index
             (torch.argmax), so top_k == 1 is exactly greedy even when the top value is tied.
    random:  x = float32(logits) / temperature
             -> top-k  (keep tokens whose value >= the k-th largest value)
             -> top-p  (keep the smallest most-probable prefix whose mass >= top_p; the top
                        token is always kept)
             -> min-p  (drop tokens whose prob < min_p * max prob)
             -> token = argmax(softmax(x) / E),  E ~ Exponential(1) i.i.d. per token

Invariants:
- If every row is greedy, the sampler runs one argmax and nothing else (the benchmark hot path).
- Filters compose by masking logits to -inf; a token masked by one filter stays masked, so the
  sampled token always survives every filter of its row.
- Filters use thresholds on values, not positions in a sort: tokens tied at a cut-off are kept
  together (top-k may keep more than k), so the kept set never depends on how a sort orders
  equal values.
- A filter no row uses is skipped. A row that does not use a filter the batch runs passes it
  unchanged (k = vocab, top_p = +inf, min_p = 0), so which filters run never changes a row.
- The exponential race picks token i with probability p_i exactly (argmax of p_i / E_i), and
  needs no normalisation or cumulative sum.
- A row with a seed draws its noise from its own torch.Generator seeded by a 64-bit mix of
  (seed, output position), masked to 63 bits. Every step on the row is row-wise, so its token
  depends only on (seed, output position, its logits, its params): not on batch size, order or
  the other rows. Rows without a seed share one batched draw from the default generator.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tessellm.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def row_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position).

    `seed * 1_000_003 + position` is finished with the splitmix64 mixer, so nearby seeds and
    positions give unrelated generator states (torch's CPU generator only reads the low 32 bits).
    """
    z = (seed * 1_000_003 + position + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


class Sampler:
    """Stateless; call it with a step's logits, per-row params and per-row output positions."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_positions: Sequence[int],
    ) -> torch.Tensor:
        """Return int64 token ids [batch] on `logits.device`.

        `logits` is [batch, vocab] of any float dtype; `params[i]` and `output_positions[i]`
        (tokens row i's request has generated so far) describe row i.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(output_positions) != batch:
            raise ValueError(
                f"batch of {batch} logits rows needs as many params and output positions, "
                f"got {len(params)} and {len(output_positions)}"
            )
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0 and p.top_k != 1]
        if not random_rows:
            return logits.argmax(dim=-1)
        if len(random_rows) == batch:
            return _sample_random(logits, params, output_positions)
        out = logits.argmax(dim=-1)
        index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        sampled = _sample_random(
            logits.index_select(0, index),
            [params[i] for i in random_rows],
            [output_positions[i] for i in random_rows],
        )
        return out.index_copy_(0, index, sampled)


def _sample_random(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> torch.Tensor:
    """Sample every row of `logits` (all rows have temperature > 0 and top_k != 1)."""
    device = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    x = logits.float() / temps.unsqueeze(1)

    ks = [min(p.top_k, vocab) if p.top_k is not None and p.top_k > 0 else vocab for p in params]
    use_top_k = any(k < vocab for k in ks)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_p:
        x = _top_k_top_p(x, ks if use_top_k else None, params)
    elif use_top_k:
        x = _top_k(x, ks)
    if any(p.min_p > 0.0 for p in params):
        x = _min_p(x, params)

    weights = torch.softmax(x, dim=-1)
    noise = _exponential_noise(weights.shape, params, positions, device)
    return (weights / noise).argmax(dim=-1)


def _kth_threshold(sorted_desc: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """The k-th largest value of each row, [n, 1], given values sorted in descending order."""
    k_index = torch.tensor(ks, dtype=torch.long, device=sorted_desc.device).unsqueeze(1) - 1
    return sorted_desc.gather(1, k_index)


def _top_k(x: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Mask to -inf every token below its row's k-th largest value (ties at the k-th are kept)."""
    top = x.topk(max(ks), dim=-1).values
    return x.masked_fill(x < _kth_threshold(top, ks), float("-inf"))


def _top_k_top_p(
    x: torch.Tensor, ks: Sequence[int] | None, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Top-k (if `ks`) then top-p, from one descending sort of the values (no indices needed)."""
    sorted_x = x.sort(dim=-1, descending=True).values
    if ks is not None:
        kth = _kth_threshold(sorted_x, ks)
        x = x.masked_fill(x < kth, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    # top_p == 1 rows get +inf so float rounding in the cumulative sum never trims their tail.
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params],
        dtype=torch.float32,
        device=x.device,
    ).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    cumulative = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    # The kept set is a prefix of the sorted row (mass_before never decreases); position 0 has
    # mass_before == 0 < top_p, so at least the top token is kept.
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)
    cutoff = sorted_x.gather(1, num_kept - 1)
    return x.masked_fill(x < cutoff, float("-inf"))


def _min_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times their row's largest probability."""
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=x.device)
    probs = torch.softmax(x, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return x.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(
    shape: torch.Size,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    device: torch.device,
) -> torch.Tensor:
    """Exponential(1) noise [n, vocab], strictly positive; seeded rows from their own generator."""
    seeded = [(i, p.seed) for i, p in enumerate(params) if p.seed is not None]
    if len(seeded) == len(params):
        noise = torch.empty(shape, dtype=torch.float32, device=device)
    else:
        noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for i, seed in seeded:
        noise[i] = _seeded_exponential(shape[1], row_seed(seed, positions[i]), device)
    # Exponential draws may round to 0; p / 0 would be inf (or nan for p == 0, which argmax favours).
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _seeded_exponential(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """n Exponential(1) draws from a fresh generator; drawn on the CPU where the device has none."""
    try:
        gen, draw_device = torch.Generator(device=device), device
    except RuntimeError:
        gen, draw_device = torch.Generator(device="cpu"), torch.device("cpu")
    gen.manual_seed(seed)
    draws = torch.empty(n, dtype=torch.float32, device=draw_device).exponential_(generator=gen)
    return draws.to(device)
