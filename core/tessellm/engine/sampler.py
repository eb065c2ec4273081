"""Turns a batch of logits into one token id per row (and optional logprobs), on the logits' device.

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
from itertools import chain

import torch

from tessellm.kernels import reference
from tessellm.kernels.registry import KernelQuery
from tessellm.sampling_params import SamplingParams
from tessellm.engine.token_logprobs import TokenLogprobs

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# (rows, vocab) -> a function with reference.sample_tokens' six positional arguments
SelectSampleKernel = Callable[[int, int], Callable[..., torch.Tensor]]
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


def row_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position).

    `seed * 1_000_003 + position` is finished with the splitmix64 mixer, so nearby seeds and
    positions give unrelated generator states (torch's CPU generator only reads the low 32 bits).
    """
    z = (seed * 1_000_003 + position + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


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
        sub, index = _select(x, masks.rows)
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

        x = _penalize_rows(logits, rows, penalized) if penalized else logits
        if biased:
            x = _bias_rows(x, rows, biased)
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
            _fill_logprobs(logprobs, x, token_ids, rows, wants_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _sample_random(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       positions: Sequence[int]) -> torch.Tensor:
        """Every row of `logits` has temperature > 0 and top_k != 1 (see sample_random)."""
        return sample_random(logits, params, positions, self.select_kernel,
                             lambda values: self._to_device(SAMPLE_TABLE, values, torch.float32,
                                                            logits.device))


def _select(x: torch.Tensor, which: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `which` of x, and their index tensor (None when `which` is every row in order)."""
    if len(which) == x.shape[0]:
        return x, None
    index = torch.tensor(which, dtype=torch.long, device=x.device)
    return x.index_select(0, index), index


def _penalize_rows(
    logits: torch.Tensor, rows: Sequence[SampleRequest], which: list[int]
) -> torch.Tensor:
    """float32 copy of `logits` with rows `which` penalised (the others converted only)."""
    x = logits.float()
    sub, index = _select(x, which)
    penalized = _apply_penalties(sub, [rows[i] for i in which])
    return penalized if index is None else x.index_copy(0, index, penalized)


def _bias_rows(x: torch.Tensor, rows: Sequence[SampleRequest], which: list[int]
               ) -> torch.Tensor:
    """float32 copy of x with each row of `which` plus its logit bias (ids checked before)."""
    row_ids, token_ids, values = [], [], []
    for i in which:
        for token, bias in rows[i].params.logit_bias.items():   # type: ignore[union-attr]
            row_ids.append(i)
            token_ids.append(token)
            values.append(bias)
    out = x.to(torch.float32, copy=True)
    index = (torch.tensor(row_ids, dtype=torch.long, device=x.device),
             torch.tensor(token_ids, dtype=torch.long, device=x.device))
    out.index_put_(index, torch.tensor(values, dtype=torch.float32, device=x.device),
                   accumulate=True)
    return out


def _apply_penalties(x: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """Penalised float32 logits [n, vocab] (out of place); every row has some penalty."""
    vocab = x.shape[1]
    params = [r.params for r in rows]
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, x.device)
    if any(p.repetition_penalty != 1.0 for p in params):
        # Rows with penalty 1 skip their prompt: x / 1 == x * 1 == x, so they pass unchanged.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen = (_token_counts(prompts, vocab, x.device) > 0) | (out_counts > 0)
        rep = _column([p.repetition_penalty for p in params], x.device)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        freq = _column([p.frequency_penalty for p in params], x.device)
        pres = _column([p.presence_penalty for p in params], x.device)
        x = x - freq * out_counts - pres * (out_counts > 0).float()
    return x


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(
    seqs: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """counts[i, t] = occurrences of token t in seqs[i], float32 [len(seqs), vocab].

    One scatter_add of every id at flat index i * vocab + t; ids are range-checked on the host
    first, since an out-of-range id would silently count for another row.
    """
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    counts = torch.zeros(len(seqs) * vocab, dtype=torch.float32, device=device)
    if flat.numel():
        if int(flat.min()) < 0 or int(flat.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) to apply penalties")
        row = torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.long), lengths)
        index = (row * vocab + flat).to(device)
        counts.scatter_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts.view(len(seqs), vocab)


def _fill_logprobs(
    out: list[TokenLogprobs | None],
    x: torch.Tensor,
    token_ids: torch.Tensor,
    rows: Sequence[SampleRequest],
    which: list[int],
) -> None:
    """Set out[i] for every row i in `which` from log_softmax(float32(x)) (penalised logits)."""
    sub, index = _select(x, which)
    chosen = token_ids if index is None else token_ids.index_select(0, index)
    logprobs = torch.log_softmax(sub.float(), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    ks = [min(rows[i].params.logprobs or 0, x.shape[1]) for i in which]
    top_lp: list[list[float]] = [[] for _ in which]
    top_ids: list[list[int]] = [[] for _ in which]
    if max(ks) > 0:
        top = logprobs.topk(max(ks), dim=-1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    for j, (i, token, lp, k) in enumerate(zip(which, chosen.tolist(), chosen_lp, ks)):
        out[i] = TokenLogprobs(token, lp, list(zip(top_ids[j][:k], top_lp[j][:k])))


def sample_random(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
    select_kernel: SelectSampleKernel | None = None,
    table_to_device: Callable[[list[list[float]]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sample every row of `logits` (all rows have temperature > 0 and top_k != 1): the noise
    is drawn here, the rest is the `sample_tokens` op (the reference, or `select_kernel`'s).
    `table_to_device` uploads the [4, n] float32 parameter table (default torch.tensor)."""
    device = logits.device
    n, vocab = logits.shape
    noise = _exponential_noise(logits.shape, params, positions, device)
    ks = [min(p.top_k, vocab) if p.top_k is not None and p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    min_p = [p.min_p for p in params]
    # One host -> device copy for the four parameter rows (top_k < 2**24: exact in float32).
    values = [[p.temperature for p in params], top_p, min_p, ks]
    table = table_to_device(values) if table_to_device is not None else torch.tensor(
        values, dtype=torch.float32, device=device)
    args = (logits, table[0], table[3].to(torch.int64), table[1], table[2], noise)
    kernel = select_kernel(n, vocab) if select_kernel is not None else reference.sample_tokens
    if kernel is not reference.sample_tokens:
        return kernel(*args)
    # The reference takes host-side hints: skip the filters no row uses (a row that does not
    # use a filter passes it unchanged, so the tokens are the same either way).
    on_k = [k for k in ks if k < vocab]
    return kernel(*args, use_top_k=bool(on_k), use_top_p=any(p < 1.0 for p in top_p),
                  use_min_p=any(p > 0.0 for p in min_p), max_top_k=max(on_k, default=None))


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


def prompt_logprobs_of(logits: torch.Tensor, spans: Sequence[tuple[object, int, int]]
                       ) -> dict[str, list[TokenLogprobs]]:
    """Prompt logprobs from the logits of prompt positions: `spans` are (request, first
    position, count) in row order; row j of a span is position first + j, whose logits give
    the logprob of prompt token first + j + 1 and the request's `prompt_logprobs` most likely
    tokens there (log_softmax of the float32 logits, no penalty or filter: the model's own
    distribution). One host read for the whole step."""
    targets = [r.prompt_token_ids[p + 1] for r, first, count in spans   # type: ignore[attr-defined]
               for p in range(first, first + count)]
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = lp.gather(1, index).squeeze(1).tolist()
    k = max(r.params.prompt_logprobs for r, _, _ in spans)   # type: ignore[attr-defined]
    top_lp: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if k > 0:
        top = lp.topk(min(k, lp.shape[1]), dim=-1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for r, first, count in spans:
        want = r.params.prompt_logprobs   # type: ignore[attr-defined]
        out[r.request_id] = [   # type: ignore[attr-defined]
            TokenLogprobs(targets[j], chosen[j], list(zip(top_ids[j][:want], top_lp[j][:want])))
            for j in range(row, row + count)]
        row += count
    return out
