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

from tessellm.plugin_api import KernelQuery
from tessellm_cpu.native_build import build_library, entry_point, entry_points_by_dtype

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


class NativeRotary(_Native):
    def __init__(self) -> None:
        super().__init__()
        self._fns = self._per_dtype("rotary", [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                               _ptr, _i64, _i64, _ptr, _ptr])

    def __call__(self, positions, q, k, cos_sin, head_dim):
        fn = self._fns.get(q.dtype)
        if fn is None or k.dtype != q.dtype:
            raise TypeError(f"native rotary supports float32/bfloat16 q and k, got {q.dtype}, "
                            f"{k.dtype}")
        q2, k2 = _rows(q), _rows(k)
        pos = _int64(positions)
        cs = cos_sin if cos_sin.dtype is torch.float32 and cos_sin.is_contiguous() \
            else cos_sin.float().contiguous()
        if cs.shape[-1] != head_dim or q2.shape[1] % head_dim or k2.shape[1] % head_dim:
            raise ValueError(f"native rotary: head_dim {head_dim} does not fit q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, cos_sin {tuple(cos_sin.shape)}")
        if pos.shape[0] != q2.shape[0] or k2.shape[0] != q2.shape[0]:
            raise ValueError("native rotary: positions, q and k need one row per token")
        q_out, k_out = _empty_rows(q2), _empty_rows(k2)
        _check(fn(pos.data_ptr(), pos.shape[0], q2.data_ptr(), q2.stride(0),
                  q2.shape[1] // head_dim, k2.data_ptr(), k2.stride(0), k2.shape[1] // head_dim,
                  cs.data_ptr(), cs.shape[0], head_dim, q_out.data_ptr(), k_out.data_ptr()),
               "rotary")
        return q_out, k_out


class NativeWriteKV(_Native):
    def __init__(self) -> None:
        super().__init__()
        self._fn = entry_point(self._lib, "write_kv")
        self._fn.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                             _i64]
        self._fn.restype = ctypes.c_int

    def __call__(self, k, v, kv_cache, slot_mapping):
        if kv_cache.dtype not in _DTYPES or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
            raise TypeError(f"native KV write needs k, v and the cache in one of float32/bfloat16, "
                            f"got {k.dtype}, {v.dtype}, {kv_cache.dtype}")
        if not kv_cache.is_contiguous() or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"native KV write needs a contiguous [2, blocks, kv_heads, "
                             f"block_size, head_dim] cache, got {tuple(kv_cache.shape)}")
        _, nb, hk, bs, d = kv_cache.shape
        k2, v2 = _rows(k), _rows(v)
        slots = _int64(slot_mapping)
        if k2.shape[1] != hk * d or v2.shape[1] != hk * d or not (
                k2.shape[0] == v2.shape[0] == slots.shape[0]):
            raise ValueError(f"native KV write: k {tuple(k.shape)}, v {tuple(v.shape)} and "
                             f"{slots.shape[0]} slots do not fit a cache of {hk} x {d}")
        _check(self._fn(k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0),
                        slots.data_ptr(), slots.shape[0], kv_cache.data_ptr(), nb, hk, bs, d,
                        kv_cache.element_size()), "KV write")


class NativeRmsNorm(_Native):
    """rms_norm(x, weight, eps), with the reference's rounding points."""

    def __init__(self) -> None:
        super().__init__()
        self._fns = self._per_dtype("rms_norm", [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _f32,
                                                 _ptr, _ptr])

    def _run(self, x, residual, weight, eps):
        fn = self._fns.get(x.dtype)
        if fn is None or weight.dtype != x.dtype or (residual is not None
                                                     and residual.dtype != x.dtype):
            raise TypeError(f"native rms_norm needs x, residual and weight in one of "
                            f"float32/bfloat16, got {x.dtype}, {weight.dtype}")
        x2 = _last_dim_rows(x)   # any leading dims (qwen3's per-head q/k norms: [T, heads, D])
        r2 = None if residual is None else _last_dim_rows(residual)
        w = weight.contiguous()
        rows, feats = x2.shape
        if w.shape != (feats,) or (r2 is not None and r2.shape != x2.shape):
            raise ValueError(f"native rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                             + ("" if residual is None else f", residual {tuple(residual.shape)}"))
        out = _empty_rows(x2)
        summed = None if r2 is None else _empty_rows(x2)
        _check(fn(x2.data_ptr(), x2.stride(0), 0 if r2 is None else r2.data_ptr(),
                  0 if r2 is None else r2.stride(0), w.data_ptr(), rows, feats,
                  float(eps), out.data_ptr(), 0 if summed is None else summed.data_ptr()),
               "rms_norm")
        if x2 is not x:
            out = out.view(x.shape)
            summed = None if summed is None else summed.view(x.shape)
        return out, summed

    def __call__(self, x, weight, eps):
        return self._run(x, None, weight, eps)[0]


class NativeFusedAddRmsNorm(NativeRmsNorm):
    """fused_add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)."""

    def __call__(self, x, residual, weight, eps):
        return self._run(x, residual, weight, eps)


class NativeSiluAndMul(_Native):
    """silu_and_mul(x): silu(x[..., :F]) * x[..., F:], with the reference's rounding points."""

    def __init__(self) -> None:
        super().__init__()
        self._fns = self._per_dtype("silu_and_mul", [_ptr, _i64, _i64, _i64, _ptr])

    def __call__(self, x):
        fn = self._fns.get(x.dtype)
        if fn is None:
            raise TypeError(f"native silu_and_mul supports float32/bfloat16, got {x.dtype}")
        x2 = _last_dim_rows(x)
        if x2.shape[1] % 2:
            raise ValueError(f"native silu_and_mul needs an even last dim, got {tuple(x.shape)}")
        rows, f = x2.shape[0], x2.shape[1] // 2
        out = torch.empty((rows, f), dtype=x.dtype)
        _check(fn(x2.data_ptr(), x2.stride(0), rows, f, out.data_ptr()), "silu_and_mul")
        return out if x2 is x else out.view(*x.shape[:-1], f)


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
