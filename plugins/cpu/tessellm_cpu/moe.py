"""The CPU's mixture-of-experts kernels: a step's (token, expert) pairs sorted by expert, so
each expert that any token chose reads its weights once for all of its tokens (one GEMM over
its rows for gate/up, one for down) and experts nobody chose are never read.

`fused_moe_grouped` runs the experts' linears with torch (oneDNN); `FusedMoEPacked` runs
them on stacked packed experts (GGUF's `ffn_*_exps`) with the native packed linears, reading
each chosen expert's blocks in place (AMX tiles for an expert with 16 rows or more, where the
machine has AMX: prefill chunks), and dequantize-then-GEMM past their row range. Both
accumulate the weighted sum in float32; packed experts compute in float32 throughout
(kernels.reference_moe)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tessellm.plugin_api import KernelQuery, PackedWeight, portable

ExpertMlp = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_mixture(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    num_experts: int, expert_mlp: ExpertMlp) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_mlp(e, rows of x routed to e), one call per chosen
    expert over all of its rows."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    rows = x.index_select(0, tokens)
    weights = topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts):
        if c:
            part = slice(start, start + c)
            out.index_add_(0, tokens[part], expert_mlp(e, rows[part]).float().mul_(weights[part]))
            start += c
    return out.to(x.dtype)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    d = h.shape[-1] // 2
    return F.silu(h[:, :d]).mul_(h[:, d:])


def fused_moe_grouped(x, w13, w2, topk_weights, topk_ids):
    H = x.shape[1]
    E, inter = w2.shape[0] // H, w2.shape[1]

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = F.linear(rows, w13[e * 2 * inter:(e + 1) * 2 * inter])
        return F.linear(_silu_and_mul(h), w2[e * H:(e + 1) * H])
    return grouped_mixture(x, topk_weights, topk_ids, E, mlp)


def _expert(w: PackedWeight, e: int, rows: int) -> PackedWeight:
    return w.with_data(w.data[e * rows:(e + 1) * rows])


class FusedMoEPacked:
    """fused_moe_packed with, per chosen expert, `many_rows` (the AMX packed linear) for an
    expert with MANY_ROWS rows or more, else the native packed linear `linear` (rows within
    `max_rows`), else dequantize-then-GEMM; None for either: not used."""

    MANY_ROWS = 16   # the AMX linears' tiles of 16 rows

    def __init__(self, linear: Callable | None, max_rows: int | None,
                 many_rows: Callable | None = None) -> None:
        self.linear, self.max_rows, self.many_rows = linear, max_rows, many_rows
        self.types = getattr(linear, "types", frozenset())

    def supports(self, query: KernelQuery) -> bool:
        return query.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def _linear(self, rows: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        native = w.format.ggml_type in self.types
        if self.many_rows is not None and native and rows.shape[0] >= self.MANY_ROWS:
            return self.many_rows(rows, w)
        if (self.linear is not None and native
                and (self.max_rows is None or rows.shape[0] <= self.max_rows)):
            return self.linear(rows, w)
        return portable.linear_packed_dequant(rows, w)

    def __call__(self, x, w13: PackedWeight, w2: PackedWeight, topk_weights, topk_ids):
        H = x.shape[1]
        E, inter = w2.shape[0] // H, w2.shape[1]

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = self._linear(rows, _expert(w13, e, 2 * inter))
            return self._linear(_silu_and_mul(h), _expert(w2, e, H))
        return grouped_mixture(x.float(), topk_weights, topk_ids, E, mlp).to(x.dtype)
