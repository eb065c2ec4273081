"""Paged attention in Triton: a decode kernel (one query token per sequence, flash-decoding
split of the context with a reduction kernel) and a varlen causal prefill kernel.

Both have the signature of `reference.paged_attention(q, kv_cache, meta, scale) -> out` and
follow `AttentionMetadata`'s batch layout and KV cache contract:
- q: [num_tokens, num_heads * head_dim], any row stride; out: a new contiguous tensor like q.
- kv_cache: [2, num_blocks, num_kv_heads, block_size, head_dim] (K then V), any strides.
- Sequence i's position p lives at slot p % block_size of block block_tables[i, p // block_size];
  positions >= seq_lens[i] (the tail of the last block, table padding) are never valid: their
  scores are -inf and their loads are masked.
Numerics: scores, online softmax and accumulation in float32; the result is cast to q's dtype.
Dot operands are float32 (IEEE precision) for float32 inputs and under Triton's interpreter
(TRITON_INTERPRET=1, whose 16-bit tl.dot is inaccurate); otherwise the 16-bit K/V and the
probabilities cast to K/V's dtype feed tensor cores (mma / wgmma): that path never runs in
the interpreter, so scripts/gpu_accuracy.py measures it against the float32 reference on a
GPU first (bound: 4x the error of torch's reference in the same 16-bit dtype). exp2 is
approximate on a GPU (ex2.approx), a few float32 ulps.
Every tile is padded to a power of two (tl.arange) and to >= 16 (tl.dot) and masked, so any
block_size >= 1 and head_dim <= 256 work.
Both take the reference's sliding_window (the decode reads only the window's keys; the
prefill starts at its first row's first visible key and masks per row) and logit_softcap
(cap * tanh(s / cap) on the float32 scores, tanh from exp2; the launch then passes the bare
scale and log2(e) is applied after the cap); both are constexpr switches, so the plain
kernels compile as before.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tessellm.plugin_api import AttentionMetadata, KernelQuery

from .launch import Launch, run_all

__all__ = ["decode_launches", "paged_attention_decode", "paged_attention_prefill",
           "prefill_launches", "prefill_tiles", "supports"]

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(query: KernelQuery) -> bool:
    """True when both kernels handle the query's shapes: a supported dtype, head_dim <= 256 and
    num_heads a multiple of num_kv_heads (any block_size)."""
    dims = dict(query.dims)
    hd, nh, nkv = dims.get("head_dim"), dims.get("num_heads"), dims.get("num_kv_heads")
    if query.dtype not in _DTYPES or hd is None or not 0 < hd <= MAX_HEAD_DIM:
        return False
    if nh is not None and nkv is not None and (nkv <= 0 or nh % nkv):
        return False
    return dims.get("block_size", 1) >= 1


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


def _shapes(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, group) after checking q against the cache."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, blocks, kv_heads, block_size, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    if q.dim() != 2 or q.shape[1] % head_dim:
        raise ValueError(f"q must be [tokens, heads * {head_dim}], got {tuple(q.shape)}")
    num_heads = q.shape[1] // head_dim
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    return num_heads, num_kv_heads, head_dim, num_heads // num_kv_heads


@triton.jit
def _kv_tile(kv_head_ptr, bt_row_ptr, pos, valid, offs_d, d_mask, block_size,
             stride_kv, stride_kb, stride_ks, stride_kd):
    """K and V rows [BLOCK_N, BLOCK_D] of positions `pos` (zero where not `valid`), gathered
    through the block table row."""
    blk = tl.load(bt_row_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
    row = blk * stride_kb + (pos % block_size).to(tl.int64) * stride_ks
    ptrs = kv_head_ptr + row[:, None] + offs_d[None, :] * stride_kd
    mask = valid[:, None] & d_mask[None, :]
    k = tl.load(ptrs, mask=mask, other=0.0)
    v = tl.load(ptrs + stride_kv, mask=mask, other=0.0)
    return k, v


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter and every target have it): sign(x) (1 - t) / (1 + t)
    with t = exp(-2|x|) <= 1, so nothing overflows."""
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, softcap, FP32_DOT: tl.constexpr,
                 SOFTCAP: tl.constexpr, GUARD: tl.constexpr):
    """One online-softmax step (base-2, scores pre-scaled by log2(e)) over a K/V tile. Without
    GUARD, rows of q whose every score so far is masked must not occur (each caller's first
    tile holds a valid key for every row); GUARD (a window's prefill rows) allows them. With
    SOFTCAP, qk_scale is the bare scale: s = cap tanh(s scale / cap), then times log2(e)."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = softcap * _tanh(s * qk_scale / softcap) * 1.4426950408889634
    else:
        s = s * qk_scale
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:   # a row with nothing visible yet: keep its sums at 0 (no -inf - -inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
                   stride_qt, stride_qd, stride_kv, stride_kb, stride_kh, stride_ks, stride_kd,
                   stride_bt, stride_ot, qk_scale, block_size, window, softcap,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   FP32_DOT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program (seq, kv_head, split): the GROUP query heads of kv_head over split `split` of
    the sequence's context, whose length is read on the device. With NUM_SPLITS == 1 it writes
    the output; otherwise the split's (max, sum) in base 2 and unnormalized accumulator."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    hd_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt
                + (heads[:, None] * HEAD_DIM + offs_d[None, :]) * stride_qd,
                mask=hd_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    if WINDOW:   # the window's keys: seq_len - window .. seq_len - 1
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    if NUM_SPLITS == 1:
        lo = first
        hi = seq_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * split_len
        hi = tl.minimum(lo + split_len, seq_len)

    kv_head_ptr = kv_ptr + kvh.to(tl.int64) * stride_kh
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = _kv_tile(kv_head_ptr, bt_row_ptr, pos, valid, offs_d, d_mask, block_size,
                        stride_kv, stride_kb, stride_ks, stride_kd)
        m_i, l_i, acc = _attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                     softcap, FP32_DOT, SOFTCAP, False)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * HEAD_DIM
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        # partials: ml [seqs, heads, NUM_SPLITS, 2], acc [seqs, heads, NUM_SPLITS, BLOCK_D]
        row = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_mask)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc,
                 mask=h_mask[:, None])


@triton.jit
def _decode_reduce_kernel(part_ml_ptr, part_acc_ptr, out_ptr, stride_ot,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr):
    """Program (seq, head): merges the NUM_SPLITS partial softmaxes of one query head.
    Empty splits (max -inf, sum 0) weigh 0; a sequence with no context gets zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2)
    l_s = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :])
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * HEAD_DIM + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                    stride_qt, stride_qd, stride_kv, stride_kb, stride_kh, stride_ks, stride_kd,
                    stride_bt, stride_ot, qk_scale, block_size, window, softcap,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
                    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program (m_block, seq, head): query rows m_block*BLOCK_M.. of sequence `seq` (at
    positions seq_len - query_len + row) for one head, causal over the paged K/V. Blocks past
    the sequence's query_len (the grid covers the batch's longest) exit at once."""
    mb = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    md_mask = m_mask[:, None] & d_mask[None, :]
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt
                + (head * HEAD_DIM + offs_d[None, :]) * stride_qd, mask=md_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = ctx_len + offs_m  # rows past q_len see every key < seq_len: finite, not stored

    kv_head_ptr = kv_ptr + (head // GROUP).to(tl.int64) * stride_kh
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(seq_len, ctx_len + (mb + 1) * BLOCK_M)  # last key of the block's rows + 1
    if WINDOW:   # from the block's first row's first visible key
        lo = tl.maximum(ctx_len + mb * BLOCK_M - window + 1, 0)
    else:
        lo = 0
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = _kv_tile(kv_head_ptr, bt_row_ptr, pos, valid, offs_d, d_mask, block_size,
                        stride_kv, stride_kb, stride_ks, stride_kd)
        s_mask = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            s_mask = s_mask & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, softcap,
                                     FP32_DOT, SOFTCAP, WINDOW)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=md_mask)


def _decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """Context splits per (sequence, kv head): a power of two <= 16 that brings the grid to
    about 128 programs while every split keeps >= 256 slots of the table's capacity. A fixed
    function of shapes only, so a captured CUDA graph stays valid for any seq_lens."""
    programs = max(1, num_seqs * num_kv_heads)
    splits = 1
    while splits < 16 and programs * splits < 128 and max_context >= splits * 2 * 256:
        splits *= 2
    return splits


def _features(scale: float, sliding_window: int, logit_softcap: float
              ) -> tuple[float, int, float, bool, bool]:
    """(qk_scale, window, softcap, WINDOW, SOFTCAP) of a launch (see _attend_tile)."""
    window, softcap = max(0, int(sliding_window)), max(0.0, float(logit_softcap))
    qk_scale = scale if softcap > 0 else scale * _LOG2E
    return qk_scale, window, softcap, window > 0, softcap > 0


def decode_launches(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, num_splits: int | None = None, sliding_window: int = 0,
                    logit_softcap: float = 0.0) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches of paged_attention_decode, not run; num_splits a
    power of two (None: the shape heuristic)."""
    if meta.num_prefills:
        raise ValueError("paged_attention_decode got prefill sequences (use decode_part())")
    num_heads, num_kv_heads, head_dim, group = _shapes(q, kv_cache)
    num_seqs = q.shape[0]
    out = torch.empty((num_seqs, num_heads * head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out, []
    block_size = kv_cache.shape[3]
    bt = meta.block_tables
    if num_splits is None:
        num_splits = _decode_num_splits(num_seqs, num_kv_heads, bt.shape[1] * block_size)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    block_d = _pow2(head_dim, 16)
    block_h = _pow2(group, 16)
    block_n = 32 if block_d <= 128 else 16
    fp32_dot = _interpreting() or q.dtype == torch.float32
    if num_splits > 1:
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32,
                              device=q.device)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32,
                               device=q.device)
    else:
        part_ml = part_acc = out  # unused
    qk_scale, window, softcap, has_window, has_softcap = _features(scale, sliding_window,
                                                                   logit_softcap)
    launches = [Launch(
        _decode_kernel, (num_seqs, num_kv_heads, num_splits),
        (q, kv_cache, bt, meta.seq_lens, out, part_ml, part_acc,
         q.stride(0), q.stride(1), *kv_cache.stride(),
         bt.stride(0), out.stride(0), qk_scale, block_size, window, softcap),
        dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
             BLOCK_N=block_n, NUM_SPLITS=num_splits, FP32_DOT=fp32_dot, WINDOW=has_window,
             SOFTCAP=has_softcap, num_warps=4))]
    if num_splits > 1:
        launches.append(Launch(
            _decode_reduce_kernel, (num_seqs, num_heads),
            (part_ml, part_acc, out, out.stride(0)),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, num_warps=4)))
    return out, launches


def _paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, num_splits: int | None = None,
                            sliding_window: int = 0, logit_softcap: float = 0.0
                            ) -> torch.Tensor:
    """paged_attention_decode with an explicit split count (a power of two; None: the
    shape heuristic)."""
    out, launches = decode_launches(q, kv_cache, meta, scale, num_splits, sliding_window,
                                    logit_softcap)
    run_all(launches)
    return out


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, sliding_window: int = 0,
                           logit_softcap: float = 0.0) -> torch.Tensor:
    """Decode attention: row i of q is sequence i's single query token (meta.num_prefills ==
    0). Lengths are read on the device (meta.seq_lens) and the grid depends only on the
    shapes of q, kv_cache and meta.block_tables, so the launch is CUDA-graph safe; host-side
    lengths are not used. Grid (seq, kv_head, split), each program covering all query heads
    of its kv head; a reduction kernel merges the splits when there are several."""
    return _paged_attention_decode(q, kv_cache, meta, scale, None, sliding_window,
                                   logit_softcap)


def prefill_tiles(head_dim: int, dtype: torch.dtype, max_query_len: int
                  ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) of the prefill kernel. 16-bit inputs take 64-row query
    tiles (32 past head_dim 128) on tensor cores; float32, whose dot keeps fp32 operands,
    takes 16-row tiles: 64 rows spill kilobytes per thread there (ptxas, sm_80 and sm_90,
    head_dim >= 64), 16 rows fit in 80-103 registers (at most an 8-byte spill: Triton 3.6,
    sm_90, head_dim 128; tests/cuda/test_triton_aot.py prints the figures)."""
    block_d = _pow2(head_dim, 16)
    if dtype == torch.float32:
        block_m = 16
    else:
        block_m = 64 if block_d <= 128 else 32
    block_m = min(block_m, _pow2(max_query_len, 16))
    block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    return block_m, block_n, block_d


def prefill_launches(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, sliding_window: int = 0, logit_softcap: float = 0.0
                     ) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launch of paged_attention_prefill, not run."""
    if meta.num_decodes:
        raise ValueError("paged_attention_prefill got decode sequences (use prefill_part())")
    num_heads, num_kv_heads, head_dim, group = _shapes(q, kv_cache)
    out = torch.empty((q.shape[0], num_heads * head_dim), dtype=q.dtype, device=q.device)
    num_seqs = meta.query_start_loc.shape[0] - 1
    if q.shape[0] == 0 or num_seqs <= 0 or meta.max_query_len <= 0:
        return out, []
    block_size = kv_cache.shape[3]
    bt = meta.block_tables
    block_m, block_n, block_d = prefill_tiles(head_dim, q.dtype, meta.max_query_len)
    fp32_dot = _interpreting() or q.dtype == torch.float32
    grid = (triton.cdiv(meta.max_query_len, block_m), num_seqs, num_heads)
    qk_scale, window, softcap, has_window, has_softcap = _features(scale, sliding_window,
                                                                   logit_softcap)
    return out, [Launch(
        _prefill_kernel, grid,
        (q, kv_cache, bt, meta.seq_lens, meta.query_start_loc, out,
         q.stride(0), q.stride(1), *kv_cache.stride(),
         bt.stride(0), out.stride(0), qk_scale, block_size, window, softcap),
        dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d,
             BLOCK_N=block_n, FP32_DOT=fp32_dot, WINDOW=has_window, SOFTCAP=has_softcap,
             num_warps=4,
             num_stages=2 if block_d > 128 else 3))]


def paged_attention_prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, sliding_window: int = 0,
                            logit_softcap: float = 0.0) -> torch.Tensor:
    """Varlen causal prefill (meta.num_decodes == 0): sequence i's query rows are
    q[query_start_loc[i]:query_start_loc[i+1]] at its last query_len positions, attending to
    every cached position up to their own. The grid's m-block count comes from the host's
    meta.max_query_len; lengths and offsets are read on the device."""
    out, launches = prefill_launches(q, kv_cache, meta, scale, sliding_window, logit_softcap)
    run_all(launches)
    return out
