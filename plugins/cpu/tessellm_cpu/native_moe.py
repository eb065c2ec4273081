"""The C mixture-of-experts kernels over packed experts as team kernels: eager, or one node
of a decode step's native program (tessellm_cpu.native_team), so a MoE layer costs one native
call, not a Python loop. `NativeMoEPacked` (native/moe_packed.c, op fused_moe_packed) takes
float32 activations, `NativeMoEQ8Act` (native/moe_q8act.c, op fused_moe_packed_q8act) int8
ones (AVX-512 VNNI); both read native/moe_pairs.h's arguments. Also the router."""
from __future__ import annotations

import ctypes

import torch

from tessellm.plugin_api import KernelQuery, PackedWeight
from tessellm_cpu.native_build import build_library
from tessellm_cpu.native_linear import FLOAT_ACTIVATION_TYPES, INT8_ACTIVATION_TYPES, NATIVE
from tessellm_cpu.native_team import TeamEntry, TeamKernelC

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class MoePackedArgs(ctypes.Structure):
    """moe_pairs.h's MoePackedArgs."""
    _fields_ = [("x", _ptr), ("T", _i64), ("H", _i64), ("w13", _ptr), ("qtype13", _int),
                ("w2", _ptr), ("qtype2", _int), ("E", _i64), ("I", _i64), ("K", _i64),
                ("weights", _ptr), ("ids", _ptr), ("out", _ptr), ("scratch", _ptr)]


class NativeMoEPacked(TeamKernelC):
    """fused_moe_packed in C for the GGML types the native packed linear reads."""

    source, stem, op = NATIVE / "moe_packed.c", "moe_packed", "fused_moe_packed"
    types = FLOAT_ACTIVATION_TYPES

    def __init__(self) -> None:
        native = build_library(self.source)
        self.code_hash = native.key
        self._entry = TeamEntry(native, self.stem, MoePackedArgs, scratch=True)

    def supports(self, query: KernelQuery) -> bool:
        return (query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dim("qtype") in self.types and query.dim("qtype_down") in self.types)

    def __call__(self, x: torch.Tensor, w13: PackedWeight, w2: PackedWeight,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        for w in (w13, w2):
            if w.format.ggml_type not in self.types:
                raise TypeError(f"native {self.stem} does not read {w.format.name}")
            if not (w.data.is_cpu and w.data.is_contiguous()):
                raise ValueError(f"native {self.stem} needs contiguous packed rows on the CPU")
        T, H = x.shape
        inter = w2.in_features
        E, K = w2.shape[0] // H, topk_ids.shape[1]
        if w13.in_features != H or w13.shape[0] != E * 2 * inter or w2.shape[0] != E * H:
            raise ValueError(f"native {self.stem}: gate/up {w13.shape} and down {w2.shape} are "
                             f"not {E} experts of hidden {H}")
        b = self._builder()
        ready = (x.dtype is torch.float32 and x.is_contiguous()
                 and topk_weights.dtype is torch.float32 and topk_weights.is_contiguous()
                 and topk_ids.dtype is torch.int64 and topk_ids.is_contiguous())
        if b is not None and not ready:
            b.decline(f"{self.stem} converts its input or routing to float32 / int64")
            b = None
        xf = x.contiguous() if x.dtype is torch.float32 else x.float().contiguous()
        wf = topk_weights.float().contiguous()
        ids = topk_ids.long().contiguous()
        out = self._empty(b, (T, H), torch.float32)
        args = MoePackedArgs(xf.data_ptr(), T, H, w13.data.data_ptr(), w13.format.ggml_type,
                             w2.data.data_ptr(), w2.format.ggml_type, E, inter, K,
                             wf.data_ptr(), ids.data_ptr(), out.data_ptr(), 0)

        def raise_error(rc: int) -> None:
            if rc == 2:
                raise MemoryError(f"native {self.stem} could not allocate its scratch buffer")
            if rc == 3:
                raise ValueError(f"native {self.stem}: an expert id outside [0, {E})")
            raise ValueError(f"native {self.stem} refused {w13.format.name}/{w2.format.name} "
                             f"with H={H}, I={inter}")
        out = self._launch(b, self._entry, args, out, raise_error, self.op,
                           keep=(xf, wf, ids))
        return out if x.dtype is torch.float32 else out.to(x.dtype)


class NativeMoEQ8Act(NativeMoEPacked):
    """fused_moe_packed_q8act in C: each expert linear's input rounded to q8_0 blocks, integer
    dot products (AVX-512 VNNI; the build fails without it and the kernel is not offered)."""

    source, stem, op = NATIVE / "moe_q8act.c", "moe_q8act", "fused_moe_packed_q8act"
    types = INT8_ACTIVATION_TYPES


class MoeRouterArgs(ctypes.Structure):
    """moe_router.c's MoeRouterArgs."""
    _fields_ = [("logits", _ptr), ("stride", _i64), ("T", _i64), ("E", _i64), ("K", _i64),
                ("renormalize", _int), ("sigmoid", _int), ("weights", _ptr), ("ids", _ptr)]


class NativeMoeRouter(TeamKernelC):
    """moe_router in C: softmax (or sigmoid) and top-k of float32 router logits."""

    MAX_EXPERTS = 1024

    def __init__(self) -> None:
        native = build_library(NATIVE / "moe_router.c")
        self.code_hash = native.key
        self._entry = TeamEntry(native, "moe_router", MoeRouterArgs)

    def supports(self, query: KernelQuery) -> bool:
        return (query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dim("experts") <= self.MAX_EXPERTS)

    def __call__(self, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown router scoring {scoring!r} (known: softmax, sigmoid)")
        T, E = router_logits.shape
        if not 1 <= top_k <= E or E > self.MAX_EXPERTS:
            raise ValueError(f"native moe_router: top_k {top_k} of {E} experts "
                             f"(at most {self.MAX_EXPERTS})")
        b = self._builder()
        ready = router_logits.dtype is torch.float32 and router_logits.stride(1) == 1
        if b is not None and not ready:
            b.decline("moe_router converts its logits to float32")
            b = None
        logits = router_logits if ready else router_logits.float().contiguous()
        weights = self._empty(b, (T, top_k), torch.float32)
        ids = self._empty(b, (T, top_k), torch.int64)
        args = MoeRouterArgs(logits.data_ptr(), logits.stride(0), T, E, top_k,
                             int(renormalize), int(scoring == "sigmoid"), weights.data_ptr(),
                             ids.data_ptr())

        def raise_error(rc: int) -> None:
            raise ValueError(f"native moe_router refused top_k {top_k} of {E} experts")
        return self._launch(b, self._entry, args, (weights, ids), raise_error, "moe_router",
                            keep=(logits,))
