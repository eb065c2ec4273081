"""Turns a batch of logits into one token id per row (and optional logprobs), on the logits' device.

This module is the pipeline and its contract; the stages live beside it: penalties and biases
in logit_penalties.py, the random draw in random_sampling.py, logprobs in
logprobs_from_logits.py.

Pipeline for a row (the order is part of the contract):

    penalties (only rows that set one; on float32 logits, out of place):
             repetition: tokens seen in prompt + generated: x / r if x > 0 else x * r
             -> presence / frequency: x -= presence * (count > 0) + frequency * count,
                counts over the generated tokens only
    logit bias (only rows that set one): x[t] += bias[t] (float32, out of place)
    token mask (only the rows of `masks`: constrained requests): the device op
             `apply_token_bitmask` sets -inf where the row's bitmask forbids a token, on a
             float32 copy of those rows (select_bitmask(rows, vocab) gives the kernel, else
             the reference)
    logprobs (only rows with params.logprobs set): log_softmax of the float32 logits AFTER the
             penalties, bias and mask and BEFORE temperature and the filters, so they describe
             the model's (penalised, constrained) distribution, not the truncated one the token
             was drawn from; masked tokens (-inf logits) report -inf. `top` holds min(k, vocab)
             entries, descending.
    greedy (temperature == 0 or top_k == 1):  argmax(x); ties go to the lowest index
             (torch.argmax), so top_k == 1 is exactly greedy even when the top value is tied.
             The device op `greedy_tokens` (its reference: torch.max(x, -1).indices, a NaN
             counting as the largest value) through `select_greedy(rows, vocab, dtype)` where
             the engine gives one, else that reference.
    random:  x = float32(x) / temperature
             -> top-k  (keep tokens whose value >= the k-th largest value)
             -> top-p  (keep the smallest most-probable prefix whose mass >= top_p; the top
                        token is always kept)
             -> min-p  (drop tokens whose prob < min_p * max prob)
             -> token = argmax(softmax(x) / E),  E ~ Exponential(1) i.i.d. per token
             The noise E is drawn here (below); everything after it is the device op
             `sample_tokens` (kernels/reference.py is its reference and its contract). The
             Sampler calls the function `select_kernel(rows, vocab)` gives (the engine asks the
             device's kernel selector; a device with no kernel for the op, such as cpu, gets
             the torch reference, which runs on any device), so a seed means the same draws
             whichever kernel runs.

Invariants:
- If no row has a penalty, a bias or a mask or wants logprobs and every row is greedy, the
  sampler runs one argmax and nothing else: no per-row tensors (the benchmark hot path).
- Penalties, biases, masks and logprobs are computed only for the rows that ask for them; the
  other rows' logits are used unchanged (as float32 where some row needed a copy: the same
  values, so the same tokens). The caller's logits tensor is never written to.
- Filters compose by masking logits to -inf; a token masked by one filter stays masked, so the
  sampled token always survives every filter of its row.
- Filters use thresholds on values, not positions in a sort: tokens tied at a cut-off are kept
  together (top-k may keep more than k), so the kept set never depends on how a sort orders
  equal values.
- A filter no row uses is skipped (the reference is told from the host-side lists; a kernel
  skips per row). A row that does not use a filter the batch runs passes it unchanged
  (k = vocab, top_p = +inf, min_p = 0), so which filters run never changes a row.
- The exponential race picks token i with probability p_i exactly (argmax of p_i / E_i), and
  needs no normalisation or cumulative sum.
- A row with a seed draws its noise from its own torch.Generator seeded by a 64-bit mix of
  (seed, output position), masked to 63 bits. Every step on the row is row-wise, so its token
  depends only on (seed, output position, its logits, its tokens, its params): not on batch
  size, order or the other rows. Rows without a seed share one batched draw from the default
  generator.
- Logprobs are read back to the host inside the call (one synchronising copy, only when some
  row wants them); token ids stay on the device.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tessellm.engine.logit_penalties import bias_rows, penalize_rows, select_rows
from tessellm.engine.logprobs_from_logits import fill_logprobs
from tessellm.engine.random_sampling import SelectSampleKernel, sample_random
from tessellm.engine.token_logprobs import TokenLogprobs
from tessellm.kernels import reference
from tessellm.kernels.registry import KernelQuery
from tessellm.sampling_params import SamplingParams
# (buffer name, host tensor) -> the same values on the logits' device, copied through the
# runner's staging buffers (pinned host memory, the transfer stream, compute ordered after it),
# so the copy never makes the host wait for queued kernels; names: SAMPLE_ROWS, SAMPLE_TABLE
StageToDevice = Callable[[str, torch.Tensor], torch.Tensor]
SAMPLE_ROWS, SAMPLE_TABLE = "sample_rows", "sample_table"
SAMPLE_OP = "sample_tokens"
GREEDY_OP = "greedy_tokens"
BITMASK_OP = "apply_token_bitmask"
# (rows, vocab) -> a function with reference.apply_token_bitmask's signature (float32 logits)
SelectBitmaskKernel = Callable[[int, int], Callable[[torch.Tensor, torch.Tensor], None]]
# (rows, vocab, logits dtype) -> a function with reference.greedy_tokens' signature
SelectGreedyKernel = Callable[[int, int, torch.dtype], Callable[[torch.Tensor], torch.Tensor]]


def sample_kernel_query(bucket: int, vocab: int) -> KernelQuery:
    """The kernel query of the random-sampling op for a token bucket of rows (float32: the op
    computes in float32 whatever the logits' dtype)."""
    return KernelQuery(SAMPLE_OP, torch.float32, bucket, (("vocab", vocab),))


def greedy_kernel_query(bucket: int, vocab: int, dtype: torch.dtype) -> KernelQuery:
    """The kernel query of the greedy op for a token bucket of rows of `dtype` logits (the
    model's dtype; float32 once penalties have been applied)."""
    return KernelQuery(GREEDY_OP, dtype, bucket, (("vocab", vocab),))


def bitmask_kernel_query(bucket: int, vocab: int) -> KernelQuery:
    """The kernel query of the token-mask op for a token bucket of constrained rows (float32:
    the sampler masks a float32 copy)."""
    return KernelQuery(BITMASK_OP, torch.float32, bucket, (("vocab", vocab),))


@dataclass(slots=True)
class TokenMasks:
    """The token bitmask of some rows of a step: rows[i] is masked by bitmask[i]
    (int32 [len(rows), ceil(vocab / 32)] on the logits' device)."""

    rows: list[int]
    bitmask: torch.Tensor


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row. The token sequences are only read during
    the call (the sampler keeps no reference), so a request's live lists may be passed."""

    params: SamplingParams
    output_position: int  # tokens the request has generated so far (the seed position)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [batch] on the logits' device
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


class Sampler:
    """Stateless (but for the kernel choice); call it with a step's logits and one
    SampleRequest per row.

    `select_kernel(rows, vocab)` gives the function that runs the random rows' filters and
    race (the `sample_tokens` op, reference.sample_tokens' signature); None means the torch
    reference, which runs on any device.
    """

    def __init__(self, select_kernel: SelectSampleKernel | None = None,
                 stage: StageToDevice | None = None,
                 select_greedy: SelectGreedyKernel | None = None,
                 select_bitmask: SelectBitmaskKernel | None = None) -> None:
        self.select_kernel = select_kernel
        self.stage = stage   # None: host values go up with torch.tensor(..., device=...)
        self.select_greedy = select_greedy   # None: reference.greedy_tokens
        self.select_bitmask = select_bitmask   # None: reference.apply_token_bitmask
        self._greedy_fns: dict[tuple[int, int, torch.dtype], Callable] = {}
        self._bitmask_fns: dict[tuple[int, int], Callable] = {}

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row of x, by the device's kernel where one was given."""
        if self.select_greedy is None:
            return reference.greedy_tokens(x)
        key = (x.shape[0], x.shape[1], x.dtype)
        fn = self._greedy_fns.get(key)
        if fn is None:
            fn = self._greedy_fns[key] = self.select_greedy(*key)
        return fn(x)

    def _to_device(self, name: str, values: list, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        if self.stage is None:
            return torch.tensor(values, dtype=dtype, device=device)
        return self.stage(name, torch.tensor(values, dtype=dtype))

    def _mask_rows(self, x: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
        """x as float32 with the rows of `masks` masked (out of place)."""
        sub, index = select_rows(x, masks.rows)
        sub = sub.to(torch.float32, copy=True)
        key = (sub.shape[0], sub.shape[1])
        fn = self._bitmask_fns.get(key)
        if fn is None:
            fn = self._bitmask_fns[key] = (reference.apply_token_bitmask
                                           if self.select_bitmask is None
                                           else self.select_bitmask(*key))
        fn(sub, masks.bitmask)
        return sub if index is None else x.float().index_copy(0, index, sub)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRequest],
                 masks: TokenMasks | None = None) -> SamplerOutput:
        """Sample one token per row of `logits` ([batch, vocab], any float dtype); `masks`:
        the token bitmasks of the constrained rows."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(rows) != batch:
            raise ValueError(f"batch of {batch} logits rows needs as many rows, got {len(rows)}")
        random_rows: list[int] = []
        penalized: list[int] = []
        biased: list[int] = []
        wants_logprobs: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature != 0.0 and p.top_k != 1:
                random_rows.append(i)
            if p.has_penalties:
                penalized.append(i)
            if p.logit_bias:
                biased.append(i)
            if p.logprobs is not None:
                wants_logprobs.append(i)
        if not (random_rows or penalized or biased or wants_logprobs or masks):
            return SamplerOutput(self._greedy(logits), [None] * batch)

        x = penalize_rows(logits, rows, penalized) if penalized else logits
        if biased:
            x = bias_rows(x, rows, biased)
        if masks is not None and masks.rows:
            x = self._mask_rows(x, masks)
        if len(random_rows) == batch:
            token_ids = self._sample_random(x, [r.params for r in rows],
                                            [r.output_position for r in rows])
        else:
            token_ids = self._greedy(x)
            if random_rows:
                index = self._to_device(SAMPLE_ROWS, random_rows, torch.long, logits.device)
                sampled = self._sample_random(
                    x.index_select(0, index),
                    [rows[i].params for i in random_rows],
                    [rows[i].output_position for i in random_rows],
                )
                token_ids.index_copy_(0, index, sampled)
        logprobs: list[TokenLogprobs | None] = [None] * batch
        if wants_logprobs:
            fill_logprobs(logprobs, x, token_ids, rows, wants_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _sample_random(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       positions: Sequence[int]) -> torch.Tensor:
        """Every row of `logits` has temperature > 0 and top_k != 1 (see sample_random)."""
        return sample_random(logits, params, positions, self.select_kernel,
                             lambda values: self._to_device(SAMPLE_TABLE, values, torch.float32,
                                                            logits.device))
