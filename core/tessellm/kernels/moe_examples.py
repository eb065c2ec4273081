"""Example inputs of the mixture-of-experts ops (kernels.reference_moe), for the profiler and
the conformance kit: routings where the layout matters.

`skewed_routing(T, E, k)`: expert 0 takes every token (its first choice), the last expert
takes none, the others a seeded random share, a row's ids distinct (with k = E every expert
takes every token, in a random order); weights a seeded
softmax-like split summing to 1 per row."""
from __future__ import annotations

from typing import Any

import torch

from tessellm.quant.formats import packed_example, packed_format

MOE_OPS = ("moe_router", "fused_moe", "fused_moe_packed", "fused_moe_packed_q8act",
           "sigmoid_gate")


def skewed_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], ids int64 [T, k]) as the module docstring says."""
    ids = torch.zeros((num_tokens, top_k), dtype=torch.int64)
    for t in range(num_tokens):
        if top_k + 1 > num_experts:   # every expert in every row: only the order varies
            ids[t] = torch.randperm(num_experts, generator=gen)
        else:
            ids[t, 1:] = torch.randperm(num_experts - 2, generator=gen)[:top_k - 1] + 1
    weights = torch.rand((num_tokens, top_k), generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def moe_example(query: Any, dev: str, gen: torch.Generator,
                memo: dict[tuple[Any, ...], Any]) -> list[Any]:
    T, dt, d = query.num_tokens, query.dtype, dict(query.dims)
    if query.op == "moe_router":   # distinct scores per row: no top-k ties
        E = d["experts"]
        ranks = torch.argsort(torch.rand((T, E), generator=gen), dim=-1).float()
        logits = (ranks * (4.0 / E)).to(dtype=dt, device=dev)
        return [logits, d["top_k"], bool(d.get("renormalize", 1)),
                "sigmoid" if d.get("sigmoid", 0) else "softmax"]
    if query.op == "sigmoid_gate":
        return [torch.randn((T, 1), generator=gen).to(dtype=dt, device=dev),
                torch.randn((T, d["hidden"]), generator=gen).to(dtype=dt, device=dev)]
    H, inter, E, k = d["hidden"], d["features"], d["experts"], d["top_k"]
    weights, ids = skewed_routing(T, E, k, gen)
    x = torch.randn((T, H), generator=gen).to(dtype=dt, device=dev)
    if query.op == "fused_moe":
        w13 = (torch.randn((E * 2 * inter, H), generator=gen) * H ** -0.5).to(dt)
        w2 = (torch.randn((E * H, inter), generator=gen) * inter ** -0.5).to(dt)
        return [x, w13.to(dev), w2.to(dev), weights.to(dev), ids.to(dev)]
    key = ("fused_moe_packed", d["qtype"], d["qtype_down"], H, inter, E, dt, dev)
    if key not in memo:
        w13 = packed_example(packed_format(d["qtype"]), E * 2 * inter, H, gen,
                             scale=H ** -0.5, compute_dtype=dt)
        w2 = packed_example(packed_format(d["qtype_down"]), E * H, inter, gen,
                            scale=inter ** -0.5, compute_dtype=dt)
        memo[key] = (w13.with_data(w13.data.to(dev)), w2.with_data(w2.data.to(dev)))
    w13, w2 = memo[key]
    return [x, w13, w2, weights.to(dev), ids.to(dev)]
