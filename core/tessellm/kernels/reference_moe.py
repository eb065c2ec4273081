"""Reference ops of mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE), in plain torch.

Expert weights are stacked by rows: `w13` [E * 2I, H] holds expert e's gate rows then its up
rows at [e * 2I, (e + 1) * 2I); `w2` [E * H, I] holds expert e's down rows at
[e * H, (e + 1) * H). A float tensor or a PackedWeight (GGUF's stacked expert tensors), the
packed op dequantizing each expert as `linear_packed` does. Router weights are float32 and
expert ids int64, [T, top_k] each; a row's ids are distinct.

Numerics: each expert's MLP runs in the activation dtype (as transformers runs it; over packed
experts in float32, as linear_packed does), the weighted sum over a token's experts
accumulates in float32 and is cast back once.
"""
from __future__ import annotations

from typing import Callable

import torch

from tessellm.quant.formats import PackedWeight

ROUTER_SCORINGS = ("softmax", "sigmoid")


def moe_router(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]): the top_k experts of each
    token by probability (softmax over the experts, or a sigmoid per expert), largest first;
    with `renormalize` the chosen weights are divided by their sum."""
    if scoring == "softmax":
        probs = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        probs = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"unknown router scoring {scoring!r} (known: {ROUTER_SCORINGS})")
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.long()


def expert_count(w2: torch.Tensor | PackedWeight, hidden: int) -> int:
    return int(w2.shape[0]) // hidden


def _mixture(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             num_experts: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_mlp(topk_ids[t, j], x[t]), expert by expert."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel():
            y = expert_mlp(e, x[tokens]).float() * topk_weights[tokens, slots, None].float()
            out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def _silu_mlp(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's experts' down(silu(gate(x)) * up(x)), weighted and summed."""
    H = x.shape[-1]
    E, inter = expert_count(w2, H), w2.shape[1]
    g13, g2 = w13.view(E, 2 * inter, H), w2.view(E, H, inter)
    return _mixture(x, topk_weights, topk_ids, E,
                    lambda e, rows: _silu_mlp(rows @ g13[e].t()) @ g2[e].t())


def expert_rows(w: PackedWeight, expert: int, rows_per_expert: int) -> PackedWeight:
    """Expert `expert`'s rows of a stacked packed weight (a view of its bytes)."""
    start = expert * rows_per_expert
    return w.with_data(w.data[start:start + rows_per_expert])


def _packed_mixture(x: torch.Tensor, w13: PackedWeight, w2: PackedWeight,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    linear: Callable[[torch.Tensor, PackedWeight], torch.Tensor]) -> torch.Tensor:
    """The mixture over stacked packed experts, each expert's two linears by `linear`, in
    float32, cast back once after the weighted sum."""
    H = x.shape[-1]
    E, inter = expert_count(w2, H), w2.shape[1]
    out = _mixture(x.float(), topk_weights, topk_ids, E, lambda e, rows: linear(
        _silu_mlp(linear(rows, expert_rows(w13, e, 2 * inter))), expert_rows(w2, e, H)))
    return out.to(x.dtype)


def fused_moe_packed(x: torch.Tensor, w13: PackedWeight, w2: PackedWeight,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe over stacked packed experts, each expert's MLP in float32 over its
    dequantized weights (as linear_packed computes, and llama.cpp), cast back once after the
    weighted sum."""
    from tessellm.kernels.reference import linear_packed
    return _packed_mixture(x, w13, w2, topk_weights, topk_ids, linear_packed)


def fused_moe_packed_q8act(x: torch.Tensor, w13: PackedWeight, w2: PackedWeight,
                           topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_packed with int8 activations (EngineConfig.packed_activations = "q8_0"):
    each expert linear's input rows (the token's x for gate/up, its silu-and-mul row for
    down) rounded to q8_0 blocks first, as linear_packed_q8act does; llama.cpp's way of
    running a quantized MoE layer."""
    from tessellm.kernels.reference import linear_packed_q8act
    return _packed_mixture(x, w13, w2, topk_weights, topk_ids, linear_packed_q8act)


def sigmoid_gate(gate_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate_logits) * y: gate_logits [T, 1] scales each row of y [T, H] (Qwen2-MoE's
    shared expert)."""
    return torch.sigmoid(gate_logits) * y
