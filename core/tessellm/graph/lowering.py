"""Lowering: bind every node of a ModelGraph to what runs it, yielding an ExecutionPlan.

Device ops become KernelSites: on the first call in a new token bucket the site asks the
KernelSelector for (op, dtype, bucket, dims) and then calls that kernel for every later call in
the bucket. The attention composite becomes an AttentionSite (cache write, then the decode and
prefill kernels on their parts of the batch). Structural helpers run as they are.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from tessellm.errors import KernelError
from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph
from tessellm.graph.plan import ExecutionPlan, Instruction, Slot
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.kernels.profiler import KernelSelector, token_bucket
from tessellm.kernels.registry import KernelQuery


class KernelSite:
    """One device-op node; the row count of its first argument picks the token bucket."""

    __slots__ = ("op", "dtype", "dims", "selector", "_by_bucket")

    def __init__(self, op: str, dtype: torch.dtype, dims: tuple, selector: KernelSelector) -> None:
        self.op, self.dtype, self.dims, self.selector = op, dtype, dims, selector
        self._by_bucket: dict[int, Any] = {}

    def fn_for(self, num_tokens: int):
        bucket = token_bucket(num_tokens)
        fn = self._by_bucket.get(bucket)
        if fn is None:
            query = KernelQuery(self.op, self.dtype, bucket, self.dims)
            fn = self._by_bucket[bucket] = self.selector.select(query).fn
        return fn

    def __call__(self, *args: Any) -> Any:
        return self.fn_for(args[0].shape[0])(*args)

    def choose(self, num_tokens: int) -> tuple[str, str]:
        """Select (profiling if needed) the kernel of a bucket now: (bucket key, kernel)."""
        bucket = token_bucket(num_tokens)
        query = KernelQuery(self.op, self.dtype, bucket, self.dims)
        kernel = self.selector.select(query)
        self._by_bucket.setdefault(bucket, kernel.fn)
        return query.bucket_key, kernel.name


class AttentionSite:
    """write_kv_cache for all tokens, then decode and prefill kernels on their rows."""

    __slots__ = ("write", "decode", "prefill", "_meta", "_parts")

    def __init__(self, dtype: torch.dtype, dims: tuple, selector: KernelSelector) -> None:
        kv_dims = tuple((k, v) for k, v in dims if k != "num_heads")
        self.write = KernelSite("write_kv_cache", dtype, kv_dims, selector)
        self.decode = KernelSite("attention_decode", dtype, dims, selector)
        self.prefill = KernelSite("attention_prefill", dtype, dims, selector)
        self._meta: AttentionMetadata | None = None
        self._parts: tuple[AttentionMetadata, AttentionMetadata] | None = None

    def __call__(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        self.write(k, v, kv_cache, meta.slot_mapping)
        if meta.num_prefills == 0:
            return self.decode(q, kv_cache, meta, scale)
        if meta.num_decodes == 0:
            return self.prefill(q, kv_cache, meta, scale)
        if meta is not self._meta:  # split once per step, reused by every layer
            self._meta, self._parts = meta, (meta.decode_part(), meta.prefill_part())
        dec, pre = self._parts
        nd = meta.num_decode_tokens
        return torch.cat((self.decode(q[:nd], kv_cache, dec, scale),
                          self.prefill(q[nd:], kv_cache, pre, scale)))


def select_all_kernels(plan: ExecutionPlan, num_tokens: int, max_seqs: int) -> dict[str, str]:
    """Choose every site's kernel for a step of `num_tokens` tokens (decode attention for at
    most `max_seqs` sequences); returns {bucket key: kernel name}."""
    choices: dict[str, str] = {}
    for ins in plan.instructions:
        site = ins.fn
        if isinstance(site, KernelSite):
            sites = [(site, num_tokens)]
        elif isinstance(site, AttentionSite):
            sites = [(site.write, num_tokens), (site.prefill, num_tokens),
                     (site.decode, min(num_tokens, max_seqs))]
        else:
            continue
        for s, n in sites:
            key, name = s.choose(n)
            choices[key] = name
    return choices


def _bind(node: fx.Node, dtype: torch.dtype, selector: KernelSelector):
    name = ops.op_name(node.target)
    if name == "attention":
        return AttentionSite(dtype, node.meta["dims"], selector)
    if name is not None:
        return KernelSite(name, dtype, node.meta["dims"], selector)
    if node.target in (operator.getitem, ops.split_last, ops.per_head, ops.merge_heads,
                       ops.select_rows):
        return node.target
    raise KernelError(f"cannot lower node {node.format_node()}: unknown target")


def lower(mg: ModelGraph, selector: KernelSelector, dtype: torch.dtype) -> ExecutionPlan:
    slot_of: dict[fx.Node, int] = {}
    inputs: dict[str, int] = {}
    constants: dict[int, Any] = {}
    pending: list[tuple[fx.Node, Any]] = []
    output = -1
    for node in mg.graph.nodes:
        if node.op == "output":
            output = slot_of[node.args[0]]
            continue
        slot_of[node] = len(slot_of)
        if node.op == "placeholder":
            inputs[node.target] = slot_of[node]
        elif node.op == "get_attr":
            constants[slot_of[node]] = mg.weights[node.target]
        elif node.op == "call_function":
            pending.append((node, _bind(node, dtype, selector)))
        else:
            raise KernelError(f"cannot lower node kind {node.op!r}")
    last_use: dict[int, int] = {}
    for idx, (node, _) in enumerate(pending):
        last_use[slot_of[node]] = idx  # a result nobody reads is released at once
    for idx, (node, _) in enumerate(pending):
        for a in node.all_input_nodes:
            if a.op == "call_function":
                last_use[slot_of[a]] = idx
    release: dict[int, list[int]] = {}
    for slot, idx in last_use.items():
        if slot != output:
            release.setdefault(idx, []).append(slot)
    instructions = []
    for idx, (node, fn) in enumerate(pending):
        args = tuple(Slot(slot_of[a]) if isinstance(a, fx.Node) else a for a in node.args)
        if any(isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a)
               for a in node.args):
            raise KernelError(f"nested node arguments are not supported: {node.format_node()}")
        instructions.append(Instruction(fn, args, slot_of[node], tuple(release.get(idx, ())),
                                        node.format_node()))
    return ExecutionPlan(instructions, len(slot_of), inputs, constants, output)
