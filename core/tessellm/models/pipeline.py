"""Pipeline parallelism in the graph: each stage keeps a contiguous run of decoder layers.

The decoder layers split into P contiguous stages of balanced sizes (the first stages take
one more layer when P does not divide them). A stage's graph holds the nodes of its layers,
its layers' KV cache placeholders (renumbered from 0, so its KV pool and every per-layer list
are the stage's own) and the weights those nodes read; nothing else of the model.

Which stage a node belongs to: a node with `meta["layer"]` belongs to its layer's stage; a
node that reads only placeholders, weights and such nodes ("free": the token embedding and
what scales it) is copied into every stage that reads it; any other node goes with the
latest stage among its inputs (the final norm and the LM head: the last). Exactly one value
may cross each cut between stages, the hidden state (the residual stream): a stage after
the first reads it from the placeholder HIDDEN_FEED, a stage before the last returns it
instead of the logits. A graph with more than one value crossing a cut is refused.
The cut is made before the fusion passes, so no fused node straddles two stages.
"""
from __future__ import annotations

import torch.fx as fx

from tessellm.errors import ConfigError, UnsupportedModelError
from tessellm.graph.ir import ModelGraph
from tessellm.graph.plan import KV_CACHE_FEED

HIDDEN_FEED = "pp_hidden"   # a later stage's input: the previous stage's hidden state [T, H]
_FREE = -1


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The layers of `stage` (0-based) when `num_layers` split into `stages` balanced runs."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_stageable(num_layers: int, stages: int) -> None:
    """ConfigError unless every one of `stages` stages gets at least one layer."""
    if stages < 1:
        raise ConfigError(f"pipeline_parallel_size must be >= 1, got {stages}")
    if stages > num_layers:
        raise ConfigError(f"pipeline_parallel_size={stages} exceeds the model's {num_layers} "
                          "decoder layers (each stage needs at least one)")


def _stages_of(mg: ModelGraph, stages: int) -> dict[fx.Node, int]:
    """Each call node's stage (_FREE for free nodes); placeholders and weights are free."""
    layer_stage = {i: s for s in range(stages)
                   for i in stage_layers(mg.num_layers, stages, s)}
    of: dict[fx.Node, int] = {}
    for node in mg.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            of[node] = _FREE
        elif node.op == "call_function":
            layer = node.meta.get("layer")
            inputs = max((of[a] for a in node.all_input_nodes), default=_FREE)
            if layer is not None:
                if inputs > layer_stage[layer]:
                    raise UnsupportedModelError(f"pipeline parallelism: {node.format_node()} "
                                                f"of layer {layer} reads a later layer's value")
                of[node] = layer_stage[layer]
            else:
                of[node] = inputs
    return of


def stage_graph(mg: ModelGraph, stages: int, stage: int) -> ModelGraph:
    """Stage `stage`'s graph of `mg` (the whole model's, sharded or not)."""
    check_stageable(mg.num_layers, stages)
    if stages == 1:
        return mg
    of = _stages_of(mg, stages)
    layers = stage_layers(mg.num_layers, stages, stage)
    first, last = stage == 0, stage == stages - 1
    wanted = {n for n, s in of.items() if s == stage and n.op == "call_function"}
    # free nodes this stage reads (transitively)
    todo = [a for n in wanted for a in n.all_input_nodes if of[a] == _FREE]
    while todo:
        n = todo.pop()
        if n not in wanted:
            wanted.add(n)
            todo += n.all_input_nodes
    crossing_in = {a for n in wanted for a in n.all_input_nodes
                   if of[a] not in (_FREE, stage)}
    out_node = next(n for n in mg.graph.nodes if n.op == "output").args[0]
    crossing_out = {n for n in wanted if of[n] == stage and not last
                    and any(of[u] > stage for u in n.users if u.op == "call_function")}
    for name, nodes in (("into", crossing_in), ("out of", crossing_out)):
        if len(nodes) > 1:
            raise UnsupportedModelError(
                f"pipeline parallelism: {len(nodes)} values cross {name} stage {stage} "
                f"({', '.join(sorted(n.name for n in nodes))}); only the hidden state may")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if not first:
        (hidden,) = crossing_in
        env[hidden] = g.placeholder(HIDDEN_FEED)
    kv_names = {KV_CACHE_FEED.format(layer=i): KV_CACHE_FEED.format(layer=i - layers.start)
                for i in layers}
    for node in mg.graph.nodes:
        if node.op == "placeholder":
            if node.target.startswith("kv_cache_"):
                if node.target in kv_names:
                    env[node] = g.placeholder(kv_names[node.target])
            elif any(node in n.all_input_nodes for n in wanted):
                env[node] = g.placeholder(node.target)
        elif node in wanted or (node.op == "get_attr"
                                and any(node in n.all_input_nodes for n in wanted)):
            env[node] = g.node_copy(node, lambda a: env[a])
    g.output(env[out_node] if last else env[next(iter(crossing_out))])
    g.lint()
    used = {n.target for n in g.nodes if n.op == "get_attr"}
    return ModelGraph(g, {k: w for k, w in mg.weights.items() if k in used}, len(layers))
