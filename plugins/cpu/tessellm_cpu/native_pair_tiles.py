"""The bfloat16 linears that read their weight in the pair-tile form (native/bf16_pair_tiles.h):
strips of 32 output features, blocks of 32 inputs, each block row one feature group's input
pairs. AMX tiles (native_amx) and AVX-512 BF16 dot products (native_bf16dot) read it alike;
this base packs the weight (`prepare`, the kernel's WeightLayout: the same bytes as the plain
weight, which the plan then drops), checks the arguments and launches the call, eagerly or as
a native-program node. Float32 sums, the bias added in float32, one rounding to bfloat16, as
the reference's bfloat16 linear does. For bfloat16 weights whose two dimensions are multiples
of 32.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tessellm.plugin_api import KernelQuery, WeightLayout
from tessellm_cpu.native_build import NativeLibrary, entry_point
from tessellm_cpu.native_team import TeamEntry, TeamKernelC

TILE = 32   # features per strip and inputs per block (bf16_pair_tiles.h)
NATIVE = Path(__file__).with_name("native")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PairTileLinearArgs(ctypes.Structure):
    """native/bf16_pair_tiles.h's PairTileLinearArgs (scratch: set by the launch where the
    kernel has a `<stem>_scratch`)."""
    _fields_ = [("x", _ptr), ("M", _i64), ("K", _i64), ("packed", _ptr), ("N", _i64),
                ("bias", _ptr), ("y", _ptr), ("threads", ctypes.c_int), ("scratch", _ptr)]


class PairTileLinear(TeamKernelC):
    """linear(x, packed, bias) with `packed` from `prepare`; `weight_layout` names that form.
    A subclass names its library's entry points: `pack` and the team kernel's `stem`, with a
    `<stem>_scratch` when `scratch`."""

    label = "pair-tile linear"
    layout_name = ""

    def __init__(self, native: NativeLibrary, pack: str, stem: str, scratch: bool) -> None:
        self.code_hash = native.key
        self._pack = entry_point(native, pack)
        self._pack.argtypes, self._pack.restype = [_ptr, _i64, _i64, _ptr], ctypes.c_int
        self._entry = TeamEntry(native, stem, PairTileLinearArgs, scratch=scratch)
        self.weight_layout = WeightLayout(self.layout_name, self.prepare)

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return (query.dtype is torch.bfloat16 and query.dim("in_features") % TILE == 0
                and query.dim("out_features") % TILE == 0)

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight [N, K] as [N / 32, K / 32, 2, 16, 32] pair tiles (the same bytes)."""
        if weight.dim() != 2 or weight.dtype is not torch.bfloat16 or not weight.is_cpu:
            raise TypeError(f"{self.label} packs a 2-D bfloat16 CPU weight, got {weight.dtype} "
                            f"of shape {tuple(weight.shape)}")
        n, k = weight.shape
        if n % TILE or k % TILE:
            raise ValueError(f"{self.label} needs both weight dimensions to be multiples of "
                             f"{TILE}, got {n} x {k}")
        w = weight.contiguous()
        packed = torch.empty((n // TILE, k // TILE, 2, 16, TILE), dtype=torch.bfloat16)
        rc = self._pack(w.data_ptr(), n, k, packed.data_ptr())
        if rc != 0:
            raise ValueError(f"{self.label} could not pack a {n} x {k} weight (code {rc})")
        return packed

    def _raise_error(self, rc: int) -> None:
        raise RuntimeError(f"{self.label} failed with code {rc}")

    def __call__(self, x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if packed.dim() != 5 or packed.dtype is not torch.bfloat16 or packed.shape[2:] != (
                2, 16, TILE):
            raise TypeError(f"{self.label} reads the weight in the form its prepare makes, "
                            f"got {packed.dtype} of shape {tuple(packed.shape)}")
        n, k = packed.shape[0] * TILE, packed.shape[1] * TILE
        if x.dtype is not torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            raise ValueError(f"{self.label}: x must be bfloat16 rows of {k} features on the "
                             f"CPU, got {x.dtype} of shape {tuple(x.shape)}")
        b = self._builder()
        if b is not None and not (x.is_contiguous() and (
                bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous()))):
            b.decline(f"{self.label} copies its input or bias")
            b = None
        x = x.contiguous()
        bb = None
        if bias is not None:
            bb = bias.to(torch.bfloat16).contiguous()
            if bb.numel() != n or not bb.is_cpu:
                raise ValueError(f"{self.label}: a bias of {bb.numel()} values for {n} "
                                 "output features (on the CPU)")
        out = self._empty(b, (x.shape[0], n), torch.bfloat16)
        args = PairTileLinearArgs(x.data_ptr(), x.shape[0], k, packed.data_ptr(), n,
                                  0 if bb is None else bb.data_ptr(), out.data_ptr(),
                                  0 if b is None else b.threads, 0)
        return self._launch(b, self._entry, args, out, self._raise_error, "linear")
