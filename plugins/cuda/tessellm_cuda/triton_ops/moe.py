"""fused_moe over float stacked experts (kernels.reference_moe's layout and numerics): a step's
(token, expert) pairs grouped by expert into blocks of BLOCK_M rows, then two grouped GEMMs
over those blocks, so each expert's weights are read once per output tile and only by the
blocks of experts some token chose.

Pairs: pair p = t * top_k + j is token t's j-th choice (topk_ids' flat order), P = T * top_k.
Alignment (three launches, all on the device, no host read: CUDA-graph safe):
- `_count_kernel`, one program per CHUNK pairs: how many of its pairs chose each expert
  ([chunks, E] int32, no atomics);
- `_offsets_kernel`, one program: turns those counts into each chunk's exclusive prefix per
  expert, pads each expert's total up to a multiple of BLOCK_M, writes the experts' start rows,
  the owning expert of every block (-1 past the end) and the padded total
  (num_tokens_post_padded, one int32 on the device);
- `_scatter_kernel`, one program per chunk: each pair's row = its expert's start + the
  chunk's prefix + its rank among the chunk's earlier pairs of that expert, so the order
  within an expert is the pair order (stable, the same every run). Padding rows keep the
  sentinel P they were filled with.
Buffer sizes come from shapes alone: an expert nobody chose takes no rows and one that some
pair chose at most BLOCK_M - 1 of padding, so min(E, P) * (BLOCK_M - 1) + P rows bound the
padded layout (tighter than P + E * (BLOCK_M - 1) for decode steps, whose few pairs leave
most experts empty).
GEMMs, one program per (block of BLOCK_M rows, BLOCK_N output features); programs past the
padded total return at once:
- `_gate_up_kernel`: the block's rows of x (gathered by token) against its expert's gate rows
  and up rows of the same feature tile (two float32 accumulators), each rounded to the
  activation dtype as F.linear's output is, then silu(gate) * up with silu_and_mul's rounding
  points (sigmoid, gate * sigmoid, the product with up, each rounded); stored by pair;
- `_down_kernel`: those activations against the expert's down rows, rounded to the dtype,
  times the pair's routing weight in float32; stored by pair, float32;
- `_sum_kernel`, one program per tile of tokens x features: each token's top_k pair rows
  summed in float32 in slot order (no atomics: the same bits every run), cast to the
  activation dtype once.
Dots: IEEE float32 (no TF32) for float32 x and under Triton's interpreter (whose 16-bit tl.dot
is wrong: bfloat16 results off by orders of magnitude), 16-bit operands with float32
accumulation otherwise, as in attention.py.
Tiles: BLOCK_M 16 / 32 / 64 rows by pairs per expert (float32 at most 32: gate and up's two
64 x 64 float32 accumulators spill 40 bytes on sm_90 with 255 registers), 64 features, K in
steps of 32 (float32) or 64. Compiled for sm_90 and sm_80 with aot.compile_report at a
Qwen3-30B-A3B shape (H 2048, I 768, E 128, k 8; 1 and 2048 tokens): no spills, at most 222
registers, 72 KiB shared memory.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all
from .numerics import cast_to, round_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK = 128         # pairs per program of the count and scatter kernels
_RANK_SUB = 32      # the scatter kernel compares its pairs against 32 others at a time
_E_TILE = 32        # experts per step of the count kernel
_BLOCKS_TILE = 32   # blocks per step of the offsets kernel's expert-id pass
_BLOCK_N = 64       # output features per GEMM program
_SUM_TILE = 2048    # elements per program of the sum kernel


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, E_TILE: tl.constexpr):
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e_p = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    for e0 in range(0, E, E_TILE):
        e = e0 + tl.arange(0, E_TILE)
        n = tl.sum((e_p[:, None] == e[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + c * E + e, n, mask=e < E)


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, expert_ids_ptr, post_pad_ptr, n_chunks, E,
                    n_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                    BLOCKS_TILE: tl.constexpr):
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(0, n_chunks):      # counts -> each chunk's exclusive prefix per expert
        n = tl.load(counts_ptr + c * E + e, mask=e_ok, other=0)
        tl.store(counts_ptr + c * E + e, total, mask=e_ok)
        total += n
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + e, ends - padded, mask=e_ok)
    rows = tl.sum(padded, axis=0)
    tl.store(post_pad_ptr, rows)
    for b0 in range(0, n_blocks, BLOCKS_TILE):
        b = b0 + tl.arange(0, BLOCKS_TILE)
        first = b * BLOCK_M
        # the owner of block b: the number of experts whose rows end at or before its first
        # row (experts nobody chose end where the next one starts)
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(first < rows, owner, -1), mask=b < n_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, prefix_ptr, starts_ptr, sorted_ptr, P, E,
                    CHUNK: tl.constexpr, SUB: tl.constexpr):
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    p_ok = p < P
    e_p = tl.load(ids_ptr + p, mask=p_ok, other=-1).to(tl.int32)
    rank = tl.zeros([CHUNK], dtype=tl.int32)
    for q0 in tl.static_range(0, CHUNK, SUB):   # earlier pairs of the chunk, same expert
        q = c * CHUNK + q0 + tl.arange(0, SUB)
        e_q = tl.load(ids_ptr + q, mask=q < P, other=-1).to(tl.int32)
        same = (e_q[None, :] == e_p[:, None]) & (q[None, :] < p[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    e_safe = tl.where(p_ok, e_p, 0)
    row = (tl.load(starts_ptr + e_safe, mask=p_ok, other=0)
           + tl.load(prefix_ptr + c * E + e_safe, mask=p_ok, other=0) + rank)
    tl.store(sorted_ptr + row, p, mask=p_ok)


@triton.jit
def _block_rows(sorted_ptr, expert_ids_ptr, m, P, BLOCK_M: tl.constexpr):
    """(pair ids of block m's rows, which are real pairs, its expert as int64)."""
    pairs = tl.load(sorted_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pairs < P
    return tl.where(ok, pairs, 0).to(tl.int64), ok, tl.load(expert_ids_ptr + m).to(tl.int64)


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
                    P, H, I, top_k, stride_x, stride_w, stride_a,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP32_DOT: tl.constexpr):
    m = tl.program_id(0)
    if m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    pairs, row_ok, e = _block_rows(sorted_ptr, expert_ids_ptr, m, P, BLOCK_M)
    tokens = pairs // top_k
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    gate_rows = e * 2 * I + tl.where(n_ok, rn, 0).to(tl.int64)   # this expert's gate rows
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        a = tl.load(x_ptr + tokens[:, None] * stride_x + rk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_g = w_ptr + gate_rows[None, :] * stride_w + rk[:, None]          # [BLOCK_K, BLOCK_N]
        acc_g = _dot(a, tl.load(w_g, mask=w_mask, other=0.0), acc_g, FP32_DOT)
        acc_u = _dot(a, tl.load(w_g + I * stride_w, mask=w_mask, other=0.0), acc_u, FP32_DOT)
    ty = act_ptr.dtype.element_ty
    g = round_to(acc_g, ty)
    u = round_to(acc_u, ty)
    sig = round_to(1.0 / (1.0 + tl.exp(-g)), ty)
    h = cast_to(round_to(g * sig, ty) * u, ty)
    tl.store(act_ptr + pairs[:, None] * stride_a + rn[None, :], h,
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, topk_w_ptr, y_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
                 P, H, I, stride_a, stride_w, stride_y,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FP32_DOT: tl.constexpr):
    m = tl.program_id(0)
    if m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    pairs, row_ok, e = _block_rows(sorted_ptr, expert_ids_ptr, m, P, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    down_rows = e * H + tl.where(n_ok, rn, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < I
        a = tl.load(act_ptr + pairs[:, None] * stride_a + rk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + down_rows[None, :] * stride_w + rk[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, FP32_DOT)
    weight = tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0)
    y = round_to(acc, act_ptr.dtype.element_ty) * weight[:, None]
    tl.store(y_ptr + pairs[:, None] * stride_y + rn[None, :], y,
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(y_ptr, out_ptr, T, H, top_k, stride_y, stride_o,
                ROWS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (t < T)[:, None] & (h < H)[None, :]
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        acc += tl.load(y_ptr + (t * top_k + j)[:, None] * stride_y + h[None, :], mask=mask,
                       other=0.0)
    tl.store(out_ptr + t[:, None] * stride_o + h[None, :],
             cast_to(acc, out_ptr.dtype.element_ty), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in DTYPES


def block_m_for(pairs: int, experts: int) -> int:
    """Rows per block: the pairs an expert gets on average, rounded up to 16, 32 or 64 (tl.dot
    needs 16 at least; a decode step's few pairs per expert would waste most of a larger
    block on padding)."""
    per_expert = pairs / max(1, experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def padded_rows(pairs: int, experts: int, block_m: int) -> int:
    """An upper bound of num_tokens_post_padded from shapes alone (module docstring)."""
    return pairs + min(experts, pairs) * (block_m - 1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, H]: reference_moe.fused_moe (each token's experts' down(silu(gate) * up), weighted
    by topk_weights and summed in float32)."""
    out, launches = fused_moe_launches(x, w13, w2, topk_weights, topk_ids)
    run_all(launches)
    return out


def align_launches(topk_ids: torch.Tensor, num_experts: int, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Launch]]:
    """(sorted_ids, expert_ids, num_tokens_post_padded, launches): the pairs of topk_ids
    [T, k] grouped by expert into blocks of block_m rows once the launches have run (module
    docstring). sorted_ids int32 [n_blocks * block_m]: a pair id per row, P on padding rows;
    expert_ids int32 [n_blocks]: each block's expert, -1 past the padded total;
    num_tokens_post_padded int32 [1]. Shapes depend on T, k, E and block_m alone."""
    ids = topk_ids.reshape(-1).contiguous()
    P, E, dev = ids.shape[0], num_experts, topk_ids.device
    n_blocks = triton.cdiv(padded_rows(P, E, block_m), block_m)
    n_chunks = triton.cdiv(P, CHUNK)
    i32 = torch.int32
    counts = torch.empty((n_chunks, E), dtype=i32, device=dev)
    starts = torch.empty((E,), dtype=i32, device=dev)
    sorted_ids = torch.full((n_blocks * block_m,), P, dtype=i32, device=dev)
    expert_ids = torch.empty((n_blocks,), dtype=i32, device=dev)
    post_pad = torch.zeros((1,), dtype=i32, device=dev)
    if P == 0:
        return sorted_ids, expert_ids, post_pad, []
    launches = [
        Launch(_count_kernel, (n_chunks,), (ids, counts, P, E),
               dict(CHUNK=CHUNK, E_TILE=_E_TILE, num_warps=4)),
        Launch(_offsets_kernel, (1,), (counts, starts, expert_ids, post_pad, n_chunks, E,
                                       n_blocks),
               dict(BLOCK_M=block_m, E_PAD=triton.next_power_of_2(E),
                    BLOCKS_TILE=_BLOCKS_TILE, num_warps=4)),
        Launch(_scatter_kernel, (n_chunks,), (ids, counts, starts, sorted_ids, P, E),
               dict(CHUNK=CHUNK, SUB=_RANK_SUB, num_warps=4)),
    ]
    return sorted_ids, expert_ids, post_pad, launches


def fused_moe_launches(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor
                       ) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches of fused_moe, not run (the intermediate buffers are
    allocated here; the sorted ids filled with the padding sentinel)."""
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"the Triton fused_moe takes float32 / bfloat16 / float16 x and "
                        f"weights of x's dtype, got x {x.dtype}, w13 {w13.dtype}, "
                        f"w2 {w2.dtype}")
    T, H = x.shape
    inter = w2.shape[1]
    E = w2.shape[0] // H
    if w13.shape != (E * 2 * inter, H) or w2.shape[0] != E * H:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not "
                         f"[E * 2I, H] and [E * H, I] for H={H}")
    top_k = topk_ids.shape[1]
    dev = x.device
    out = torch.empty((T, H), dtype=x.dtype, device=dev)
    P = T * top_k
    if P == 0 or H == 0 or inter == 0:   # no pairs, or every expert's output empty / 0
        return out.zero_(), []
    xc = x if x.stride(-1) == 1 else x.contiguous()
    w13c, w2c = w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block_m = block_m_for(P, E)
    if x.dtype == torch.float32:   # two 64 x 64 float32 accumulators spill (ptxas, sm_90)
        block_m = min(block_m, 32)
    sorted_ids, expert_ids, post_pad, launches = align_launches(topk_ids, E, block_m)
    n_blocks = expert_ids.shape[0]
    act = torch.empty((P, inter), dtype=x.dtype, device=dev)
    y = torch.empty((P, H), dtype=torch.float32, device=dev)
    fp32_dot = x.dtype == torch.float32 or _interpreting()
    block_k = 32 if x.dtype == torch.float32 else 64
    gemm = dict(BLOCK_M=block_m, BLOCK_K=block_k, FP32_DOT=fp32_dot, num_warps=4)
    rows_args = (sorted_ids, expert_ids, post_pad)
    launches += [
        Launch(_gate_up_kernel, (n_blocks, triton.cdiv(inter, _BLOCK_N)),
               (xc, w13c, act, *rows_args, P, H, inter, top_k, xc.stride(0), w13c.stride(0),
                act.stride(0)),
               dict(BLOCK_N=_BLOCK_N, **gemm)),
        Launch(_down_kernel, (n_blocks, triton.cdiv(H, _BLOCK_N)),
               (act, w2c, weights, y, *rows_args, P, H, inter, act.stride(0), w2c.stride(0),
                y.stride(0)),
               dict(BLOCK_N=_BLOCK_N, **gemm)),
    ]
    block = min(triton.next_power_of_2(H), _SUM_TILE)
    sum_rows = min(triton.next_power_of_2(T), max(1, _SUM_TILE // block))
    launches.append(Launch(_sum_kernel, (triton.cdiv(T, sum_rows), triton.cdiv(H, block)),
                           (y, out, T, H, top_k, y.stride(0), out.stride(0)),
                           dict(ROWS=sum_rows, BLOCK=block, num_warps=4)))
    return out, launches

