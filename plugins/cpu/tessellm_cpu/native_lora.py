"""lora_add in C (native/lora.c): every row's low-rank term in one team call, so a decode
step's LoRA sites are nodes of its native program. Float32 or bfloat16 activations with
weights (the slot tables) of the same dtype; rows with slot -1 are copied from y."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tessellm.plugin_api import KernelQuery
from tessellm_cpu.native_build import build_library
from tessellm_cpu.native_team import TeamEntry, TeamKernelC, rows_view

SOURCE = Path(__file__).with_name("native") / "lora.c"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class LoraAddArgs(ctypes.Structure):
    """lora.c's LoraAddArgs."""
    _fields_ = [("x", _ptr), ("y", _ptr), ("a", _ptr), ("b", _ptr), ("slots", _ptr),
                ("out", _ptr), ("T", _i64), ("K", _i64), ("N", _i64), ("S", _i64),
                ("R", _i64), ("ldx", _i64), ("ldy", _i64), ("ldo", _i64),
                ("dtype", ctypes.c_int), ("scratch", _ptr)]


class NativeLoRAAdd(TeamKernelC):
    def __init__(self) -> None:
        native = build_library(SOURCE)
        self.code_hash = native.key
        self._entry = TeamEntry(native, "lora_add", LoraAddArgs, scratch=True)

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return query.dtype in DTYPES

    def __call__(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        S, R, K = a.shape
        N = b.shape[2]
        builder = self._builder()
        xr, yr = rows_view(x), rows_view(y)
        ready = (xr is not None and yr is not None and x.dtype in DTYPES
                 and {y.dtype, a.dtype, b.dtype} == {x.dtype} and a.is_contiguous()
                 and b.is_contiguous() and slots.dtype is torch.int64 and slots.is_contiguous()
                 and xr.shape[1] == K and yr.shape[1] == N and b.shape[:2] == (S, R))
        if not ready:
            raise ValueError(f"native lora_add takes contiguous float32/bfloat16 rows with "
                             f"weights of their dtype, got x {x.dtype} {tuple(x.shape)}, y "
                             f"{y.dtype}, a {a.dtype} {tuple(a.shape)}, b {b.dtype} "
                             f"{tuple(b.shape)}, slots {slots.dtype}")
        T = xr.shape[0]
        out = self._empty(builder, y.shape, y.dtype)
        args = LoraAddArgs(xr.data_ptr(), yr.data_ptr(), a.data_ptr(), b.data_ptr(),
                           slots.data_ptr(), out.data_ptr(), T, K, N, S, R, xr.stride(0),
                           yr.stride(0), N, DTYPES[x.dtype], None)

        def raise_error(rc: int) -> None:
            if rc == 1:
                raise ValueError(f"native lora_add: a slot outside [-1, {S})")
            raise MemoryError("native lora_add could not allocate its scratch")
        return self._launch(builder, self._entry, args, out, raise_error, "lora_add",
                            keep=(slots,))
