"""rms_norm(add(a, b)) -> fused_add_rms_norm(a, b) returning (normed, sum).

Every other reader of the sum (the next residual add) reads the fused node's second output, so
the sum is computed once. The fused node takes the add's place in the node order (readers of the
sum may sit between the add and the norm), reading its own get_attr of the norm weight. Applies
to every add whose result feeds an rms_norm whose weight is a get_attr.
"""
from __future__ import annotations

import operator

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph


def fuse_add_rms_norm(mg: ModelGraph) -> ModelGraph:
    g = mg.graph
    for norm in mg.op_nodes(ops.rms_norm):
        summed = norm.args[0]
        if getattr(summed, "target", None) is not ops.add:
            continue
        weight = norm.args[1]
        if getattr(weight, "op", None) != "get_attr":
            continue
        a, b = summed.args
        with g.inserting_before(summed.next):
            w = g.get_attr(weight.target)
            fused = g.call_function(ops.fused_add_rms_norm, (a, b, w, norm.args[2]))
            normed = g.call_function(operator.getitem, (fused, 0))
            new_sum = g.call_function(operator.getitem, (fused, 1))
        fused.meta.update(role=f"add_{norm.meta.get('role')}", layer=norm.meta.get("layer"),
                          dims=norm.meta["dims"])
        norm.replace_all_uses_with(normed)
        g.erase_node(norm)
        summed.replace_all_uses_with(new_sum)
        g.erase_node(summed)
    return mg
