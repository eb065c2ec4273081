"""RMSNorm kernels, plain and fused with the residual add, with reference.rms_norm's numerics.

Invariants: rows are the last dim (any leading dims flattened); the sum of squares, the mean
and rsqrt run in float32; the normalized value is rounded to the (summed) input dtype and only
then multiplied by the weight, that product rounded once to the output dtype
(promote(weight, input)), as `weight * xf.to(x.dtype)` does in torch. The fused op rounds
x + residual to promote(x, residual) before normalizing it. Inputs are never modified.
The sum's order differs from torch's, and on a GPU `tl.rsqrt` and the mean's division are
approximate (rsqrt.approx, div.full), so a result may differ from the reference by one unit
in the last place of a 16-bit dtype, a few ulps in float32 (scripts/gpu_accuracy.py).
Rows up to _MAX_SINGLE_BLOCK wide (padded to a power of two) stay in registers, several small
rows per program; wider rows take two passes over chunks of _LOOP_BLOCK.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all
from .numerics import cast_to, round_to

_MAX_SINGLE_BLOCK = 8192
_LOOP_BLOCK = 4096
_TILE = 1024  # elements a program handles at least, by packing rows when rows are short


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_rows, n_cols,
                     x_stride, res_stride, out_stride, sum_stride, eps,
                     HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     SINGLE: tl.constexpr):
    # sum_ptr's element type is the normalized value's dtype (the caller passes x when there
    # is no residual; nothing is stored through it then).
    norm_ty = sum_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    if SINGLE:
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        col_mask = cols < n_cols
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            x = round_to(x + r, norm_ty)
            tl.store(sum_ptr + rows[:, None] * sum_stride + cols[None, :], cast_to(x, norm_ty),
                     mask=mask)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        n = round_to(x * inv[:, None], norm_ty)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
                 cast_to(n * w[None, :], out_ty), mask=mask)
    else:
        # One row per program, two passes; the second recomputes the rounded sum rather than
        # reading back what this program stored.
        x_row = x_ptr + pid * x_stride
        r_row = res_ptr + pid * res_stride
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < n_cols
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=m, other=0.0).to(tl.float32)
                x = round_to(x + r, norm_ty)
                tl.store(sum_ptr + pid * sum_stride + cols, cast_to(x, norm_ty), mask=m)
            acc += x * x
        inv = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < n_cols
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=m, other=0.0).to(tl.float32)
                x = round_to(x + r, norm_ty)
            n = round_to(x * inv, norm_ty)
            w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + pid * out_stride + cols, cast_to(n * w, out_ty), mask=m)


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """t as [rows, h] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, h)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_launches(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, max_block: int = _MAX_SINGLE_BLOCK,
                      loop_block: int = _LOOP_BLOCK
                      ) -> tuple[torch.Tensor, torch.Tensor | None, list[Launch]]:
    """(out, summed or None, launches) of rms_norm (residual None) or fused_add_rms_norm,
    the launches not run."""
    h = x.shape[-1]
    x2 = _rows(x, h)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype),
                      device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows == 0 or h == 0:
        return out, summed, []
    w = weight.reshape(-1).contiguous()
    r2 = x2 if residual is None else _rows(residual, h)
    o2 = out.view(-1, h)
    s2 = x2 if summed is None else summed.view(-1, h)
    block = triton.next_power_of_2(h)
    if block <= max_block:
        rows = min(triton.next_power_of_2(n_rows), max(1, _TILE // block))
        single = True
    else:
        block, rows, single = loop_block, 1, False
    tile = rows * block
    num_warps = 4 if tile <= 1024 else 8 if tile <= 4096 else 16
    grid = (triton.cdiv(n_rows, rows),)
    return out, summed, [Launch(
        _rms_norm_kernel, grid,
        (x2, r2, w, o2, s2, n_rows, h, x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0),
         float(eps)),
        dict(HAS_RES=residual is not None, ROWS=rows, BLOCK=block, SINGLE=single,
             num_warps=num_warps))]


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            max_block: int = _MAX_SINGLE_BLOCK, loop_block: int = _LOOP_BLOCK
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    out, summed, launches = rms_norm_launches(x, residual, weight, eps, max_block, loop_block)
    run_all(launches)
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normalize(x) over the last dim (reference.rms_norm)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass (reference.fused_add_rms_norm);
    x and residual have the same shape."""
    out, summed = _launch(x, residual, weight, eps)
    return out, summed
