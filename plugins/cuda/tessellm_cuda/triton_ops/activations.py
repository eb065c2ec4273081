"""silu_and_mul with reference.silu_and_mul's numerics.

Invariants: x is [..., 2 * d] (any leading dims; rows may be strided when x is 2-D), the result
a new contiguous [..., d] of x's dtype. Rounding follows the reference's torch ops: sigmoid(a)
is rounded to x's dtype, a * sigmoid(a) is rounded, then the product with b is rounded (each
computed in float32). Bit-identical to the reference under Triton's interpreter; on a GPU
`tl.exp` and the division are approximate (ex2.approx, div.full: a few float32 ulps), so a
16-bit result may differ by one unit in its last place on some elements, a float32 one by a
few ulps (scripts/gpu_accuracy.py measures both). Grid: (row tiles, column tiles) of
[ROWS, BLOCK].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all
from .numerics import cast_to, round_to

_MAX_BLOCK = 1024
_TILE = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_rows, d, x_stride, out_stride,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    ty = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    src = x_ptr + rows[:, None] * x_stride + cols[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    sig = round_to(1.0 / (1.0 + tl.exp(-a)), ty)
    u = round_to(a * sig, ty)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], cast_to(u * b, ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dim (reference.silu_and_mul)."""
    out, launches = silu_and_mul_launches(x)
    run_all(launches)
    return out


def silu_and_mul_launches(x: torch.Tensor) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launch of silu_and_mul, not run."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    if n_rows == 0 or d == 0:
        return out, []
    block = min(triton.next_power_of_2(d), _MAX_BLOCK)
    rows = min(triton.next_power_of_2(n_rows), max(1, _TILE // block))
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(d, block))
    return out, [Launch(_silu_and_mul_kernel, grid,
                        (x2, out.view(-1, d), n_rows, d, x2.stride(0), d),
                        dict(ROWS=rows, BLOCK=block, num_warps=4))]
