"""Packed weight formats (GGML's legacy Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K,
Q5_K, Q6_K) and their torch (de)quantizers.

Layout (as in GGUF files, so a file's tensors are used in place): a weight [N, K] is stored
row by row; each row is K / block_weights blocks of consecutive weights. A legacy block holds
32 weights:
    Q8_0  34 bytes: fp16 d, int8 q[32]                     w = d * q
    Q4_0  18 bytes: fp16 d, uint8 qs[16]                   w = d * (q - 8)
    Q4_1  20 bytes: fp16 d, fp16 m, uint8 qs[16]           w = d * q + m
    Q5_0  22 bytes: fp16 d, u32 qh, uint8 qs[16]           w = d * (q - 16)
    Q5_1  24 bytes: fp16 d, fp16 m, u32 qh, uint8 qs[16]   w = d * q + m
where weight j < 16 of a block is the low nibble of qs[j] and weight j + 16 its high nibble
(Q5: plus bit j of qh times 16). A K-quant block is a super-block of 256 weights with
per-sub-block scales (tessellm.quant.k_quants). Rows are whole blocks, so a packed tensor
[N, row_bytes] can be concatenated, split and permuted along rows exactly like a dense one.

The quantizers follow ggml's reference rounding (round half away from zero for Q8_0, truncation
after +8.5 / +16.5 / +0.5 for the 4- and 5-bit formats), so they reproduce llama.cpp's bytes.
K-quants have no quantizer here (ggml's searches them; tessellm runs such files as stored);
`random_packed` makes valid blocks of any format for kernels' tests and profiling.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tessellm.errors import ModelLoadError
from tessellm.quant import k_quants

BLOCK = 32


@dataclass(frozen=True, slots=True)
class PackedFormat:
    name: str
    ggml_type: int      # the GGML type id (stable in the GGUF spec); a KernelQuery dim
    block_bytes: int
    block_weights: int = BLOCK   # weights per block: 32, or 256 for a K-quant super-block


Q4_0 = PackedFormat("Q4_0", 2, 18)
Q4_1 = PackedFormat("Q4_1", 3, 20)
Q5_0 = PackedFormat("Q5_0", 6, 22)
Q5_1 = PackedFormat("Q5_1", 7, 24)
Q8_0 = PackedFormat("Q8_0", 8, 34)
Q4_K = PackedFormat("Q4_K", 12, 144, k_quants.SUPER_BLOCK)
Q5_K = PackedFormat("Q5_K", 13, 176, k_quants.SUPER_BLOCK)
Q6_K = PackedFormat("Q6_K", 14, 210, k_quants.SUPER_BLOCK)
PACKED_FORMATS: dict[int, PackedFormat] = {
    f.ggml_type: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)}
FORMATS_BY_NAME: dict[str, PackedFormat] = {f.name.lower(): f for f in PACKED_FORMATS.values()}
# formats `quantize` writes (byte-identical to ggml's reference quantizers)
QUANTIZABLE: tuple[PackedFormat, ...] = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)


def packed_format(ggml_type: int) -> PackedFormat:
    try:
        return PACKED_FORMATS[ggml_type]
    except KeyError:
        raise ModelLoadError(f"GGML type {ggml_type} is not a packed format tessellm executes "
                             f"(packed: {', '.join(f.name for f in PACKED_FORMATS.values())})"
                             ) from None


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear/embedding weight [out_features, in_features] kept in a packed format.

    `data` is uint8 [out_features, in_features // block_weights * block_bytes] (contiguous
    rows);
    `compute_dtype` is the dtype the weight computes in (an embedding's output dtype).
    """

    data: torch.Tensor
    format: PackedFormat
    in_features: int
    compute_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"packed data must be a 2-D uint8 tensor, got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if (self.in_features % self.format.block_weights
                or self.data.shape[1] != row_bytes(self.format, self.in_features)):
            raise ValueError(f"{self.format.name} rows of {self.in_features} weights need "
                             f"{row_bytes(self.format, self.in_features)} bytes, data has "
                             f"{self.data.shape[1]}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def with_data(self, data: torch.Tensor) -> PackedWeight:
        return replace(self, data=data)

    def rows(self, index: torch.Tensor) -> PackedWeight:
        return replace(self, data=self.data.index_select(0, index))


def row_bytes(fmt: PackedFormat, in_features: int) -> int:
    return in_features // fmt.block_weights * fmt.block_bytes


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("only packed weights of one format and width can be concatenated")
    return first.with_data(torch.cat([p.data for p in parts], dim=0))


def _blocks(w: PackedWeight) -> torch.Tensor:
    n, k = w.shape
    return w.data.reshape(n, k // w.format.block_weights, w.format.block_bytes)


_f16 = k_quants.f16


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Bit j of the little-endian u32 `qh` (bytes [..., 4]) for j = 0..31, as 0 / 16."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return (bits.flatten(-2) << 4).float()


def _q5_levels(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    return _nibbles(blocks[..., qh_at + 4:]) + _fifth_bits(blocks[..., qh_at:qh_at + 4])


def dequantize(w: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [out_features, in_features] weight (float32 math, then `dtype`)."""
    b = _blocks(w)
    if w.format is Q8_0:
        dense = _f16(b, 0) * b[..., 2:].contiguous().view(torch.int8).float()
    elif w.format is Q4_0:
        dense = _f16(b, 0) * (_nibbles(b[..., 2:]) - 8.0)
    elif w.format is Q4_1:
        dense = _f16(b, 0) * _nibbles(b[..., 4:]) + _f16(b, 2)
    elif w.format is Q5_0:
        dense = _f16(b, 0) * (_q5_levels(b, 2) - 16.0)
    elif w.format is Q5_1:
        dense = _f16(b, 0) * _q5_levels(b, 4) + _f16(b, 2)
    elif w.format.name in k_quants.DEQUANTIZERS:
        dense = k_quants.DEQUANTIZERS[w.format.name](b)
    else:
        raise ValueError(f"no dequantizer for {w.format.name}")
    return dense.reshape(w.shape).to(dtype or w.compute_dtype)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _packed_nibbles(q: torch.Tensor) -> torch.Tensor:
    """qs[16] of 32 levels: weights j and j + 16 as the low and high nibbles of byte j."""
    return (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)


def _fifth_bit_bytes(q: torch.Tensor) -> torch.Tensor:
    """The u32 qh (4 bytes, little-endian) whose bit j is bit 4 of level j."""
    bits = ((q >> 4) & 1).reshape(*q.shape[:-1], 4, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def quantize(weight: torch.Tensor, fmt: PackedFormat,
             compute_dtype: torch.dtype | None = None) -> PackedWeight:
    """Pack a dense [N, K] weight (K a multiple of 32) in `fmt`, as ggml's reference does."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"{fmt.name} needs a 2-D weight whose width is a multiple of {BLOCK}, "
                         f"got {tuple(weight.shape)}")
    n, k = weight.shape
    x = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt is Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = _round_half_away(x * inv).to(torch.int8)
        parts = [_as_bytes(d.half()), _as_bytes(q)]
    elif fmt is Q4_0:
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(x * inv + 8.5), max=15).to(torch.uint8)
        parts = [_as_bytes(d.half()), q[..., :16] | (q[..., 16:] << 4)]
    elif fmt is Q4_1:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc((x - lo) * inv + 0.5), max=15).to(torch.uint8)
        parts = [_as_bytes(d.half()), _as_bytes(lo.half()), q[..., :16] | (q[..., 16:] << 4)]
    elif fmt is Q5_0:
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -16.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(x * inv + 16.5), max=31).to(torch.uint8)
        parts = [_as_bytes(d.half()), _fifth_bit_bytes(q), _packed_nibbles(q)]
    elif fmt is Q5_1:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 31.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc((x - lo) * inv + 0.5), max=31).to(torch.uint8)
        parts = [_as_bytes(d.half()), _as_bytes(lo.half()), _fifth_bit_bytes(q),
                 _packed_nibbles(q)]
    else:
        raise ValueError(f"no quantizer for {fmt.name}: K-quant files run as llama.cpp wrote "
                         f"them (quantizers: {', '.join(f.name for f in QUANTIZABLE)})")
    data = torch.cat([p.reshape(n, k // BLOCK, -1) for p in parts], dim=-1).reshape(n, -1)
    return PackedWeight(data, fmt, k, compute_dtype or weight.dtype)


def random_packed(fmt: PackedFormat, out_features: int, in_features: int,
                  generator: torch.Generator, *, scale: float = 0.1,
                  compute_dtype: torch.dtype = torch.float32) -> PackedWeight:
    """A weight of valid random blocks (random quants, finite scales, |w| about `scale` at
    most): for kernel tests and profiling of formats without a quantizer."""
    if in_features % fmt.block_weights:
        raise ValueError(f"{fmt.name} rows hold multiples of {fmt.block_weights} weights, "
                         f"not {in_features}")
    nb = in_features // fmt.block_weights
    data = torch.randint(0, 256, (out_features, nb, fmt.block_bytes), dtype=torch.uint8,
                         generator=generator)
    # each fp16 field: (byte offset, largest level it multiplies)
    fields = {"Q8_0": [(0, 127)], "Q4_0": [(0, 8)], "Q4_1": [(0, 15), (2, 1)],
              "Q5_0": [(0, 16)], "Q5_1": [(0, 31), (2, 1)],
              "Q4_K": [(0, 15 * 63), (2, 63)], "Q5_K": [(0, 31 * 63), (2, 63)],
              "Q6_K": [(208, 32 * 128)]}[fmt.name]
    for offset, levels in fields:
        value = (torch.rand((out_features, nb, 1), generator=generator) * 2 - 1) * scale / levels
        data[..., offset:offset + 2] = value.half().view(torch.uint8)
    return PackedWeight(data.reshape(out_features, -1), fmt, in_features, compute_dtype)


def packed_example(fmt: PackedFormat, out_features: int, in_features: int,
                   generator: torch.Generator, *, scale: float = 1.0,
                   compute_dtype: torch.dtype = torch.float32) -> PackedWeight:
    """A packed weight for kernel tests and profiling: seeded normal weights times `scale`,
    quantized, where `fmt` has a quantizer; valid random blocks (random_packed, |w| up to
    about 3 * scale) where it has none."""
    if fmt in QUANTIZABLE:
        dense = torch.randn((out_features, in_features), generator=generator) * scale
        return quantize(dense, fmt, compute_dtype)
    return random_packed(fmt, out_features, in_features, generator, scale=3 * scale,
                         compute_dtype=compute_dtype)
