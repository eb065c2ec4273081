"""lora_add with tessellm.kernels.reference_lora's semantics: out[t] = y[t] + (x[t] . A[s]^T)
. B[s] for the row's slot s = slots[t] >= 0, y[t] itself for s = -1. A [S, R, K] and
B [S, R, N] contiguous; x, y rows strided, features contiguous.

Two kernels: `_lora_shrink_kernel`, grid (rows, rank tiles of BLOCK_R): each program's
BLOCK_R dot products of its row with A's rows over K in BLOCK_K steps, float32, into a
float32 [T, R] buffer; `_lora_expand_kernel`, grid (rows, feature tiles of BLOCK_N): y's tile
plus the shrunk row times B's [R, BLOCK_N] tile, float32 sums, rounded once to y's dtype.
A base-model row (slot -1) reads no weight (its loads are masked, the slot clamped to 0 for
the addresses) and adds an exact 0. No host read: CUDA-graph safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all

_BLOCK_K = 128
_BLOCK_N = 128


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, shr_ptr, K, R, x_stride,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row)
    base = tl.maximum(slot, 0).to(tl.int64) * R * K
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = (ks < K) & ((ks * 0 + slot) >= 0)   # the slot test as a block mask
        x = tl.load(x_ptr + row * x_stride + ks, mask=in_k, other=0.0)
        a = tl.load(a_ptr + base + ranks[:, None] * K + ks[None, :],
                    mask=(ranks[:, None] < R) & in_k[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(shr_ptr + row * R + ranks, acc, mask=ranks < R)


@triton.jit
def _lora_expand_kernel(y_ptr, b_ptr, slots_ptr, shr_ptr, out_ptr, N, R, y_stride, out_stride,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row)
    base = tl.maximum(slot, 0).to(tl.int64) * R * N
    y = tl.load(y_ptr + row * y_stride + cols, mask=cols < N, other=0.0)
    acc = y.to(tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        in_r = (ranks < R) & ((ranks * 0 + slot) >= 0)   # the slot test as a block mask
        s = tl.load(shr_ptr + row * R + ranks, mask=in_r, other=0.0)
        b = tl.load(b_ptr + base + ranks[:, None] * N + cols[None, :],
                    mask=in_r[:, None] & (cols[None, :] < N), other=0.0)
        acc += tl.sum(s[:, None] * b.to(tl.float32), axis=0)
    tl.store(out_ptr + row * out_stride + cols, acc.to(y.dtype), mask=cols < N)


def _block_r(rank: int) -> int:
    return min(64, triton.next_power_of_2(max(rank, 1)))


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    out, launches = lora_add_launches(x, y, a, b, slots)
    run_all(launches)
    return out


def lora_add_launches(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      slots: torch.Tensor) -> tuple[torch.Tensor, list[Launch]]:
    """The output and the launches of lora_add, not run."""
    S, R, K = a.shape
    T, N = y.shape
    out = torch.empty_like(y)
    if T == 0:
        return out, []
    if x.stride(-1) != 1 or y.stride(-1) != 1 or not a.is_contiguous() \
            or not b.is_contiguous() or b.shape != (S, R, N):
        raise ValueError("lora_add needs rows with contiguous features and contiguous "
                         "A [S, R, K] and B [S, R, N]")
    shrunk = torch.empty((T, R), dtype=torch.float32, device=y.device)
    slots = slots if slots.is_contiguous() else slots.contiguous()
    block_r = _block_r(R)
    return out, [
        Launch(_lora_shrink_kernel, (T, triton.cdiv(R, block_r)),
               (x, a, slots, shrunk, K, R, x.stride(0)),
               dict(BLOCK_R=block_r, BLOCK_K=_BLOCK_K, num_warps=4)),
        Launch(_lora_expand_kernel, (T, triton.cdiv(N, _BLOCK_N)),
               (y, b, slots, shrunk, out, N, R, y.stride(0), out.stride(0)),
               dict(BLOCK_R=block_r, BLOCK_N=_BLOCK_N, num_warps=4)),
    ]
