"""bfloat16 linear on Intel AMX tiles (native/linear_amx.c), called through ctypes.

It reads the pair-tile weight form (native_pair_tiles); each call multiplies x's rows in
groups of 32 against strips of 32 output features. Offered only where the build has AMX and
Linux grants this process the tile state. A microbenchmark over weights out of cache runs it
faster than oneDNN's prepacked linear on W1's shapes; in the engine the gain is smaller, and
past 128 rows oneDNN is faster (docs/architecture.md has the figures).
"""
from __future__ import annotations

import ctypes

from tessellm_cpu.native_build import NativeBuildError, build_library, entry_point
from tessellm_cpu.native_pair_tiles import NATIVE, PairTileLinear

SOURCE = NATIVE / "linear_amx.c"
AMX_OK, AMX_ERR_SHAPE, AMX_ERR_ALLOC, AMX_ERR_UNAVAILABLE = 0, 1, 2, 3


class NativeAmxLinear(PairTileLinear):
    """The pair-tile linear on AMX tiles (a zero-padded copy of the last partial row group
    and the many-rows path's sums in scratch)."""

    label = "AMX linear"
    layout_name = "amx_bf16_tiles"

    def __init__(self) -> None:
        native = build_library(SOURCE)
        enable = entry_point(native, "amx_enable")
        enable.restype = ctypes.c_int
        if enable() != AMX_OK:
            raise NativeBuildError("no AMX here: the build's CPU flags lack AMX-BF16, or Linux "
                                   "refused this process the AMX tile state")
        super().__init__(native, "amx_pack_bf16", "amx_linear_bf16", scratch=True)

    def _raise_error(self, rc: int) -> None:
        if rc == AMX_ERR_ALLOC:
            raise MemoryError("AMX linear could not allocate its padded row block")
        super()._raise_error(rc)
