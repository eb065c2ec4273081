"""Rounding helpers shared by the Triton kernels. float32 -> bfloat16 goes through integer
round-to-nearest-even on the bits rather than `.to(tl.bfloat16)`: on the GPU the two agree,
but Triton's interpreter truncates in that cast, so one code path is exact under both."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bf16_bits(x):
    """uint32 bits of float32 x rounded to nearest-even bfloat16 (low 16 bits zero; NaN stays
    a quiet NaN, overflow goes to inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, ((bits >> 16) << 16) | 0x400000, rounded)


@triton.jit
def round_to(x, ty: tl.constexpr):
    """float32 x rounded (nearest-even) to dtype ty, returned as float32."""
    if ty == tl.bfloat16:
        return _bf16_bits(x).to(tl.float32, bitcast=True)
    elif ty == tl.float32:
        return x
    else:
        return x.to(ty).to(tl.float32)


@triton.jit
def cast_to(x, ty: tl.constexpr):
    """x converted (nearest-even) to dtype ty."""
    if ty == x.dtype:
        return x
    elif ty == tl.bfloat16:
        return (_bf16_bits(x.to(tl.float32)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ty)
