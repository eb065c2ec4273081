"""Random sampling (the `sample_tokens` op): temperature, top-k, top-p, min-p and the
exponential race, with reference.sample_tokens' contract and numerics.

One program per row, looping over the vocabulary in chunks of BLOCK (a row is never held in
registers whole, so vocabularies of 256k cost no more registers than 4k). Everything is
float32; x = float32(logit) / temperature is recomputed from the logits in each pass (IEEE
division, `div_rn`, as torch divides) rather than stored.

  1. one pass: the row max m and the smallest value.
  2. top-k (rows with k < vocab only): the k-th largest value, found exactly by binary search
     over the order-preserving int32 key of the float32 bits (count of values >= t, one pass
     per step, 32 steps cover every int32; each step also moves the bounds to the nearest
     keys of the row, so the search stops once no key lies between them). Tokens with
     key >= that value are kept, so ties at the cut-off are kept, as the reference's value
     threshold keeps them.
  3. top-p (rows with top_p < 1 only): one pass for the normaliser Z = sum of exp(x - m) over
     the kept tokens, then the cut-off = the smallest kept value v such that the kept mass
     strictly above v is < top_p * Z, by binary search over the keys again. That is the
     reference's sorted-prefix rule (mass before a position < top_p), ties at the cut-off
     and the always-kept top token included.
  4. min-p: keep exp(x - m) >= min_p (prob >= min_p * max prob, as the max token has
     exp(0) = 1).
  5. the winner: argmax over kept tokens of exp(x - m) / noise, the first index on ties (as
     torch.argmax). The reference divides softmax(x) / noise, i.e. every score also by the
     row's normaliser: the same order in exact arithmetic. The top-k set is exact; the two
     can differ only through float rounding where the two best scores lie within a few
     ulps, or a top-p / min-p boundary falls within rounding of a token's mass (torch's
     softmax, cumsum and exp round differently) - events of probability ~1e-6 per row on
     random logits, never seen in the tests (which run in Triton's interpreter, whose exp is
     numpy's). On a GPU `tl.exp` is ex2.approx (a few float32 ulps from torch's expf), the
     same kind of near-tie event at a similar rate: there, tokens equal the reference's on
     all but a budget of 1e-3 of the rows (scripts/gpu_accuracy.py measures the rate), not
     on every row. The divisions are IEEE (div_rn) on both.

-0.0 is read as +0.0 (they compare equal, so they must share a key). NaN logits are outside
the contract. Plain pointer arithmetic and masks only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all

_MAX_BLOCK = 4096
_I32_MAX = tl.constexpr(2147483647)
_I32_MIN = tl.constexpr(-2147483648)
_SEARCH_STEPS = tl.constexpr(32)   # halvings that reduce any int32 range to one key


@triton.jit
def _keys(x):
    """Order-preserving int32 keys of float32 x (x not NaN, -0.0 already made +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _scaled(row_ptr, cols, mask, temp):
    """float32(logits[cols]) / temp (IEEE rounding), -0.0 as +0.0; masked lanes hold 0."""
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.math.div_rn(x, tl.zeros_like(x) + temp)
    return tl.where(x == 0.0, 0.0, x)


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, noise_ptr, noise_stride, temp_ptr, top_k_ptr,
                   top_p_ptr, min_p_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * logits_stride
    noise_row = noise_ptr + row * noise_stride
    temp = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    offs = tl.arange(0, BLOCK)

    # 1. row max (float) and smallest key
    vmax = tl.full([BLOCK], float("-inf"), tl.float32)
    kmin = tl.full([BLOCK], _I32_MAX, tl.int32)
    for c0 in range(0, vocab, BLOCK):
        cols = c0 + offs
        m = cols < vocab
        x = _scaled(x_row, cols, m, temp)
        vmax = tl.maximum(vmax, tl.where(m, x, float("-inf")))
        kmin = tl.minimum(kmin, tl.where(m, _keys(x), _I32_MAX))
    x_max = tl.max(vmax, axis=0)
    max_key = _keys(x_max).to(tl.int64)
    thr = tl.min(kmin, axis=0).to(tl.int64)   # keep key >= thr: everything so far

    # 2. top-k: the largest key t with count(key >= t) >= k. lo and hi stay keys of the row
    # (each step moves them to the nearest key on their side of mid), so the search ends as
    # soon as no key lies strictly between them, often well before 32 steps.
    if k < vocab:
        lo = thr
        hi = max_key
        for _ in range(_SEARCH_STEPS):
            if lo < hi:
                mid = (lo + hi + 1) >> 1
                t = mid.to(tl.int32)
                cnt = tl.zeros([BLOCK], tl.int32)
                above = tl.full([BLOCK], _I32_MAX, tl.int32)    # smallest key >= t
                below = tl.full([BLOCK], _I32_MIN, tl.int32)    # largest key < t
                for c0 in range(0, vocab, BLOCK):
                    cols = c0 + offs
                    m = cols < vocab
                    key = _keys(_scaled(x_row, cols, m, temp))
                    ge = m & (key >= t)
                    cnt += tl.where(ge, 1, 0)
                    above = tl.minimum(above, tl.where(ge, key, _I32_MAX))
                    below = tl.maximum(below, tl.where(m & (key < t), key, _I32_MIN))
                ok = tl.sum(cnt, axis=0) >= k
                lo = tl.where(ok, tl.min(above, axis=0).to(tl.int64), lo)
                hi = tl.where(ok, hi, tl.max(below, axis=0).to(tl.int64))
        thr = lo
    thr32 = thr.to(tl.int32)

    # 3. top-p: the smallest kept key t whose kept mass strictly above it is < top_p * Z
    cut = thr
    if top_p < 1.0:
        z_acc = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, vocab, BLOCK):
            cols = c0 + offs
            m = cols < vocab
            x = _scaled(x_row, cols, m, temp)
            z_acc += tl.where(m & (_keys(x) >= thr32), tl.exp(x - x_max), 0.0)
        target = top_p * tl.sum(z_acc, axis=0)
        # The mass above t is the same for t and the largest kept key <= t, so lo and hi
        # move to kept keys as in the top-k search. hi starts at the max, whose mass above
        # is 0 < target: the top token is always kept.
        lo = thr
        hi = max_key
        for _ in range(_SEARCH_STEPS):
            if lo < hi:
                mid = (lo + hi) >> 1
                t = mid.to(tl.int32)
                acc = tl.zeros([BLOCK], tl.float32)
                above = tl.full([BLOCK], _I32_MAX, tl.int32)    # smallest kept key > t
                below = tl.full([BLOCK], _I32_MIN, tl.int32)    # largest kept key <= t
                for c0 in range(0, vocab, BLOCK):
                    cols = c0 + offs
                    m = cols < vocab
                    x = _scaled(x_row, cols, m, temp)
                    key = _keys(x)
                    kept = m & (key >= thr32)
                    gt = kept & (key > t)
                    acc += tl.where(gt, tl.exp(x - x_max), 0.0)
                    above = tl.minimum(above, tl.where(gt, key, _I32_MAX))
                    below = tl.maximum(below, tl.where(kept & (key <= t), key, _I32_MIN))
                ok = tl.sum(acc, axis=0) < target
                hi = tl.where(ok, tl.max(below, axis=0).to(tl.int64), hi)
                lo = tl.where(ok, lo, tl.min(above, axis=0).to(tl.int64))
        cut = lo
    cut32 = cut.to(tl.int32)

    # 4-5. min-p, then the race; chunks in index order and a strict > keep the first maximum
    best = tl.full([], -1.0, tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for c0 in range(0, vocab, BLOCK):
        cols = c0 + offs
        m = cols < vocab
        x = _scaled(x_row, cols, m, temp)
        e = tl.exp(x - x_max)
        keep = m & (_keys(x) >= cut32) & (e >= min_p)
        noise = tl.load(noise_row + cols, mask=m, other=1.0)
        score = tl.where(keep, tl.math.div_rn(e, noise), -1.0)
        cmax = tl.max(score, axis=0)
        cidx = tl.min(tl.where(score == cmax, cols, _I32_MAX), axis=0)
        better = cmax > best
        best_idx = tl.where(better, cidx, best_idx)
        best = tl.where(better, cmax, best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """reference.sample_tokens: logits [n, vocab] (any float dtype), temperature / top_p /
    min_p [n] float32, top_k [n] int64, noise [n, vocab] float32 > 0 -> int64 [n]."""
    out, launches = sample_tokens_launches(logits, temperature, top_k, top_p, min_p, noise)
    run_all(launches)
    return out


def sample_tokens_launches(logits: torch.Tensor, temperature: torch.Tensor,
                           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                           noise: torch.Tensor) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launch of sample_tokens, not run."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0 or vocab == 0:
        return out, []
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    noise = noise.float()
    if noise.stride(1) != 1:
        noise = noise.contiguous()
    temperature, top_p, min_p = (t.float().contiguous() for t in (temperature, top_p, min_p))
    top_k = top_k.long().contiguous()
    block = min(_MAX_BLOCK, triton.next_power_of_2(vocab))
    return out, [Launch(
        _sample_kernel, (n,),
        (logits, logits.stride(0), noise, noise.stride(0), temperature, top_k, top_p, min_p,
         out, vocab),
        dict(BLOCK=block, num_warps=8 if block >= 4096 else 4))]
