"""bfloat16 linear on Intel AMX tiles (native/linear_amx.c), called through ctypes.

The weight is packed once into the B-tile form (`prepare`, the kernel's WeightLayout: same
size as the plain weight, which the plan then drops); each call multiplies x's rows in groups
of 32 against strips of 32 output features with float32 sums, adds the bias in float32 and
rounds once, as the reference's bfloat16 linear does. Offered only where the build has AMX and
Linux grants this process the tile state; for bfloat16 weights whose two dimensions are
multiples of 32. A microbenchmark over weights out of cache runs it faster than oneDNN's
prepacked linear on W1's shapes; in the engine the gain is smaller, and past 128 rows oneDNN
is faster (docs/architecture.md has the figures).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tessellm.plugin_api import KernelQuery, WeightLayout
from tessellm_cpu.native_build import NativeBuildError, build_library, entry_point
from tessellm_cpu.native_team import TeamEntry, TeamKernelC

SOURCE = Path(__file__).with_name("native") / "linear_amx.c"
TILE = 32   # features per strip and inputs per tile step (linear_amx.c's STRIP, KBLOCK)
AMX_OK, AMX_ERR_SHAPE, AMX_ERR_ALLOC, AMX_ERR_UNAVAILABLE = 0, 1, 2, 3
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class AmxLinearArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("M", _i64), ("K", _i64), ("packed", _ptr), ("N", _i64),
                ("bias", _ptr), ("y", _ptr), ("threads", ctypes.c_int), ("scratch", _ptr)]


class NativeAmxLinear(TeamKernelC):
    """linear(x, packed, bias) with `packed` from `prepare`; `weight_layout` names that form."""

    def __init__(self) -> None:
        native = build_library(SOURCE)
        self.code_hash = native.key
        enable = entry_point(native, "amx_enable")
        enable.restype = ctypes.c_int
        if enable() != AMX_OK:
            raise NativeBuildError("no AMX here: the build's CPU flags lack AMX-BF16, or Linux "
                                   "refused this process the AMX tile state")
        self._pack = entry_point(native, "amx_pack_bf16")
        self._pack.argtypes, self._pack.restype = [_ptr, _i64, _i64, _ptr], ctypes.c_int
        self._entry = TeamEntry(native, "amx_linear_bf16", AmxLinearArgs, scratch=True)
        self.weight_layout = WeightLayout("amx_bf16_tiles", self.prepare)

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return (query.dtype is torch.bfloat16 and query.dim("in_features") % TILE == 0
                and query.dim("out_features") % TILE == 0)

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight [N, K] as [N / 32, K / 32, 2, 16, 32] B tiles (the same bytes)."""
        if weight.dim() != 2 or weight.dtype is not torch.bfloat16 or not weight.is_cpu:
            raise TypeError(f"AMX linear packs a 2-D bfloat16 CPU weight, got {weight.dtype} "
                            f"of shape {tuple(weight.shape)}")
        n, k = weight.shape
        if n % TILE or k % TILE:
            raise ValueError(f"AMX linear needs both weight dimensions to be multiples of "
                             f"{TILE}, got {n} x {k}")
        w = weight.contiguous()
        packed = torch.empty((n // TILE, k // TILE, 2, 16, TILE), dtype=torch.bfloat16)
        rc = self._pack(w.data_ptr(), n, k, packed.data_ptr())
        if rc != AMX_OK:
            raise ValueError(f"AMX linear could not pack a {n} x {k} weight (code {rc})")
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if packed.dim() != 5 or packed.dtype is not torch.bfloat16 or packed.shape[2:] != (
                2, 16, TILE):
            raise TypeError("AMX linear reads the weight in the form its prepare makes, got "
                            f"{packed.dtype} of shape {tuple(packed.shape)}")
        n, k = packed.shape[0] * TILE, packed.shape[1] * TILE
        if x.dtype is not torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            raise ValueError(f"AMX linear: x must be bfloat16 rows of {k} features on the CPU, "
                             f"got {x.dtype} of shape {tuple(x.shape)}")
        b = self._builder()
        if b is not None and not (x.is_contiguous() and (
                bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous()))):
            b.decline("AMX linear copies its input or bias")
            b = None
        x = x.contiguous()
        bb = None
        if bias is not None:
            bb = bias.to(torch.bfloat16).contiguous()
            if bb.numel() != n or not bb.is_cpu:
                raise ValueError(f"AMX linear: a bias of {bb.numel()} values for {n} output "
                                 "features (on the CPU)")
        out = self._empty(b, (x.shape[0], n), torch.bfloat16)
        args = AmxLinearArgs(x.data_ptr(), x.shape[0], k, packed.data_ptr(), n,
                             0 if bb is None else bb.data_ptr(), out.data_ptr(),
                             0 if b is None else b.threads, 0)

        def raise_error(rc: int) -> None:
            if rc == AMX_ERR_ALLOC:
                raise MemoryError("AMX linear could not allocate its padded row block")
            raise RuntimeError(f"AMX linear failed with code {rc}")
        return self._launch(b, self._entry, args, out, raise_error, "linear")
