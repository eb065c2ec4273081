"""Packed weight formats (GGML's Q8_0, Q4_0, Q4_1) and their torch (de)quantizers.

Layout (as in GGUF files, so a file's tensors are used in place): a weight [N, K] is stored
row by row; each row is K / 32 blocks of 32 consecutive weights, and a block is
    Q8_0  34 bytes: fp16 d, int8 q[32]                     w = d * q
    Q4_0  18 bytes: fp16 d, uint8 qs[16]                   w = d * (q - 8)
    Q4_1  20 bytes: fp16 d, fp16 m, uint8 qs[16]           w = d * q + m
where for the 4-bit formats weight j < 16 of a block is the low nibble of qs[j] and weight
j + 16 its high nibble. Rows are whole blocks, so a packed tensor [N, row_bytes] can be
concatenated, split and permuted along rows exactly like a dense one.

The quantizers follow ggml's reference rounding (round half away from zero for Q8_0, truncation
after +8.5 / +0.5 for the 4-bit formats), so they reproduce llama.cpp's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tessellm.errors import ModelLoadError

BLOCK = 32


@dataclass(frozen=True, slots=True)
class PackedFormat:
    name: str
    ggml_type: int      # the GGML type id (stable in the GGUF spec); a KernelQuery dim
    block_bytes: int


Q4_0 = PackedFormat("Q4_0", 2, 18)
Q4_1 = PackedFormat("Q4_1", 3, 20)
Q8_0 = PackedFormat("Q8_0", 8, 34)
PACKED_FORMATS: dict[int, PackedFormat] = {f.ggml_type: f for f in (Q4_0, Q4_1, Q8_0)}
FORMATS_BY_NAME: dict[str, PackedFormat] = {f.name.lower(): f for f in PACKED_FORMATS.values()}


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

    `data` is uint8 [out_features, in_features // 32 * block_bytes] (contiguous rows);
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
        if self.in_features % BLOCK or self.data.shape[1] != row_bytes(self.format, self.in_features):
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
    return in_features // BLOCK * fmt.block_bytes


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("only packed weights of one format and width can be concatenated")
    return first.with_data(torch.cat([p.data for p in parts], dim=0))


def _blocks(w: PackedWeight) -> torch.Tensor:
    n, k = w.shape
    return w.data.reshape(n, k // BLOCK, w.format.block_bytes)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def dequantize(w: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [out_features, in_features] weight (float32 math, then `dtype`)."""
    b = _blocks(w)
    if w.format is Q8_0:
        dense = _f16(b, 0) * b[..., 2:].contiguous().view(torch.int8).float()
    elif w.format is Q4_0:
        dense = _f16(b, 0) * (_nibbles(b[..., 2:]) - 8.0)
    elif w.format is Q4_1:
        dense = _f16(b, 0) * _nibbles(b[..., 4:]) + _f16(b, 2)
    else:
        raise ValueError(f"no dequantizer for {w.format.name}")
    return dense.reshape(w.shape).to(dtype or w.compute_dtype)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


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
    else:
        raise ValueError(f"no quantizer for {fmt.name}")
    data = torch.cat([p.reshape(n, k // BLOCK, -1) for p in parts], dim=-1).reshape(n, -1)
    return PackedWeight(data, fmt, k, compute_dtype or weight.dtype)
