"""Portable mixture-of-experts kernels (see kernels.portable): no host reads and shapes from
the input shapes alone, so every expert runs on every token of the step and the routing
weights (zero for the experts a token did not choose) select the outputs. That is
num_experts / top_k times the work of a grouped kernel: the choice of a device without a
kernel of its own (XLA, CUDA without Triton), not of the CPU."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tessellm.quant.formats import PackedWeight, dequantize


def routing_matrix(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   num_experts: int) -> torch.Tensor:
    """[T, E] float32: token t's weight for expert e (0 where t did not choose e)."""
    dense = torch.zeros((topk_ids.shape[0], num_experts), dtype=torch.float32,
                        device=topk_ids.device)
    return dense.scatter_add(1, topk_ids, topk_weights.float())


def _all_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
    routing = routing_matrix(topk_weights, topk_ids, num_experts)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        out = out + expert_mlp(e, x).float() * routing[:, e:e + 1]
    return out.to(x.dtype)


def _silu_mlp(h: torch.Tensor) -> torch.Tensor:
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def fused_moe_dense(x, w13, w2, topk_weights, topk_ids):
    H = x.shape[-1]
    E, inter = w2.shape[0] // H, w2.shape[1]
    g13, g2 = w13.view(E, 2 * inter, H), w2.view(E, H, inter)
    return _all_experts(x, topk_weights, topk_ids, E,
                        lambda e, rows: F.linear(_silu_mlp(F.linear(rows, g13[e])), g2[e]))


def fused_moe_packed_dense(x, w13: PackedWeight, w2: PackedWeight, topk_weights, topk_ids):
    H = x.shape[-1]
    E, inter = w2.shape[0] // H, w2.shape[1]
    g13 = dequantize(w13, torch.float32).view(E, 2 * inter, H)
    g2 = dequantize(w2, torch.float32).view(E, H, inter)
    return _all_experts(x.float(), topk_weights, topk_ids, E,
                        lambda e, rows: F.linear(_silu_mlp(F.linear(rows, g13[e])), g2[e])
                        ).to(x.dtype)
