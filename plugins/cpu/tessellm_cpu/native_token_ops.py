"""Per-token small ops as C kernels (native/token_ops.c), called through ctypes: rotary
embedding, the KV-cache write, RMSNorm (plain and fused with the residual add), silu_and_mul
the sampler's greedy argmax and the token bitmask of constrained rows. For a
decode step each is a few microseconds of arithmetic that torch spreads over several ops,
each costing more than the arithmetic. float32 and bfloat16; the C side checks positions and slots first.
The wrappers are on every decode step's path (about ten calls per layer), so the common case
(2-D tensors with contiguous rows, index tensors already int64) costs no copies or views."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from typing import Callable

from tessellm.plugin_api import KernelQuery
from tessellm_cpu.native_build import build_library, entry_points_by_dtype
from tessellm_cpu.native_team import TeamEntry, TeamKernelC, last_dim_rows_view, rows_view

SOURCE = Path(__file__).with_name("native") / "token_ops.c"
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_f32 = ctypes.c_float
RK_ERRORS = {1: "a position is outside the rotary table", 2: "a slot is outside the KV pool",
             3: "bad shape (odd head_dim, or an element size other than 2 or 4)"}
_DTYPES = (torch.float32, torch.bfloat16)


_CONTIGUOUS = torch.contiguous_format


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as rows of contiguous features (a row-strided view passes as is)."""
    return t if t.dim() == 2 and t.stride(1) == 1 else t.reshape(t.shape[0], -1).contiguous()


def _last_dim_rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with contiguous features."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _norm_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int] | None:
    """t's rows as rms_norm.c reads them, without a copy: (base, rows, features, row stride,
    rows per group, group stride). Rows that flatten to one stride are one group; a
    [T, heads, D] view whose rows do not (per-head slices of a fused projection) is T groups
    of `heads` rows. None when t needs a copy."""
    t2 = last_dim_rows_view(t)
    if t2 is not None:
        return t2, t2.shape[0], t2.shape[1], t2.stride(0), max(t2.shape[0], 1), 0
    if t.dim() == 3 and t.stride(2) == 1 and t.shape[1] > 0:
        return t, t.shape[0] * t.shape[1], t.shape[2], t.stride(1), t.shape[1], t.stride(0)
    return None


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _empty_rows(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of t's shape and dtype."""
    return torch.empty_like(t, memory_format=_CONTIGUOUS)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"native {what}: {RK_ERRORS.get(rc, f'error {rc}')}")


class _Native:
    def __init__(self) -> None:
        native = build_library(SOURCE)
        self.code_hash = native.key
        self._lib = native

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return query.dtype in _DTYPES

    def _per_dtype(self, stem: str, argtypes: list) -> dict[torch.dtype, ctypes._CFuncPtr]:
        return entry_points_by_dtype(self._lib, stem, argtypes)


class RotaryArgs(ctypes.Structure):
    _fields_ = [("pos", _ptr), ("T", _i64), ("q", _ptr), ("q_stride", _i64), ("HQ", _i64),
                ("k", _ptr), ("k_stride", _i64), ("HK", _i64), ("cos_sin", _ptr), ("P", _i64),
                ("D", _i64), ("q_out", _ptr), ("k_out", _ptr)]


class WriteKVArgs(ctypes.Structure):
    _fields_ = [("k", _ptr), ("k_stride", _i64), ("v", _ptr), ("v_stride", _i64),
                ("slots", _ptr), ("T", _i64), ("cache", _ptr), ("NB", _i64), ("HK", _i64),
                ("BS", _i64), ("D", _i64), ("elem", _i64)]


class RmsNormArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("x_stride", _i64), ("res", _ptr), ("res_stride", _i64),
                ("w", _ptr), ("T", _i64), ("H", _i64), ("eps", _f32), ("out", _ptr),
                ("summed", _ptr), ("rows_per_group", _i64), ("group_stride", _i64)]


class SiluAndMulArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("x_stride", _i64), ("T", _i64), ("F", _i64), ("out", _ptr)]


class SelectRowsArgs(ctypes.Structure):
    _fields_ = [("x", _ptr), ("x_stride", _i64), ("N", _i64), ("index", _ptr), ("R", _i64),
                ("row_bytes", _i64), ("out", _ptr)]


def _raiser(what: str) -> Callable[[int], None]:
    def raise_error(rc: int) -> None:
        _check(rc, what)
    return raise_error


class _TeamNative(_Native, TeamKernelC):
    def _team(self, stem: str, args: type[ctypes.Structure]) -> dict[torch.dtype, TeamEntry]:
        return {dt: TeamEntry(self._lib, f"{stem}_{sfx}", args)
                for dt, sfx in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))}


class NativeRotary(_TeamNative):
    def __init__(self) -> None:
        super().__init__()
        self._entries = self._team("rotary", RotaryArgs)

    def __call__(self, positions, q, k, cos_sin, head_dim):
        entry = self._entries.get(q.dtype)
        if entry is None or k.dtype != q.dtype:
            raise TypeError(f"native rotary supports float32/bfloat16 q and k, got {q.dtype}, "
                            f"{k.dtype}")
        b = self._builder()
        q2, k2 = rows_view(q), rows_view(k)
        pos = positions if positions.dtype is torch.int64 and positions.is_contiguous() else None
        cs = cos_sin if cos_sin.dtype is torch.float32 and cos_sin.is_contiguous() else None
        if b is not None and None in (q2, k2, pos, cs):
            b.decline("rotary inputs need a copy")
            b = None
        q2 = q2 if q2 is not None else _rows(q)
        k2 = k2 if k2 is not None else _rows(k)
        pos = pos if pos is not None else _int64(positions)
        cs = cs if cs is not None else cos_sin.float().contiguous()
        if cs.shape[-1] != head_dim or q2.shape[1] % head_dim or k2.shape[1] % head_dim:
            raise ValueError(f"native rotary: head_dim {head_dim} does not fit q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, cos_sin {tuple(cos_sin.shape)}")
        if pos.shape[0] != q2.shape[0] or k2.shape[0] != q2.shape[0]:
            raise ValueError("native rotary: positions, q and k need one row per token")
        q_out, k_out = self._empty(b, q2.shape, q2.dtype), self._empty(b, k2.shape, k2.dtype)
        args = RotaryArgs(pos.data_ptr(), pos.shape[0], q2.data_ptr(), q2.stride(0),
                          q2.shape[1] // head_dim, k2.data_ptr(), k2.stride(0),
                          k2.shape[1] // head_dim, cs.data_ptr(), cs.shape[0], head_dim,
                          q_out.data_ptr(), k_out.data_ptr())
        return self._launch(b, entry, args, (q_out, k_out), _raiser("rotary"),
                            "rotary_embedding")


class NativeWriteKV(_TeamNative):
    def __init__(self) -> None:
        super().__init__()
        self._entry = TeamEntry(self._lib, "write_kv", WriteKVArgs)

    def __call__(self, k, v, kv_cache, slot_mapping):
        if kv_cache.dtype not in _DTYPES or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
            raise TypeError(f"native KV write needs k, v and the cache in one of float32/bfloat16, "
                            f"got {k.dtype}, {v.dtype}, {kv_cache.dtype}")
        if not kv_cache.is_contiguous() or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"native KV write needs a contiguous [2, blocks, kv_heads, "
                             f"block_size, head_dim] cache, got {tuple(kv_cache.shape)}")
        _, nb, hk, bs, d = kv_cache.shape
        b = self._builder()
        k2, v2 = rows_view(k), rows_view(v)
        slots = slot_mapping if slot_mapping.dtype is torch.int64 \
            and slot_mapping.is_contiguous() else None
        if b is not None and None in (k2, v2, slots):
            b.decline("KV write inputs need a copy")
            b = None
        k2 = k2 if k2 is not None else _rows(k)
        v2 = v2 if v2 is not None else _rows(v)
        slots = slots if slots is not None else _int64(slot_mapping)
        if k2.shape[1] != hk * d or v2.shape[1] != hk * d or not (
                k2.shape[0] == v2.shape[0] == slots.shape[0]):
            raise ValueError(f"native KV write: k {tuple(k.shape)}, v {tuple(v.shape)} and "
                             f"{slots.shape[0]} slots do not fit a cache of {hk} x {d}")
        args = WriteKVArgs(k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0),
                           slots.data_ptr(), slots.shape[0], kv_cache.data_ptr(), nb, hk, bs, d,
                           kv_cache.element_size())
        self._launch(b, self._entry, args, None, _raiser("KV write"), "write_kv_cache")


class NativeRmsNorm(_TeamNative):
    """rms_norm(x, weight, eps), with the reference's rounding points."""

    def __init__(self) -> None:
        super().__init__()
        self._entries = self._team("rms_norm", RmsNormArgs)

    def _run(self, x, residual, weight, eps):
        entry = self._entries.get(x.dtype)
        if entry is None or weight.dtype != x.dtype or (residual is not None
                                                        and residual.dtype != x.dtype):
            raise TypeError(f"native rms_norm needs x, residual and weight in one of "
                            f"float32/bfloat16, got {x.dtype}, {weight.dtype}")
        b = self._builder()
        # any leading dims; qwen3's per-head q/k norms read [T, heads, D] slices of the fused
        # qkv output in place (the residual, when there is one, has plain rows)
        xr = _norm_rows(x)
        if xr is not None and residual is not None and xr[5] != 0:
            xr = None
        r2 = None if residual is None else last_dim_rows_view(residual)
        w = weight if weight.is_contiguous() else None
        if b is not None and (xr is None or w is None or (residual is not None and r2 is None)):
            b.decline("rms_norm inputs need a copy")
            b = None
        if xr is None:
            xr = _norm_rows(_last_dim_rows(x))
        if residual is not None and r2 is None:
            r2 = _last_dim_rows(residual)
        w = w if w is not None else weight.contiguous()
        base, rows, feats, row_stride, per_group, group_stride = xr
        if w.shape != (feats,) or (r2 is not None and r2.shape != (rows, feats)):
            raise ValueError(f"native rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                             + ("" if residual is None else f", residual {tuple(residual.shape)}"))
        out = self._empty(b, (rows, feats), x.dtype)
        summed = None if r2 is None else self._empty(b, (rows, feats), x.dtype)
        args = RmsNormArgs(base.data_ptr(), row_stride,
                           0 if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
                           w.data_ptr(), rows, feats, float(eps), out.data_ptr(),
                           0 if summed is None else summed.data_ptr(), per_group, group_stride)
        if x.dim() != 2:
            out = out.view(x.shape)
            summed = None if summed is None else summed.view(x.shape)
        return self._launch(b, entry, args, (out, summed), _raiser("rms_norm"),
                            "rms_norm" if residual is None else "fused_add_rms_norm")

    def __call__(self, x, weight, eps):
        return self._run(x, None, weight, eps)[0]


class NativeFusedAddRmsNorm(NativeRmsNorm):
    """fused_add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)."""

    def __call__(self, x, residual, weight, eps):
        return self._run(x, residual, weight, eps)


class NativeSiluAndMul(_TeamNative):
    """silu_and_mul(x): silu(x[..., :F]) * x[..., F:], with the reference's rounding points."""

    def __init__(self) -> None:
        super().__init__()
        self._entries = self._team("silu_and_mul", SiluAndMulArgs)

    def __call__(self, x):
        entry = self._entries.get(x.dtype)
        if entry is None:
            raise TypeError(f"native silu_and_mul supports float32/bfloat16, got {x.dtype}")
        b = self._builder()
        x2 = last_dim_rows_view(x)
        if b is not None and x2 is None:
            b.decline("silu_and_mul input needs a copy")
            b = None
        x2 = x2 if x2 is not None else _last_dim_rows(x)
        if x2.shape[1] % 2:
            raise ValueError(f"native silu_and_mul needs an even last dim, got {tuple(x.shape)}")
        rows, f = x2.shape[0], x2.shape[1] // 2
        out = self._empty(b, (rows, f), x.dtype)
        args = SiluAndMulArgs(x2.data_ptr(), x2.stride(0), rows, f, out.data_ptr())
        result = out if x2 is x else out.view(*x.shape[:-1], f)
        return self._launch(b, entry, args, result, _raiser("silu_and_mul"), "silu_and_mul")


class NativeSelectRows(_TeamNative):
    """select_rows(x, index) = x.index_select(0, index) for a native program (the graph's
    structural op before the LM head); eager calls work too."""

    def __init__(self) -> None:
        super().__init__()
        self._entry = TeamEntry(self._lib, "select_rows", SelectRowsArgs)

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        b = self._builder()
        x2 = rows_view(x) if x.dim() == 2 else None
        if x2 is None or index.dtype is not torch.int64 or not index.is_contiguous() \
                or index.dim() != 1:
            if b is not None:
                b.decline("select_rows inputs are not rows and int64 ids")
            return x.index_select(0, index)
        out = self._empty(b, (index.shape[0], x2.shape[1]), x2.dtype)
        args = SelectRowsArgs(x2.data_ptr(), x2.stride(0) * x2.element_size(), x2.shape[0],
                              index.data_ptr(), index.shape[0], x2.shape[1] * x2.element_size(),
                              out.data_ptr())

        rows = x2.shape[0]

        def raise_error(rc: int) -> None:
            raise IndexError(f"native select_rows: an index is outside [0, {rows})")
        return self._launch(b, self._entry, args, out, raise_error, "select_rows")


class NativeEmbedding(NativeSelectRows):
    """embedding(ids, weight): the ids' rows of a dense table (select_rows in C: every id
    checked against the table first, rows copied)."""

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return query.dtype in _DTYPES

    def __call__(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() != 2 or weight.stride(1) != 1 or not weight.is_cpu:
            raise ValueError(f"native embedding needs a [vocab, dim] table with contiguous rows "
                             f"on the CPU, got {tuple(weight.shape)}")
        flat = ids.reshape(-1)
        if flat.data_ptr() != ids.data_ptr() or flat.dtype is not torch.int64:
            b = self._builder()
            if b is not None:
                b.decline("embedding ids are not int64 rows")
            flat = flat.to(torch.int64).contiguous()
            return super().__call__(weight, flat).view(*ids.shape, weight.shape[1])
        return super().__call__(weight, flat).view(*ids.shape, weight.shape[1])


class NativeGreedy(_Native):
    """greedy_tokens(logits): per row the first NaN, else the first largest value (int64)."""

    def __init__(self) -> None:
        super().__init__()
        self._fns = self._per_dtype("greedy", [_ptr, _i64, _i64, _i64, _ptr])

    def __call__(self, logits):
        fn = self._fns.get(logits.dtype)
        if fn is None or logits.dim() != 2:
            raise TypeError(f"native greedy needs float32/bfloat16 logits [rows, vocab], got "
                            f"{logits.dtype} of shape {tuple(logits.shape)}")
        x = _rows(logits)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            if x.shape[1] == 0:
                raise ValueError("native greedy: logits rows have no entries")
            _check(fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr()),
                   "greedy")
        return out


class NativeTokenBitmask(_Native):
    """apply_token_bitmask(logits, bitmask): in place, -inf where the row's bit is 0."""

    def __init__(self) -> None:
        super().__init__()
        self._fns = self._per_dtype("apply_token_bitmask", [_ptr, _i64, _ptr, _i64, _i64, _i64])

    def __call__(self, logits, bitmask):
        fn = self._fns.get(logits.dtype)
        if fn is None or logits.dim() != 2 or logits.stride(1) != 1:
            raise TypeError(f"native token bitmask needs float32/bfloat16 logits [rows, vocab] "
                            f"with contiguous rows, got {logits.dtype} of shape "
                            f"{tuple(logits.shape)}")
        rows, vocab = logits.shape
        words = (vocab + 31) // 32
        if bitmask.dtype is not torch.int32 or tuple(bitmask.shape) != (rows, words) \
                or bitmask.stride(1) != 1:
            raise ValueError(f"native token bitmask: the bitmask must be int32 [{rows}, {words}] "
                             f"with contiguous rows, got {bitmask.dtype} "
                             f"{tuple(bitmask.shape)}")
        if rows:
            _check(fn(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                      rows, vocab), "token bitmask")
