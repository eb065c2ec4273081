"""mul(silu(a), b) -> silu_and_mul(x) when a and b are the two equal halves of one split of x
(the shape the gate/up fusion leaves behind); without gate/up fusion it does not apply."""
from __future__ import annotations

import operator

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph


def _halves_of(a, b):
    """The split tensor x if a == x[:d] and b == x[d:] of one split_last, else None."""
    if not (a.target is operator.getitem and b.target is operator.getitem):
        return None
    split = a.args[0]
    if split is not b.args[0] or split.target is not ops.split_last:
        return None
    sizes = split.args[1]
    if len(sizes) != 2 or sizes[0] != sizes[1] or (a.args[1], b.args[1]) != (0, 1):
        return None
    return split.args[0]


def fuse_silu_and_mul(mg: ModelGraph) -> ModelGraph:
    g = mg.graph
    for mul in mg.op_nodes(ops.mul):
        act, other = mul.args
        if act.target is not ops.silu or len(act.users) != 1:
            continue
        x = _halves_of(act.args[0], other)
        if x is None:
            continue
        with g.inserting_before(mul):
            fused = g.call_function(ops.silu_and_mul, (x,))
        fused.meta.update(role="act", layer=mul.meta.get("layer"), dims=mul.meta["dims"])
        mul.replace_all_uses_with(fused)
        g.erase_node(mul)
        g.erase_node(act)
    return mg
