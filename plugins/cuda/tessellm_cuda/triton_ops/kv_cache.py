"""write_kv_cache: scatter each token's K and V rows into the paged KV cache, in place.

Invariants: kv_cache is [2, num_blocks, num_kv_heads, block_size, head_dim] (any strides but a
unit last one); slot s is row s % block_size of block s // block_size, for any block_size >= 1.
k, v are [num_tokens, num_kv_heads * head_dim] with unit column stride and any row stride.
A negative slot marks a padding token (CUDA-graph padded batches): nothing is read or written
for it. Values are cast to the cache dtype; nothing else in the cache changes.
One program per token, looping over its heads in [HEAD_BLOCK, padded head_dim] tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all
from .numerics import cast_to

_TILE = 2048


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_stride, v_stride, n_heads, head_dim,
                     block_size, s_kv, s_block, s_head, s_row,
                     HEAD_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr):
    ty = cache_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A padding token masks every column (the interpreter mishandles `vector & scalar_bool`).
    width = tl.where(slot >= 0, head_dim, 0)
    slot = tl.maximum(slot, 0)
    dst_row = cache_ptr + (slot // block_size) * s_block + (slot % block_size) * s_row
    d = tl.arange(0, DIM_BLOCK)
    dm = d < width
    for h0 in range(0, n_heads, HEAD_BLOCK):
        heads = h0 + tl.arange(0, HEAD_BLOCK)
        m = (heads < n_heads)[:, None] & dm[None, :]
        src = heads[:, None] * head_dim + d[None, :]
        dst = heads[:, None] * s_head + d[None, :]
        kk = tl.load(k_ptr + t * k_stride + src, mask=m, other=0.0)
        tl.store(dst_row + dst, cast_to(kk, ty), mask=m)
        vv = tl.load(v_ptr + t * v_stride + src, mask=m, other=0.0)
        tl.store(dst_row + s_kv + dst, cast_to(vv, ty), mask=m)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store each token's K and V at its slot (reference.write_kv_cache); slots < 0 skipped."""
    run_all(write_kv_cache_launches(k, v, kv_cache, slot_mapping))


def write_kv_cache_launches(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> list[Launch]:
    """The launch of write_kv_cache, not run."""
    _, _, n_heads, block_size, head_dim = kv_cache.shape
    if kv_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache: the cache's head_dim must be contiguous")
    k2, v2 = _rows(k, n_heads * head_dim), _rows(v, n_heads * head_dim)
    slots = slot_mapping.reshape(-1).contiguous()
    n_tokens = slots.numel()
    if k2.shape[0] != n_tokens or v2.shape[0] != n_tokens:
        raise ValueError(f"write_kv_cache: {n_tokens} slots for {k2.shape[0]} K and "
                         f"{v2.shape[0]} V rows")
    if n_tokens == 0:
        return []
    dim_block = triton.next_power_of_2(head_dim)
    head_block = min(triton.next_power_of_2(n_heads), max(1, _TILE // dim_block))
    s = kv_cache.stride()
    return [Launch(
        _write_kv_kernel, (n_tokens,),
        (k2, v2, kv_cache, slots, k2.stride(0), v2.stride(0), n_heads, head_dim, block_size,
         s[0], s[1], s[2], s[3]),
        dict(HEAD_BLOCK=head_block, DIM_BLOCK=dim_block,
             num_warps=4 if head_block * dim_block <= 1024 else 8))]
