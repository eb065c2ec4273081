"""The C float32 linear for few rows (native/linear_f32.c, op linear) as a team kernel: the
small dense linears of quantized models (a MoE router) as native-program nodes."""
from __future__ import annotations

import ctypes

import torch

from tessellm.plugin_api import KernelQuery
from tessellm_cpu.native_build import build_library
from tessellm_cpu.native_linear import NATIVE
from tessellm_cpu.native_team import TeamEntry, TeamKernelC

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class LinearF32Args(ctypes.Structure):
    _fields_ = [("x", _ptr), ("M", _i64), ("K", _i64), ("w", _ptr), ("N", _i64),
                ("bias", _ptr), ("out", _ptr)]


class NativeLinearF32(TeamKernelC):
    """linear(x, weight, bias) for float32 and up to `max_tokens` rows."""

    max_tokens = 16

    def __init__(self) -> None:
        native = build_library(NATIVE / "linear_f32.c")
        self.code_hash = native.key
        self._entry = TeamEntry(native, "linear_f32", LinearF32Args)

    def supports(self, query: KernelQuery) -> bool:
        return query.dtype == torch.float32 and query.num_tokens <= self.max_tokens

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype is not torch.float32 or weight.dtype is not torch.float32 or (
                bias is not None and bias.dtype is not torch.float32):
            raise TypeError("native linear_f32 reads float32 x, weight and bias")
        if x.dim() != 2 or x.shape[1] != weight.shape[1] or not x.is_cpu:
            raise ValueError(f"native linear_f32: x {tuple(x.shape)}, weight "
                             f"{tuple(weight.shape)}")
        b = self._builder()
        ready = x.is_contiguous() and weight.is_contiguous() and (
            bias is None or bias.is_contiguous())
        if b is not None and not ready:
            b.decline("linear_f32 would copy its input or weight")
            b = None
        xc, wc = x.contiguous(), weight.contiguous()
        bc = None if bias is None else bias.contiguous()
        M, K = xc.shape
        N = wc.shape[0]
        out = self._empty(b, (M, N), torch.float32)
        args = LinearF32Args(xc.data_ptr(), M, K, wc.data_ptr(), N,
                             0 if bc is None else bc.data_ptr(), out.data_ptr())

        def raise_error(rc: int) -> None:
            raise ValueError(f"native linear_f32 refused x {tuple(x.shape)}")
        return self._launch(b, self._entry, args, out, raise_error, "linear",
                            keep=(xc, wc, bc))
