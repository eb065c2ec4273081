"""Paged-attention decode as a C kernel (native/paged_attention.c), called through ctypes.

It reads K/V in place through the block tables: no gather copy, no padding, float32 math.
Supports float32 and bfloat16 caches on the CPU.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tessellm.plugin_api import AttentionMetadata, KernelQuery
from tessellm_cpu.native_build import build_library

SOURCE = Path(__file__).with_name("native") / "paged_attention.c"
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32]


class NativeDecode:
    """The loaded library's decode entry points, by dtype."""

    def __init__(self) -> None:
        lib = build_library(SOURCE)
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_f32"),
                            (torch.bfloat16, "paged_decode_bf16")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return query.dtype in (torch.float32, torch.bfloat16)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        fn = self._fns.get(q.dtype)
        if fn is None or kv_cache.dtype != q.dtype:
            raise TypeError(f"native decode supports float32/bfloat16, got {q.dtype} "
                            f"with a {kv_cache.dtype} cache")
        if not kv_cache.is_contiguous():
            raise ValueError("native decode needs a contiguous KV cache")
        q = q.contiguous()
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        _, num_blocks, num_kv_heads, block_size, head_dim = kv_cache.shape
        out = torch.empty_like(q)
        rc = fn(q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                seq_lens.data_ptr(), out.data_ptr(), meta.num_seqs, q.shape[1] // head_dim,
                num_kv_heads, head_dim, block_size, num_blocks, float(scale))
        if rc != 0:
            raise MemoryError("native decode could not allocate its scratch buffers")
        return out
