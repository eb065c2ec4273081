"""op linear_packed_q8act as a C kernel (native/linear_q8act.c, AVX-512 VNNI): the input's
32-value blocks rounded to int8, integer dot products against the packed GGUF blocks, read in
place (so a tied embedding and LM head still share one copy)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tessellm.plugin_api import KernelQuery, PackedWeight
from tessellm_cpu.native_build import build_library, entry_point

SOURCE = Path(__file__).with_name("native") / "linear_q8act.c"
SUPPORTED_TYPES = frozenset({2, 3, 8})  # GGML Q4_0, Q4_1, Q8_0
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class NativeQ8ActLinear:
    def __init__(self) -> None:
        native = build_library(SOURCE)
        self.code_hash = native.key   # the built code, for the profiler's cache
        self._fn = entry_point(native, "linear_q8act_f32")
        self._fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, ctypes.c_int, _ptr, _ptr]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return (query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dim("qtype") in SUPPORTED_TYPES)

    def __call__(self, x: torch.Tensor, weight: PackedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.format.ggml_type not in SUPPORTED_TYPES:
            raise TypeError(f"native q8act linear does not read {weight.format.name}")
        data = weight.data
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("native q8act linear needs contiguous packed rows on the CPU")
        n, k = weight.shape
        xf = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        if xf.dim() != 2 or xf.shape[-1] != k:
            raise ValueError(f"x of shape {tuple(x.shape)}, the weight expects [*, {k}]")
        bf = None if bias is None else bias.float().contiguous()
        out = torch.empty((xf.shape[0], n), dtype=torch.float32)
        rc = self._fn(xf.data_ptr(), xf.shape[0], k, data.data_ptr(), n,
                      weight.format.ggml_type, 0 if bf is None else bf.data_ptr(),
                      out.data_ptr())
        if rc == 2:
            raise MemoryError("native q8act linear could not allocate its scratch buffer")
        if rc != 0:
            raise ValueError(f"native q8act linear refused {weight.format.name} with K={k}")
        return out if x.dtype == torch.float32 else out.to(x.dtype)
