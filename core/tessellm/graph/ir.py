"""The model graph: a torch.fx Graph over named values plus the weights it reads.

Conventions (relied on by passes and lowering):
- placeholders: `input_ids` [T], `positions` [T], `attn_meta` (AttentionMetadata),
  `logits_indices` [num_seqs_to_sample], and `kv_cache_<layer>` per layer; a hybrid model
  (block-table groups, tessellm.cache.kv_groups) has one `attn_meta_<group>` more per group
  after the first, read by that group's attention nodes (`StepPlaceholders.meta_of`);
- `get_attr` nodes name a key of `ModelGraph.weights`: a tensor, or a PackedWeight that only
  `linear_packed` / `embedding_packed` read (the builder picks the op from the weight);
- device-op nodes are call_function nodes whose target is in `graph.ops`; their
  `meta["dims"]` is the (name, size) tuple the kernel registry's KernelQuery needs, and
  `meta["role"]` / `meta["layer"]` say what they are (e.g. "q_proj", 3) for the passes;
- the single output is the logits [num_seqs_to_sample, vocab].
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from tessellm.graph import ops
from tessellm.graph.plan import KV_CACHE_FEED, attn_meta_feed
from tessellm.quant.formats import PackedWeight


@dataclass
class ModelGraph:
    graph: fx.Graph
    weights: dict[str, torch.Tensor | PackedWeight]
    num_layers: int

    def op_nodes(self, target: Callable | None = None) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function"
                and (ops.op_name(n.target) is not None if target is None else n.target is target)]

    def count(self, target: Callable) -> int:
        return len(self.op_nodes(target))


@dataclass(frozen=True)
class StepPlaceholders:
    """The placeholders every model graph has (see the module docstring)."""

    input_ids: fx.Node
    positions: fx.Node
    attn_meta: fx.Node
    logits_indices: fx.Node
    kv_caches: tuple[fx.Node, ...]
    layer_metas: tuple[fx.Node, ...]   # per layer: the metadata of its block-table group

    def meta_of(self, layer: int) -> fx.Node:
        """The attention metadata `layer`'s attention node reads."""
        return self.layer_metas[layer]


class GraphBuilder:
    """Emits nodes into a fresh fx.Graph; knows weight shapes to fill in kernel dims."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.graph = fx.Graph()
        self.weights = weights

    def input(self, name: str) -> fx.Node:
        return self.graph.placeholder(name)

    def step_inputs(self, num_layers: int, layer_groups: tuple[int, ...] = ()
                    ) -> StepPlaceholders:
        """`layer_groups`: each layer's block-table group (default: all in group 0)."""
        ids, positions, meta, logits = (self.input("input_ids"), self.input("positions"),
                                        self.input("attn_meta"), self.input("logits_indices"))
        caches = tuple(self.input(KV_CACHE_FEED.format(layer=i)) for i in range(num_layers))
        groups = {0: meta} | {g: self.input(attn_meta_feed(g))
                              for g in sorted(set(layer_groups)) if g}
        metas = tuple(groups[g] for g in layer_groups) if layer_groups else (meta,) * num_layers
        return StepPlaceholders(ids, positions, meta, logits, caches, metas)

    def weight(self, name: str) -> fx.Node:
        if name not in self.weights:
            raise KeyError(name)
        node = self.graph.get_attr(name)
        node.meta["shape"] = tuple(self.weights[name].shape)
        return node

    def op(self, target: Callable, *args: Any, dims: dict[str, int],
           role: str | None = None, layer: int | None = None) -> fx.Node:
        node = self.graph.call_function(target, tuple(args))
        node.meta["dims"] = tuple(sorted(dims.items()))
        if role is not None:
            node.meta["role"] = role
        if layer is not None:
            node.meta["layer"] = layer
        return node

    def linear(self, x: fx.Node, prefix: str, *, role: str, layer: int | None,
               bias: bool) -> fx.Node:
        weight = self.weights[prefix + ".weight"]
        w = self.weight(prefix + ".weight")
        b = self.weight(prefix + ".bias") if bias else None
        out_f, in_f = weight.shape
        return self.op(*linear_call(x, w, b, weight), dims=linear_dims(in_f, out_f, bias, weight),
                       role=role, layer=layer)

    def embedding(self, ids: fx.Node, name: str, *, role: str) -> fx.Node:
        weight = self.weights[name]
        vocab, hidden = weight.shape
        dims = {"vocab": int(vocab), "hidden": int(hidden)}
        if isinstance(weight, PackedWeight):
            return self.op(ops.embedding_packed, ids, self.weight(name),
                           dims={**dims, "qtype": weight.format.ggml_type}, role=role)
        return self.op(ops.embedding, ids, self.weight(name), dims=dims, role=role)

    def call(self, fn: Callable, *args: Any) -> fx.Node:
        return self.graph.call_function(fn, tuple(args))

    def item(self, node: fx.Node, index: int) -> fx.Node:
        return self.graph.call_function(operator.getitem, (node, index))

    def output(self, node: fx.Node) -> None:
        self.graph.output(node)


def linear_dims(in_f: int, out_f: int, bias: bool,
                weight: torch.Tensor | PackedWeight | None = None) -> dict[str, int]:
    """Kernel-query dims of a linear; a packed weight adds its GGML type as `qtype`."""
    dims = {"in_features": int(in_f), "out_features": int(out_f), "bias": int(bias)}
    if isinstance(weight, PackedWeight):
        dims["qtype"] = weight.format.ggml_type
    return dims


def linear_call(x: fx.Node, w: fx.Node, b: fx.Node | None,
                weight: torch.Tensor | PackedWeight) -> tuple[Any, ...]:
    """(target, *args) of a linear node reading `weight`: linear_packed for a packed one."""
    return (ops.linear_packed if isinstance(weight, PackedWeight) else ops.linear, x, w, b)
