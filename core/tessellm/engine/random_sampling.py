"""Random sampling of a step's rows: the exponential race's noise (seeded rows from their own
generator, so a seed means the same draws on any device and in any batch) and the call of the
`sample_tokens` op (the reference, or the device's kernel). Contract: engine/sampler.py."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tessellm.kernels import reference
from tessellm.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# (rows, vocab) -> a function with reference.sample_tokens' six positional arguments
SelectSampleKernel = Callable[[int, int], Callable[..., torch.Tensor]]


def row_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position).

    `seed * 1_000_003 + position` is finished with the splitmix64 mixer, so nearby seeds and
    positions give unrelated generator states (torch's CPU generator only reads the low 32 bits).
    """
    z = (seed * 1_000_003 + position + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


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
