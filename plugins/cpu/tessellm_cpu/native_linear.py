"""Linears over packed GGML weights as C team kernels (tessellm_cpu.native_team: eager calls
or native-program nodes): the packed rows are read in place, activations in float32. All
share one argument layout (the AMX ones add their thread count), so one wrapper serves them:
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
from tessellm_cpu.native_team import TeamEntry, TeamKernelC

NATIVE = Path(__file__).with_name("native")
# GGML Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
FLOAT_ACTIVATION_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
INT8_ACTIVATION_TYPES = FLOAT_ACTIVATION_TYPES
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PackedLinearArgs(ctypes.Structure):
    """linear_packed.c's LinearPackedArgs and linear_q8act.c's LinearQ8ActArgs (one layout)."""
    _fields_ = [("x", _ptr), ("M", _i64), ("K", _i64), ("w", _ptr), ("N", _i64),
                ("qtype", ctypes.c_int), ("bias", _ptr), ("out", _ptr), ("scratch", _ptr)]


class AmxPackedLinearArgs(ctypes.Structure):
    """The AMX kernels' arguments: PackedLinearArgs plus the threads scratch is laid out for."""
    _fields_ = [("x", _ptr), ("M", _i64), ("K", _i64), ("w", _ptr), ("N", _i64),
                ("qtype", ctypes.c_int), ("bias", _ptr), ("out", _ptr),
                ("threads", ctypes.c_int), ("scratch", _ptr)]


class _TeamPackedLinear(TeamKernelC):
    """A packed linear of the C file `source` with team entries `stem`_run / _team / _scratch
    (return codes: 0, 1 bad format or K, 2 no memory, 3 unavailable here) for the GGML types
    `types`, offered for `min_tokens` up to `max_tokens` rows of x (None: any); op `op`."""

    source: Path
    stem: str
    op: str
    types: frozenset[int]
    args_type: type[ctypes.Structure] = PackedLinearArgs
    min_tokens = 1
    max_tokens: int | None = None

    def __init__(self) -> None:
        native = build_library(self.source)
        self.code_hash = native.key   # the built code, for the profiler's cache
        self._entry = TeamEntry(native, self.stem, self.args_type, scratch=True)

    def supports(self, query: KernelQuery) -> bool:
        return (query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dim("qtype") in self.types
                and query.num_tokens >= self.min_tokens
                and (self.max_tokens is None or query.num_tokens <= self.max_tokens))

    def __call__(self, x: torch.Tensor, weight: PackedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        qtype = weight.format.ggml_type
        if qtype not in self.types:
            raise TypeError(f"native {self.stem} does not read {weight.format.name}")
        data = weight.data
        if not (data.is_cpu and data.is_contiguous()):
            raise ValueError(f"native {self.stem} needs contiguous packed rows on the CPU")
        n, k = data.shape[0], weight.in_features
        b = self._builder()
        ready = x.dtype is torch.float32 and x.is_contiguous() and (
            bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()))
        if b is not None and not ready:
            b.decline(f"{self.stem} converts its input or bias to float32")
            b = None
        xf = x.contiguous() if x.dtype is torch.float32 else x.float().contiguous()
        if xf.dim() != 2 or xf.shape[1] != k or not xf.is_cpu:
            raise ValueError(f"native {self.stem}: x of shape {tuple(x.shape)} (rows of "
                             f"features on the CPU), the weight expects {k} features")
        bf = None if bias is None else bias.float().contiguous()
        if bf is not None and (bf.numel() != n or not bf.is_cpu):
            raise ValueError(f"native {self.stem}: a bias of {bf.numel()} values for {n} "
                             "output features (on the CPU)")
        out = self._empty(b, (xf.shape[0], n), torch.float32)
        fields = [xf.data_ptr(), xf.shape[0], k, data.data_ptr(), n, qtype,
                  0 if bf is None else bf.data_ptr(), out.data_ptr()]
        if self.args_type is AmxPackedLinearArgs:
            fields.append(0 if b is None else b.threads)
        args = self.args_type(*fields, 0)
        stem, name = self.stem, weight.format.name

        def raise_error(rc: int) -> None:
            if rc == 2:
                raise MemoryError(f"native {stem} could not allocate its scratch buffer")
            if rc == 3:
                raise RuntimeError(f"native {stem}: Linux refused this process the AMX tile "
                                   "state")
            raise ValueError(f"native {stem} refused {name} with K={k}")
        out = self._launch(b, self._entry, args, out, raise_error, self.op)
        return out if x.dtype is torch.float32 else out.to(x.dtype)


class NativePackedLinear(_TeamPackedLinear):
    source, stem, types = NATIVE / "linear_packed.c", "linear_packed", FLOAT_ACTIVATION_TYPES
    op = "linear_packed"
    # It decodes each block once per tile of up to 6 rows in float32 FMAs, so past a hundred or so
    # rows dequantize-then-GEMM (oneDNN) wins (measured on SmolLM2's Q4_1 linears).
    max_tokens = 256


class NativeQ8ActLinear(_TeamPackedLinear):
    source, stem, types = NATIVE / "linear_q8act.c", "linear_q8act", INT8_ACTIVATION_TYPES
    op = "linear_packed_q8act"


class _AmxPackedLinear(_TeamPackedLinear):
    """A packed linear on AMX tiles: offered where this process gets the tile state, from 16
    rows (decoding a strip of weights into tiles costs about one 16-row tile's work, so it
    pays from tens of rows, prefill; a decode step stays with the row kernels)."""

    min_tokens = 16
    args_type = AmxPackedLinearArgs

    def __init__(self) -> None:
        super().__init__()
        enable = entry_point(build_library(self.source), "amx_enable")
        enable.restype = ctypes.c_int
        if enable() != 0:
            raise NativeBuildError("Linux refused this process the AMX tile state")


class NativeQ8ActAmxLinear(_AmxPackedLinear):
    source, stem, types = NATIVE / "linear_q8act_amx.c", "linear_q8act_amx", INT8_ACTIVATION_TYPES
    op = "linear_packed_q8act"


class NativePackedAmxLinear(_AmxPackedLinear):
    source, stem, types = NATIVE / "linear_packed_amx.c", "linear_packed_amx", FLOAT_ACTIVATION_TYPES
    op = "linear_packed"


class EmbeddingPackedArgs(ctypes.Structure):
    _fields_ = [("ids", _ptr), ("T", _i64), ("w", _ptr), ("N", _i64), ("K", _i64),
                ("qtype", ctypes.c_int), ("out", _ptr)]


class NativePackedEmbedding(TeamKernelC):
    """embedding_packed(ids, weight): the ids' rows dequantized to float32 in C (the reference
    dequantizes with a dozen torch ops per call), then cast to the weight's compute dtype as
    the reference does."""

    def __init__(self) -> None:
        native = build_library(NATIVE / "linear_packed.c")
        self.code_hash = native.key
        self._entry = TeamEntry(native, "embedding_packed", EmbeddingPackedArgs)

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
        b = self._builder()
        flat = ids.reshape(-1)
        ready = flat.dtype is torch.int64 and flat.is_contiguous() and \
            weight.compute_dtype is torch.float32 and flat.data_ptr() == ids.data_ptr()
        if b is not None and not ready:
            b.decline("embedding_packed converts its ids or its output")
            b = None
        flat = flat if flat.dtype is torch.int64 and flat.is_contiguous() \
            else flat.to(torch.int64).contiguous()
        k, rows = weight.in_features, data.shape[0]
        out = self._empty(b, (flat.shape[0], k), torch.float32)
        args = EmbeddingPackedArgs(flat.data_ptr(), flat.shape[0], data.data_ptr(), rows, k,
                                   qtype, out.data_ptr())
        name = weight.format.name

        def raise_error(rc: int) -> None:
            if rc == 3:
                raise IndexError(f"native embedding_packed: an id is outside [0, {rows})")
            raise ValueError(f"native embedding_packed refused {name} with K={k}")
        out = self._launch(b, self._entry, args, out, raise_error, "embedding_packed")
        out = out.view(*ids.shape, k)
        return out if weight.compute_dtype is torch.float32 else out.to(weight.compute_dtype)
