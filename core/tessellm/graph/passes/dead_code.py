"""Remove nodes whose results nobody reads, then weights no get_attr node reads any more."""
from __future__ import annotations

from tessellm.graph.ir import ModelGraph


def remove_dead_code(mg: ModelGraph) -> ModelGraph:
    mg.graph.eliminate_dead_code()
    live = {n.target for n in mg.graph.nodes if n.op == "get_attr"}
    for name in [k for k in mg.weights if k not in live]:
        del mg.weights[name]
    return mg
