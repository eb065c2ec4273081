"""Fuse sibling linears (same input, one per role) into one linear over concatenated weights.

q/k/v -> one qkv linear; gate/up (a dense MLP's, or a MoE shared expert's) -> one gate_up
linear. The fused output is split back with
`split_last`, so consumers are unchanged. Weights are concatenated once here (at load time) and
the originals become dead (dead-code removal drops them). Applies only where every sibling is
present, reads the same input, agrees on bias and has weights of one dtype or packed format
(packed weights are concatenated along rows, which keeps them packed).
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph, linear_call, linear_dims
from tessellm.quant.formats import PackedWeight, concat_rows


def _weight_kind(weight: torch.Tensor | PackedWeight) -> object:
    """Siblings fuse only when their weights concatenate: same dtype, or same packed format."""
    return weight.format if isinstance(weight, PackedWeight) else weight.dtype


def _concat(weights: list[torch.Tensor | PackedWeight]) -> torch.Tensor | PackedWeight:
    if isinstance(weights[0], PackedWeight):
        return concat_rows(weights)  # type: ignore[arg-type]
    return torch.cat(weights, dim=0)  # type: ignore[arg-type]


def _fuse_siblings(mg: ModelGraph, roles: tuple[str, ...], fused_role: str) -> ModelGraph:
    groups: dict[tuple[object, fx.Node], dict[str, fx.Node]] = defaultdict(dict)
    for node in mg.op_nodes(ops.linear) + mg.op_nodes(ops.linear_packed):
        role = node.meta.get("role")
        if role in roles:
            groups[(node.meta.get("layer"), node.args[0])][role] = node
    for (layer, x), members in groups.items():
        if set(members) != set(roles):
            continue
        nodes = [members[r] for r in roles]
        has_bias = [n.args[2] is not None for n in nodes]
        if any(has_bias) and not all(has_bias):
            continue
        w_names = [n.args[1].target for n in nodes]
        parts = [mg.weights[name] for name in w_names]
        if len({_weight_kind(w) for w in parts}) != 1:
            continue  # e.g. a GGUF file with Q4_1 q/k but a Q8_0 v
        fused_w = _concat(parts)
        sizes = tuple(w.shape[0] for w in parts)
        stem = f"{fused_role}.{layer}"
        mg.weights[f"{stem}.weight"] = fused_w
        if all(has_bias):
            mg.weights[f"{stem}.bias"] = torch.cat([mg.weights[n.args[2].target] for n in nodes])
        g = mg.graph
        with g.inserting_before(nodes[0]):
            w = g.get_attr(f"{stem}.weight")
            b = g.get_attr(f"{stem}.bias") if all(has_bias) else None
            target, *args = linear_call(x, w, b, fused_w)
            fused = g.call_function(target, tuple(args))
            fused.meta.update(role=fused_role, layer=layer,
                              dims=tuple(sorted(linear_dims(fused_w.shape[1], sum(sizes),
                                                            all(has_bias), fused_w).items())))
            split = g.call_function(ops.split_last, (fused, sizes))
            for i, node in enumerate(nodes):
                node.replace_all_uses_with(g.call_function(operator.getitem, (split, i)))
        for node in nodes:
            g.erase_node(node)
    return mg


def fuse_qkv(mg: ModelGraph) -> ModelGraph:
    return _fuse_siblings(mg, ("q_proj", "k_proj", "v_proj"), "qkv_proj")


def fuse_gate_up(mg: ModelGraph) -> ModelGraph:
    """Every dense MLP's gate and up, a MoE layer's shared expert's included."""
    _fuse_siblings(mg, ("gate_proj", "up_proj"), "gate_up_proj")
    return _fuse_siblings(mg, ("shared_gate_proj", "shared_up_proj"), "shared_gate_up_proj")
