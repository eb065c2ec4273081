"""Weight-only quantization at load: every dense linear (the LM head excepted) whose width is
a multiple of 32 becomes a linear_packed over its weight packed in one format (Q8_0 = "int8").

Runs after the fusion passes, so a fused qkv or gate/up weight is packed as one matrix; the
dense originals become unread and dead-code removal drops them. The LM head (and so a tied
embedding) stays dense, as in vLLM's weight-only schemes: it is the layer most sensitive to
quantization error.
"""
from __future__ import annotations

import logging

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph, linear_dims
from tessellm.quant.formats import PackedFormat, quantize

log = logging.getLogger(__name__)
KEEP_DENSE_ROLES = frozenset({"lm_head"})


def quantize_linears(mg: ModelGraph, fmt: PackedFormat) -> ModelGraph:
    g = mg.graph
    skipped = 0
    for node in mg.op_nodes(ops.linear):
        w_node = node.args[1]
        weight = mg.weights[w_node.target]
        if node.meta.get("role") in KEEP_DENSE_ROLES:
            continue
        if weight.shape[1] % fmt.block_weights:
            skipped += 1
            continue
        name = f"{w_node.target}.{fmt.name.lower()}"
        if name not in mg.weights:
            mg.weights[name] = quantize(weight, fmt, weight.dtype)
        with g.inserting_before(node):
            packed = g.get_attr(name)
        node.target = ops.linear_packed
        node.update_arg(1, packed)
        out_f, in_f = weight.shape
        node.meta["dims"] = tuple(sorted(linear_dims(in_f, out_f, node.args[2] is not None,
                                                     mg.weights[name]).items()))
    if skipped:
        log.info("quantize %s: %d linear(s) left dense (width not a multiple of %d)",
                 fmt.name, skipped, fmt.block_weights)
    return mg
