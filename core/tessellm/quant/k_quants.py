"""GGML's K-quant super-blocks (Q4_K, Q5_K, Q6_K) and their torch dequantizers, which give
the values of the `gguf` package's (the reference).

A super-block holds 256 weights, in 8 sub-blocks of 32 (Q4_K, Q5_K) or 16 of 16 (Q6_K):
    Q4_K 144 B: fp16 d, fp16 dmin, scales[12] (6-bit sc and m of 8 sub-blocks), qs[128]
                w = (d * sc) * q - (dmin * m),  q = 4 bits
    Q5_K 176 B: as Q4_K, then qh[32] before qs: bit s of qh[l] is bit 4 of weight l of
                sub-block s
    Q6_K 210 B: ql[128], qh[64], int8 scales[16], fp16 d
                w = (d * sc) * (q - 32),  q = 6 bits
Q4_K/Q5_K: the 32 bytes qs[32c .. 32c + 31] hold sub-block 2c in their low nibbles and 2c + 1
in their high ones. Q6_K: in each half h of 128 weights (ql[64h ..], qh[32h ..]), weights
32i + l (i = 0..3, l < 32) take the low (i < 2) or high nibble of ql[64h + 32(i % 2) + l] and
bits 2i, 2i + 1 of qh[32h + l]. Sub-block scales are decoded by `scale_min_k4`.
"""
from __future__ import annotations

from typing import Callable

import torch

SUPER_BLOCK = 256


def f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 [..., 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of 8 sub-blocks from Q4_K/Q5_K's 12 bytes: bytes 0-3 hold
    sc 0-3 (low 6 bits) and the top 2 bits of sc 4-7, bytes 4-7 the same for the mins, bytes
    8-11 the low 4 bits of sc 4-7 (low nibble) and of m 4-7 (high nibble)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc.float(), mn.float()


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 128] -> 4-bit levels [..., 8, 32] in sub-block order."""
    chunks = qs.unflatten(-1, (4, 32))
    return torch.stack((chunks & 15, chunks >> 4), dim=-2).flatten(-3, -2)


def _with_mins(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    sc, mn = scale_min_k4(b[..., 4:16])
    d, dm = f16(b, 0) * sc, f16(b, 2) * mn
    return (d.unsqueeze(-1) * q.float() - dm.unsqueeze(-1)).flatten(-2)


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """Super-blocks [..., 144] -> weights [..., 256] (float32)."""
    return _with_mins(b, _low_high_nibbles(b[..., 16:144]))


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    """Super-blocks [..., 176] -> weights [..., 256] (float32)."""
    qh = b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).unsqueeze(-1)
    return _with_mins(b, _low_high_nibbles(b[..., 48:176]) | ((qh & 1) << 4))


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Super-blocks [..., 210] -> weights [..., 256] (float32)."""
    ql = b[..., 0:128].unflatten(-1, (2, 1, 64)) >> torch.tensor([[0], [4]], dtype=torch.uint8)
    ql = (ql & 15).flatten(-2).unflatten(-1, (4, 32))            # [..., half, 4, 32]
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32)) >> torch.tensor(
        [[0], [2], [4], [6]], dtype=torch.uint8)
    q = (ql | ((qh & 3) << 4)).to(torch.int16) - 32               # [..., half, 4, 32]
    d = f16(b, 208) * b[..., 192:208].view(torch.int8).float()    # [..., 16]
    return (d.unsqueeze(-1) * q.reshape(*b.shape[:-1], 16, 16).float()).flatten(-2)


DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}
