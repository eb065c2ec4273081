"""linear_packed over GGML packed weights (tessellm.quant.formats: the legacy blocks Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0 and the K-quant super-blocks Q4_K, Q5_K, Q6_K), the weights
dequantized in registers from the packed bytes, never expanded in memory.

`_dequant_tile` turns a [BLOCK_N, SUB_K] tile (weights k0.. of one block; a block is the
format's 32 or 256 weights) into float32 with the reference's arithmetic: each weight's byte,
nibble or bits and its block's scales are found by index arithmetic (the layouts of
formats.py / k_quants.py), fp16 scales assembled from their two bytes. Two kernels, as the row
count asks:
- GEMV (decode, M <= 8): one program per (row of x, BLOCK_N output features), a dot product
  per feature over each whole block (tl.sum);
- GEMM (prefill): one program per (BLOCK_M rows, BLOCK_N features), tl.dot in IEEE float32
  over slices of GEMM_SUB_K weights.
Output: float32 accumulations, then the bias, cast to x's dtype as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.quant.formats import PACKED_FORMATS, PackedWeight

from .launch import Launch, run_all

# every GGML type id tessellm keeps packed; `_dequant_tile` branches on them (the ids are
# literals there: a Triton constexpr cannot read a Python dict)
SUPPORTED_TYPES = frozenset(PACKED_FORMATS)
GEMV_MAX_ROWS = 8
# The GEMM dequantizes K-quant super-blocks (256 weights) in slices of this many (a legacy
# block's size), in one flat loop: for float32 x a whole [32, 256] tile spills ~8 KB per
# thread (ptxas, sm_80 and sm_90), slices of 64 or 8 unrolled slices still spill, flat slices
# of 32 do not (tests/cuda/test_triton_aot.py).
GEMM_SUB_K = 32


@triton.jit
def _u8(ptr, offs):
    return tl.load(ptr + offs).to(tl.int32)


@triton.jit
def _f16(ptr, offs):
    """The fp16 at byte offsets `offs` (little-endian), as float32."""
    bits = (_u8(ptr, offs) | (_u8(ptr, offs + 1) << 8)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(w_ptr, rn, kb, k0, row_bytes, n_mask, QTYPE: tl.constexpr,
                  SUB_K: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Weights [len(rn), SUB_K]: those k0 .. k0 + SUB_K - 1 of block kb of rows rn (rows
    past N: 0)."""
    base = rn.to(tl.int64)[:, None] * row_bytes + kb * BLOCK_BYTES      # [BN, 1]
    base = tl.where(n_mask[:, None], base, 0)
    kk = (k0 + tl.arange(0, SUB_K))[None, :]
    if QTYPE == 8:      # Q8_0: d, int8 q[32]
        q = _u8(w_ptr, base + 2 + kk).to(tl.int8).to(tl.float32)
        w = _f16(w_ptr, base) * q
    elif QTYPE == 2 or QTYPE == 3:   # Q4_0 / Q4_1: d (m), nibbles
        QS: tl.constexpr = 2 if QTYPE == 2 else 4
        q = ((_u8(w_ptr, base + QS + kk % 16) >> (4 * (kk // 16))) & 15).to(tl.float32)
        if QTYPE == 2:
            w = _f16(w_ptr, base) * (q - 8.0)
        else:
            w = _f16(w_ptr, base) * q + _f16(w_ptr, base + 2)
    elif QTYPE == 6 or QTYPE == 7:   # Q5_0 / Q5_1: d (m), u32 qh, nibbles
        QH: tl.constexpr = 2 if QTYPE == 6 else 4
        nib = (_u8(w_ptr, base + QH + 4 + kk % 16) >> (4 * (kk // 16))) & 15
        hb = (_u8(w_ptr, base + QH + kk // 8) >> (kk % 8)) & 1
        q = (nib | (hb << 4)).to(tl.float32)
        if QTYPE == 6:
            w = _f16(w_ptr, base) * (q - 16.0)
        else:
            w = _f16(w_ptr, base) * q + _f16(w_ptr, base + 2)
    elif QTYPE == 12 or QTYPE == 13:   # Q4_K / Q5_K: d, dmin, 6-bit scales, (qh), nibbles
        c = kk // 32
        low = c < 4
        a = _u8(w_ptr, base + 4 + tl.where(low, c, c + 4))          # sc 0-3 / low bits 4-7
        b = _u8(w_ptr, base + 4 + tl.where(low, c + 4, c - 4))      # m 0-3 / top bits of sc
        e = _u8(w_ptr, base + 4 + tl.where(low, c + 4, c))          # (m 0-3) / top bits of m
        sc = tl.where(low, a & 63, (a & 15) | ((b >> 6) << 4))
        mn = tl.where(low, b & 63, (a >> 4) | ((e >> 6) << 4))
        QS: tl.constexpr = 16 if QTYPE == 12 else 48
        q = (_u8(w_ptr, base + QS + 32 * (c // 2) + kk % 32) >> (4 * (c % 2))) & 15
        if QTYPE == 13:
            q = q | (((_u8(w_ptr, base + 16 + kk % 32) >> c) & 1) << 4)
        d = _f16(w_ptr, base) * sc.to(tl.float32)
        dm = _f16(w_ptr, base + 2) * mn.to(tl.float32)
        w = d * q.to(tl.float32) - dm
    else:               # Q6_K: ql[128], qh[64], int8 scales[16], d
        h = kk // 128
        i = (kk % 128) // 32
        l = kk % 32
        ql = (_u8(w_ptr, base + 64 * h + 32 * (i % 2) + l) >> (4 * (i // 2))) & 15
        qh = (_u8(w_ptr, base + 128 + 32 * h + l) >> (2 * i)) & 3
        q = ((ql | (qh << 4)) - 32).to(tl.float32)
        sc = _u8(w_ptr, base + 192 + kk // 16).to(tl.int8).to(tl.float32)
        w = (_f16(w_ptr, base + 208) * sc) * q
    return tl.where(n_mask[:, None], w, 0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, row_bytes, stride_x, stride_o,
                 QTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        x = tl.load(x_ptr + m * stride_x + kb * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
        w = _dequant_tile(w_ptr, rn, kb, 0, row_bytes, n_mask, QTYPE, BLOCK_K, BLOCK_BYTES)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_o + rn, acc, mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, row_bytes, stride_x, stride_o,
                 QTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for ks in range(0, K // SUB_K):   # one flat loop over slices, not unrolled per block
        kb = ks // (BLOCK_K // SUB_K)
        k0 = (ks % (BLOCK_K // SUB_K)) * SUB_K
        rk = ks * SUB_K + tl.arange(0, SUB_K)
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_x + rk[None, :],
                    mask=m_mask[:, None], other=0.0).to(tl.float32)
        w = _dequant_tile(w_ptr, rn, kb, k0, row_bytes, n_mask, QTYPE, SUB_K, BLOCK_BYTES)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_o + rn[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


def supports_qtype(qtype: int) -> bool:
    return qtype in SUPPORTED_TYPES


def linear_packed(x: torch.Tensor, weight: PackedWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for a PackedWeight W [N, K] on x's device."""
    out, launches = linear_packed_launches(x, weight, bias)
    run_all(launches)
    return out.to(x.dtype)


def linear_packed_launches(x: torch.Tensor, weight: PackedWeight,
                           bias: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, list[Launch]]:
    """The float32 output tensor and the launch of linear_packed, not run (the op casts the
    output to x's dtype after it)."""
    fmt = weight.format
    if fmt.ggml_type not in SUPPORTED_TYPES:
        raise TypeError(f"the Triton linear_packed does not read {fmt.name}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"linear_packed: x of shape {tuple(x.shape)}, the weight expects {k} "
                         "features")
    m = x.shape[0]
    xc = x if x.stride(-1) == 1 else x.contiguous()
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if not (m and n):
        return out, []
    common = dict(QTYPE=fmt.ggml_type, BLOCK_K=fmt.block_weights,
                  BLOCK_BYTES=fmt.block_bytes, HAS_BIAS=bias is not None)
    b = bias if bias is not None else out
    row = data.shape[1]
    if m <= GEMV_MAX_ROWS:
        block_n = 16 if fmt.block_weights == 256 else 64
        return out, [Launch(
            _gemv_kernel, (m, triton.cdiv(n, block_n)),
            (xc, data, b, out, n, k, row, xc.stride(0), out.stride(0)),
            dict(BLOCK_N=block_n, num_warps=4, **common))]
    block_m, block_n = 32, 32
    return out, [Launch(
        _gemm_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        (xc, data, b, out, m, n, k, row, xc.stride(0), out.stride(0)),
        dict(BLOCK_M=block_m, BLOCK_N=block_n, SUB_K=min(fmt.block_weights, GEMM_SUB_K),
             num_warps=4, **common))]
