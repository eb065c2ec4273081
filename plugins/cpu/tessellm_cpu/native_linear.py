"""Linears over packed GGML weights as C kernels called through ctypes: the packed rows are
read in place, activations in float32. Both kernels share one C signature, so one wrapper
serves them:
- `NativePackedLinear` (native/linear_packed.c, op linear_packed): float32 dot products over
  the legacy blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the K-quants (Q4_K, Q5_K, Q6_K);
- `NativeQ8ActLinear` (native/linear_q8act.c, op linear_packed_q8act): each 32-value input
  block rounded to int8 first, then AVX-512 VNNI integer dot products (the same types);
- `NativeQ8ActAmxLinear` (native/linear_q8act_amx.c, the same op): the same rounding, the
  weights decoded per call into AMX B tiles, 16 x 16 x 32 integer tile products (prefill);
- `NativePackedAmxLinear` (native/linear_packed_amx.c, op linear_packed): float32 x split into
  three bfloat16 parts against the weights' integer levels on AMX bf16 tiles, exact to
  float32 rounding (prefill).
`NativePackedEmbedding` (linear_packed.c too, op embedding_packed) dequantizes the rows it
reads."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tessellm.plugin_api import KernelQuery, PackedWeight
from tessellm_cpu.native_build import NativeBuildError, build_library, entry_point

NATIVE = Path(__file__).with_name("native")
# GGML Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
FLOAT_ACTIVATION_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
INT8_ACTIVATION_TYPES = FLOAT_ACTIVATION_TYPES
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _PackedLinearC:
    """`entry`(x, M, K, w, N, qtype, bias, out) -> 0, 1 (bad format or K), 2 (no memory),
    3 (unavailable here) of the C file `source` for the GGML types `types`, offered for
    `min_tokens` up to `max_tokens` rows of x (None: any)."""

    source: Path
    entry: str
    types: frozenset[int]
    min_tokens = 1
    max_tokens: int | None = None

    def __init__(self) -> None:
        native = build_library(self.source)
        self.code_hash = native.key   # the built code, for the profiler's cache
        self._fn = entry_point(native, self.entry)
        self._fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, ctypes.c_int, _ptr, _ptr]
        self._fn.restype = ctypes.c_int

    def supports(self, query: KernelQuery) -> bool:
        return (query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dim("qtype") in self.types
                and query.num_tokens >= self.min_tokens
                and (self.max_tokens is None or query.num_tokens <= self.max_tokens))

    def __call__(self, x: torch.Tensor, weight: PackedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        qtype = weight.format.ggml_type
        if qtype not in self.types:
            raise TypeError(f"native {self.entry} does not read {weight.format.name}")
        data = weight.data
        if not (data.is_cpu and data.is_contiguous()):
            raise ValueError(f"native {self.entry} needs contiguous packed rows on the CPU")
        n, k = data.shape[0], weight.in_features
        xf = x.contiguous() if x.dtype is torch.float32 else x.float().contiguous()
        if xf.dim() != 2 or xf.shape[1] != k or not xf.is_cpu:
            raise ValueError(f"native {self.entry}: x of shape {tuple(x.shape)} (rows of "
                             f"features on the CPU), the weight expects {k} features")
        bf = None if bias is None else bias.float().contiguous()
        if bf is not None and (bf.numel() != n or not bf.is_cpu):
            raise ValueError(f"native {self.entry}: a bias of {bf.numel()} values for {n} "
                             "output features (on the CPU)")
        out = xf.new_empty((xf.shape[0], n))
        rc = self._fn(xf.data_ptr(), xf.shape[0], k, data.data_ptr(), n, qtype,
                      0 if bf is None else bf.data_ptr(), out.data_ptr())
        if rc == 2:
            raise MemoryError(f"native {self.entry} could not allocate its scratch buffer")
        if rc == 3:
            raise RuntimeError(f"native {self.entry}: Linux refused this process the AMX tile "
                               "state")
        if rc != 0:
            raise ValueError(f"native {self.entry} refused {weight.format.name} with K={k}")
        return out if x.dtype is torch.float32 else out.to(x.dtype)


class NativePackedLinear(_PackedLinearC):
    source, entry, types = NATIVE / "linear_packed.c", "linear_packed_f32", FLOAT_ACTIVATION_TYPES
    # It decodes each block once per tile of 4 rows in float32 FMAs, so past a hundred or so
    # rows dequantize-then-GEMM (oneDNN) wins (measured on SmolLM2's Q4_1 linears).
    max_tokens = 256


class NativeQ8ActLinear(_PackedLinearC):
    source, entry, types = NATIVE / "linear_q8act.c", "linear_q8act_f32", INT8_ACTIVATION_TYPES


class _AmxPackedLinearC(_PackedLinearC):
    """A packed linear on AMX tiles: offered where this process gets the tile state, from 16
    rows (decoding a strip of weights into tiles costs about one 16-row tile's work, so it
    pays from tens of rows, prefill; a decode step stays with the row kernels)."""

    min_tokens = 16

    def __init__(self) -> None:
        super().__init__()
        enable = entry_point(build_library(self.source), "amx_enable")
        enable.restype = ctypes.c_int
        if enable() != 0:
            raise NativeBuildError("Linux refused this process the AMX tile state")


class NativeQ8ActAmxLinear(_AmxPackedLinearC):
    source, entry, types = NATIVE / "linear_q8act_amx.c", "linear_q8act_amx_f32", INT8_ACTIVATION_TYPES


class NativePackedAmxLinear(_AmxPackedLinearC):
    source, entry, types = NATIVE / "linear_packed_amx.c", "linear_packed_amx_f32", FLOAT_ACTIVATION_TYPES


class NativePackedEmbedding:
    """embedding_packed(ids, weight): the ids' rows dequantized to float32 in C (the reference
    dequantizes with a dozen torch ops per call), then cast to the weight's compute dtype as
    the reference does."""

    def __init__(self) -> None:
        native = build_library(NATIVE / "linear_packed.c")
        self.code_hash = native.key
        self._fn = entry_point(native, "embedding_packed_f32")
        self._fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_int, _ptr]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return (query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dim("qtype") in FLOAT_ACTIVATION_TYPES)

    def __call__(self, ids: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        qtype = weight.format.ggml_type
        if qtype not in FLOAT_ACTIVATION_TYPES:
            raise TypeError(f"native embedding_packed does not read {weight.format.name}")
        data = weight.data
        if not (data.is_cpu and data.is_contiguous() and ids.is_cpu):
            raise ValueError("native embedding_packed needs contiguous packed rows and ids on "
                             "the CPU")
        flat = ids.reshape(-1)
        flat = flat if flat.dtype is torch.int64 and flat.is_contiguous() \
            else flat.to(torch.int64).contiguous()
        k = weight.in_features
        out = torch.empty((flat.shape[0], k), dtype=torch.float32)
        rc = self._fn(flat.data_ptr(), flat.shape[0], data.data_ptr(), data.shape[0], k, qtype,
                      out.data_ptr())
        if rc == 3:
            raise IndexError(f"native embedding_packed: an id is outside [0, {data.shape[0]})")
        if rc != 0:
            raise ValueError(f"native embedding_packed refused {weight.format.name} with K={k}")
        out = out.view(*ids.shape, k)
        return out if weight.compute_dtype is torch.float32 else out.to(weight.compute_dtype)
