"""bfloat16 linear on AVX-512 BF16 dot products (native/linear_bf16dot.c), for CPUs without
AMX that have VDPBF16PS (AMD Zen 4 and later, Intel Cooper Lake). It reads the pair-tile
weight form (native_pair_tiles) a row tile of 8 rows against a strip of 32 features at a
time, asking for the next strip while it computes; 9..24 rows (two or three tiles) take each
strip in 8 KiB chunks so the later tiles read it from L1. Offered where the build has AVX-512 BF16;
on Zen 4 it beats oneDNN's prepacked linear at decode's row counts with the weights out of
cache, and the profiler picks per bucket (docs/architecture.md has the figures).
"""
from __future__ import annotations

import ctypes

from tessellm_cpu.native_build import NativeBuildError, build_library, entry_point
from tessellm_cpu.native_pair_tiles import NATIVE, PairTileLinear

SOURCE = NATIVE / "linear_bf16dot.c"

class NativeBf16DotLinear(PairTileLinear):
    """The pair-tile linear on VDPBF16PS (no scratch, no barrier)."""

    label = "AVX-512 BF16 linear"
    layout_name = "bf16dot_pair_tiles"

    def __init__(self) -> None:
        native = build_library(SOURCE)
        available = entry_point(native, "bf16dot_available")
        available.restype = ctypes.c_int
        if available() != 0:
            raise NativeBuildError("no AVX-512 BF16 here: the build's CPU flags lack "
                                   "avx512_bf16")
        super().__init__(native, "bf16dot_pack", "bf16dot_linear", scratch=False)
