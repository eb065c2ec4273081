"""Where a LoRA adapter adds its term: the `add_lora_sites` graph pass and the site table.

A site is one linear of the (fused) graph whose role a PEFT adapter can target: q/k/v (or
the fused qkv), o, gate/up (or the fused gate_up) and down of every layer. The pass runs after
fusion and quantization, so a site is exactly one linear node `y = linear(x, W)`; it inserts

    y' = lora_add(x, y, lora.<layer>.<role>.a, lora.<layer>.<role>.b, lora_slots)

and every reader of `y` reads `y'`. The weights are the site's slot table, zeros until an
adapter is loaded into a slot (tessellm.lora.slots):

    a [S, P*R, in]    slot s, rows p*R .. p*R + r: part p's lora_A (r <= R = max_lora_rank)
    b [S, P*R, out]   slot s, rows p*R .. p*R + r, columns of part p's outputs: part p's
                      (lora_B * scaling)^T

where S = max_loras and P the parts of a fused linear (qkv: 3, gate_up: 2, others 1), so a
fused site's B is block-diagonal per slot and each part keeps its own adapter. `lora_slots`
([T] int64, a step input) gives each token row its request's slot, -1 for the base model:
such a row's output is exactly y. The term is computed in the activation dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph

LORA_SLOTS_FEED = "lora_slots"
# graph role of a linear -> the PEFT module names of its parts, in output order
SITE_PARTS: dict[str, tuple[str, ...]] = {
    "q_proj": ("q_proj",), "k_proj": ("k_proj",), "v_proj": ("v_proj",),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_proj": ("gate_proj",), "up_proj": ("up_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}
LINEAR_OPS = (ops.linear, ops.linear_packed, ops.linear_packed_q8act)


@dataclass(frozen=True, slots=True)
class SitePart:
    module: str        # PEFT's module name, e.g. "k_proj"
    out_offset: int    # first output feature of the part in the site's output
    out_features: int


@dataclass(frozen=True, slots=True)
class LoRASite:
    layer: int
    role: str
    in_features: int
    parts: tuple[SitePart, ...]
    a_name: str        # graph weight names of the slot table
    b_name: str

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)


def _part_sizes(node: fx.Node, out_features: int, num_parts: int) -> tuple[int, ...] | None:
    """A fused linear's part widths, read from the split that follows it (gate/up, whose
    split silu_and_mul may have replaced, are two equal halves)."""
    if num_parts == 1:
        return (out_features,)
    for user in node.users:
        if user.target is ops.split_last and len(user.args[1]) == num_parts:
            return tuple(int(s) for s in user.args[1])
    if num_parts == 2 and out_features % 2 == 0:
        return (out_features // 2, out_features // 2)
    return None


def add_lora_sites(mg: ModelGraph, max_loras: int, max_rank: int, dtype: torch.dtype
                   ) -> tuple[ModelGraph, list[LoRASite]]:
    """Insert a lora_add after every targetable linear (see the module docstring); returns
    the graph and its sites in graph order."""
    g = mg.graph
    first = next(iter(g.nodes))
    with g.inserting_before(first):
        slots = g.placeholder(LORA_SLOTS_FEED)
    sites: list[LoRASite] = []
    for node in list(g.nodes):
        role = node.meta.get("role")
        if node.op != "call_function" or node.target not in LINEAR_OPS or role not in SITE_PARTS:
            continue
        layer = node.meta.get("layer")
        out_f, in_f = (int(s) for s in mg.weights[node.args[1].target].shape)
        modules = SITE_PARTS[role]
        sizes = _part_sizes(node, out_f, len(modules))
        if sizes is None or layer is None:
            continue
        parts, offset = [], 0
        for module, size in zip(modules, sizes):
            parts.append(SitePart(module, offset, size))
            offset += size
        stem = f"lora.{layer}.{role}"
        rank = len(modules) * max_rank
        mg.weights[f"{stem}.a"] = torch.zeros((max_loras, rank, in_f), dtype=dtype)
        mg.weights[f"{stem}.b"] = torch.zeros((max_loras, rank, out_f), dtype=dtype)
        with g.inserting_before(node):
            a, b = g.get_attr(f"{stem}.a"), g.get_attr(f"{stem}.b")
        with g.inserting_after(node):
            lora = g.call_function(ops.lora_add, (node.args[0], node, a, b, slots))
        lora.meta.update(role=f"lora_{role}", layer=layer, dims=tuple(sorted(
            {"in_features": in_f, "out_features": out_f, "slots": max_loras,
             "rank": rank}.items())))
        node.replace_all_uses_with(lora, delete_user_cb=lambda user: user is not lora)
        sites.append(LoRASite(int(layer), role, in_f, tuple(parts), f"{stem}.a", f"{stem}.b"))
    return mg, sites


def module_shapes(sites: list[LoRASite], spec: Any = None) -> dict[tuple[int, str],
                                                                   tuple[int, int]]:
    """(layer, PEFT module) -> (in_features, out_features) of the base model's linears at
    the sites; with `spec` (the whole model's ModelSpec, for a tensor-parallel rank whose
    sites are its shards) the whole model's shapes."""
    if spec is None:
        return {(s.layer, p.module): (s.in_features, p.out_features)
                for s in sites for p in s.parts}
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    full = {"q_proj": (h, spec.num_heads * hd), "k_proj": (h, spec.num_kv_heads * hd),
            "v_proj": (h, spec.num_kv_heads * hd), "o_proj": (spec.num_heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return {(s.layer, p.module): full[p.module] for s in sites for p in s.parts}


__all__ = ["LORA_SLOTS_FEED", "LoRASite", "SitePart", "add_lora_sites", "module_shapes"]
