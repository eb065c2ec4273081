"""Half-split (GPT-NeoX / HF) rotary embedding with reference.rotary_embedding's numerics.

Invariants: q, k are [num_tokens, heads * head_dim] with unit column stride and any row stride
(slices of a fused qkv output); they are only read, and new contiguous tensors come back.
cos_sin is [max_positions, head_dim] float32, cos then sin. Rounding follows the reference
exactly: cos and sin are rounded to q's dtype, each product is rounded to that dtype, then
their sum/difference is rounded, so in fp16/bf16 the result is bit-identical up to fp32 math.
One program per token, looping over its heads in tiles of [HEAD_BLOCK, padded head_dim / 2].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all
from .numerics import cast_to, round_to

_TILE = 2048  # elements of one half-head tile a program holds at once


@triton.jit
def _rope_heads(src_row, dst_row, n_heads, half, head_dim, c, s,
                HEAD_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    ty = dst_row.dtype.element_ty
    d = tl.arange(0, HALF_BLOCK)
    dm = d < half
    for h0 in range(0, n_heads, HEAD_BLOCK):
        heads = h0 + tl.arange(0, HEAD_BLOCK)
        m = (heads < n_heads)[:, None] & dm[None, :]
        off = heads[:, None] * head_dim + d[None, :]
        x1 = tl.load(src_row + off, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src_row + off + half, mask=m, other=0.0).to(tl.float32)
        o1 = round_to(x1 * c, ty) - round_to(x2 * s, ty)
        o2 = round_to(x2 * c, ty) + round_to(x1 * s, ty)
        tl.store(dst_row + off, cast_to(o1, ty), mask=m)
        tl.store(dst_row + off + half, cast_to(o2, ty), mask=m)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr, q_stride, k_stride, cs_stride,
                   n_q_heads, n_k_heads, half,
                   HEAD_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head_dim = 2 * half
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_BLOCK)
    dm = d < half
    ty = qo_ptr.dtype.element_ty
    c = round_to(tl.load(cs_ptr + pos * cs_stride + d, mask=dm, other=0.0).to(tl.float32), ty)
    s = round_to(tl.load(cs_ptr + pos * cs_stride + half + d, mask=dm, other=0.0).to(tl.float32),
                 ty)
    c = c[None, :]
    s = s[None, :]
    _rope_heads(q_ptr + t * q_stride, qo_ptr + t * (n_q_heads * head_dim), n_q_heads, half,
                head_dim, c, s, HEAD_BLOCK, HALF_BLOCK)
    _rope_heads(k_ptr + t * k_stride, ko_ptr + t * (n_k_heads * head_dim), n_k_heads, half,
                head_dim, c, s, HEAD_BLOCK, HALF_BLOCK)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.flatten(1) if t.dim() > 2 else t   # not reshape(T, -1): T may be 0
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q), rope(k)) at `positions` (reference.rotary_embedding); q and k share a dtype."""
    q_out, k_out, launches = rotary_launches(positions, q, k, cos_sin, head_dim)
    run_all(launches)
    return q_out, k_out


def rotary_launches(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    cos_sin: torch.Tensor, head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """(q_out, k_out, launches) of rotary_embedding, the launches not run."""
    if head_dim % 2 or cos_sin.shape[-1] != head_dim:
        raise ValueError(f"rotary: cos_sin width {cos_sin.shape[-1]} must equal the even "
                         f"head_dim {head_dim}")
    if q.dtype != k.dtype:
        raise ValueError(f"rotary: q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    q2, k2 = _rows(q), _rows(k)
    n_tokens = q2.shape[0]
    q_out = torch.empty((n_tokens, q2.shape[1]), dtype=q.dtype, device=q.device)
    k_out = torch.empty((k2.shape[0], k2.shape[1]), dtype=k.dtype, device=k.device)
    if n_tokens == 0:
        return q_out.view(q.shape), k_out.view(k.shape), []
    half = head_dim // 2
    cs = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    pos = positions.reshape(-1).contiguous()
    n_q, n_k = q2.shape[1] // head_dim, k2.shape[1] // head_dim
    half_block = triton.next_power_of_2(half)
    head_block = min(triton.next_power_of_2(max(n_q, n_k)), max(1, _TILE // half_block))
    launch = Launch(
        _rotary_kernel, (n_tokens,),
        (pos, q2, k2, cs, q_out, k_out, q2.stride(0), k2.stride(0), cs.stride(0), n_q, n_k,
         half),
        dict(HEAD_BLOCK=head_block, HALF_BLOCK=half_block,
             num_warps=4 if head_block * half_block <= 1024 else 8))
    return q_out.view(q.shape), k_out.view(k.shape), [launch]
