"""Tensor parallelism in the graph (Megatron's split): each rank builds the graph of its shard.

From the full graph's node roles each weight gets a split:
- column-parallel (q/k/v, gate/up, GPT-2's fc): the rank's rows of the output features, by
  head for attention (a rank holds heads [r*H/w, (r+1)*H/w) and the KV heads they read: split
  when the KV heads divide over the ranks, else each rank keeps a copy of its group's one);
- row-parallel (o, down): the matching columns of the input features; the bias stays on rank
  0 (zeros elsewhere) and an all_reduce after the linear sums the partial outputs;
- vocab-parallel (the token embedding and the LM head, tied or not): rows
  [r*Vp, (r+1)*Vp) of the vocabulary, Vp = ceil(V / w), padded with zero rows; the embedding
  looks up the ids it holds, zeroes the others and all-reduces, the LM head's logits are
  gathered over the ranks and cut back to V columns;
- mixtures of experts: every rank holds every expert's slice of the expert features (the
  gate and up rows, the down columns of each expert, like a dense MLP's) and all-reduces the
  experts' sum; the shared expert splits like a dense MLP; the router and the shared expert's
  gate are replicated, so every rank routes alike. Expert parallelism (whole experts per
  rank) is not built;
- everything else (norms, GPT-2's position table, the rope table) is replicated.
Then the architecture's own builder builds the rank's graph from the rank's spec (heads, KV
heads and intermediate size per rank) and weights, so every kernel dim is the shard's, and the
collectives are inserted. The fusion passes run on the sharded graph afterwards.
A shape the ranks cannot split is a ConfigError before any rank builds anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.fx as fx

from tessellm.errors import ConfigError, UnsupportedModelError
from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph
from tessellm.models.spec import ModelSpec
from tessellm.quant.formats import PackedWeight, row_bytes

Weight = torch.Tensor | PackedWeight
BuildGraph = Callable[[ModelSpec, dict[str, Any]], ModelGraph]

HEAD_ROWS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}   # column-parallel by head
FEATURE_ROWS = {"gate_proj": "features", "up_proj": "features", "fc": "features",
                "shared_gate_proj": "shared", "shared_up_proj": "shared"}   # by feature
ROW_PARALLEL = {"o_proj": "q", "down_proj": "features",       # input columns split
                "shared_down_proj": "shared"}
REPLICATED = ("router", "shared_expert_gate")                 # every rank the whole weight
EXPERT_OPS = (ops.fused_moe, ops.fused_moe_packed, ops.fused_moe_packed_q8act)
EMBED, LM_HEAD, POS_EMBED = "embed", "lm_head", "pos_embed"


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `world`: which heads, KV heads, features and vocabulary rows it holds."""

    rank: int
    world: int
    spec: ModelSpec            # the full model's

    @property
    def heads(self) -> int:
        return self.spec.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.spec.num_kv_heads // self.world)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds: its query heads' group when replicated."""
        if self.spec.num_kv_heads >= self.world:
            return self.rank * self.kv_heads
        return self.rank * self.heads // (self.spec.num_heads // self.spec.num_kv_heads)

    @property
    def vocab_rows(self) -> int:
        return math.ceil(self.spec.vocab_size / self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_spec(self) -> ModelSpec:
        moe = self.spec.moe
        if moe is not None:
            moe = replace(moe, expert_intermediate_size=moe.expert_intermediate_size // self.world,
                          shared_expert_intermediate_size=(
                              moe.shared_expert_intermediate_size // self.world))
        return replace(self.spec, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.spec.intermediate_size // self.world, moe=moe)


def check_shardable(spec: ModelSpec, world: int) -> None:
    """ConfigError unless `world` ranks can split this model."""
    if world == 1:
        return
    problems = []
    if spec.num_heads % world:
        problems.append(f"{spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv % world and world % kv:
        problems.append(f"{kv} KV heads (neither divisible by the ranks nor dividing them)")
    if spec.intermediate_size % world:
        problems.append(f"intermediate size {spec.intermediate_size}")
    if spec.moe is not None:
        for name, size in (("expert intermediate size", spec.moe.expert_intermediate_size),
                           ("shared expert intermediate size",
                            spec.moe.shared_expert_intermediate_size)):
            if size % world:
                problems.append(f"{name} {size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size={world} cannot split {spec.architecture}: "
                          f"{'; '.join(problems)} not divisible by {world}")


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, PackedWeight):
        return w.with_data(w.data[start:stop].contiguous())
    return w[start:stop].contiguous()


def _columns(w: Weight, start: int, stop: int, name: str) -> Weight:
    if isinstance(w, PackedWeight):
        bw = w.format.block_weights
        if start % bw or stop % bw:
            raise ConfigError(f"tensor parallelism: {name} is packed ({w.format.name}) in "
                              f"blocks of {bw} input features; the split at {start}:{stop} "
                              "cuts a block (use quantization='none')")
        per = w.format.block_bytes
        data = w.data[:, start // bw * per:stop // bw * per].contiguous()
        assert data.shape[1] == row_bytes(w.format, stop - start)
        return PackedWeight(data, w.format, stop - start, w.compute_dtype)
    return w[:, start:stop].contiguous()


def _vocab_rows(w: Weight, shard: Shard) -> Weight:
    start, size = shard.vocab_start, shard.vocab_rows
    part = _rows(w, min(start, w.shape[0]), min(start + size, w.shape[0]))
    missing = size - part.shape[0]
    if missing == 0:
        return part
    if isinstance(part, PackedWeight):   # zero bytes dequantize to zero in every format
        pad = torch.zeros((missing, part.data.shape[1]), dtype=torch.uint8)
        return part.with_data(torch.cat((part.data, pad)))
    return torch.cat((part, part.new_zeros((missing, part.shape[1]))))


def _range(shard: Shard, unit: str) -> tuple[int, int]:
    """[start, stop) of the output rows (column-parallel) or input columns (row-parallel)."""
    d = shard.spec.head_dim
    if unit == "q":
        return shard.rank * shard.heads * d, (shard.rank + 1) * shard.heads * d
    if unit == "kv":
        return shard.kv_head_start * d, (shard.kv_head_start + shard.kv_heads) * d
    size = (shard.spec.moe.shared_expert_intermediate_size if unit == "shared"
            else shard.spec.intermediate_size)
    per = size // shard.world
    return shard.rank * per, (shard.rank + 1) * per


def _linear_nodes(mg: ModelGraph) -> list[fx.Node]:
    return mg.op_nodes(ops.linear) + mg.op_nodes(ops.linear_packed)


def _expert_nodes(mg: ModelGraph) -> list[fx.Node]:
    return [n for target in EXPERT_OPS for n in mg.op_nodes(target)]


def _expert_feature_rows(w13: Weight, shard: Shard) -> Weight:
    """The rank's gate rows and up rows of every expert, stacked as the experts' are."""
    moe = shard.spec.moe
    inter, per = moe.expert_intermediate_size, moe.expert_intermediate_size // shard.world
    first = torch.arange(shard.rank * per, (shard.rank + 1) * per)
    index = torch.cat([torch.cat((first + e * 2 * inter, first + e * 2 * inter + inter))
                       for e in range(moe.num_experts)])
    if isinstance(w13, PackedWeight):
        return w13.rows(index)
    return w13.index_select(0, index).contiguous()


def _expert_columns(w2: Weight, shard: Shard, name: str) -> Weight:
    per = shard.spec.moe.expert_intermediate_size // shard.world
    return _columns(w2, shard.rank * per, (shard.rank + 1) * per, name)


def shard_weights(full: ModelGraph, shard: Shard) -> dict[str, Weight]:
    """The rank's weights, by the graph's names (each weight split by the role that reads it)."""
    split: dict[str, Callable[[Weight], Weight]] = {}

    def assign(name: str, fn: Callable[[Weight], Weight]) -> None:
        split.setdefault(name, fn)   # a tied LM head and embedding split alike

    for node in _linear_nodes(full):
        role = node.meta.get("role")
        w_name = node.args[1].target
        b_name = node.args[2].target if node.args[2] is not None else None
        if role in HEAD_ROWS or role in FEATURE_ROWS:
            lo, hi = _range(shard, HEAD_ROWS.get(role) or FEATURE_ROWS[role])
            assign(w_name, lambda w, lo=lo, hi=hi: _rows(w, lo, hi))
            if b_name:
                assign(b_name, lambda b, lo=lo, hi=hi: b[lo:hi].contiguous())
        elif role in ROW_PARALLEL:
            lo, hi = _range(shard, ROW_PARALLEL[role])
            assign(w_name, lambda w, lo=lo, hi=hi, n=w_name: _columns(w, lo, hi, n))
            if b_name:
                assign(b_name, lambda b: b.clone() if shard.rank == 0 else torch.zeros_like(b))
        elif role == LM_HEAD:
            assign(w_name, lambda w: _vocab_rows(w, shard))
            if b_name:
                raise UnsupportedModelError("tensor parallelism: an LM head with a bias")
        elif role in REPLICATED:
            continue
        else:
            raise UnsupportedModelError(f"tensor parallelism: a linear with role {role!r} "
                                        "has no sharding rule")
    for node in _expert_nodes(full):
        assign(node.args[1].target, lambda w: _expert_feature_rows(w, shard))
        assign(node.args[2].target, lambda w, n=node.args[2].target: _expert_columns(
            w, shard, n))
    for node in full.op_nodes(ops.embedding) + full.op_nodes(ops.embedding_packed):
        if node.meta.get("role") == EMBED:
            assign(node.args[1].target, lambda w: _vocab_rows(w, shard))
        elif node.meta.get("role") != POS_EMBED:
            raise UnsupportedModelError(f"tensor parallelism: an embedding with role "
                                        f"{node.meta.get('role')!r} has no sharding rule")
    return {name: split[name](w) if name in split else w for name, w in full.weights.items()}


def shard_lora_weights(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                       shard: Shard) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA adapter's (A [r, in], B [out, r]) per (layer, module) as this rank holds them,
    split like their base linears: a column-parallel module keeps A whole and the B rows of
    the rank's outputs; a row-parallel one the A columns of the rank's inputs and B whole
    (its term over the rank's inputs is partial, like the base linear's output, and the
    all_reduce after the linear sums both)."""
    out = {}
    for (layer, module), (a, b) in weights.items():
        unit = HEAD_ROWS.get(module) or FEATURE_ROWS.get(module)
        if unit is not None:
            lo, hi = _range(shard, unit)
            b = b[lo:hi].contiguous()
        elif module in ROW_PARALLEL:
            lo, hi = _range(shard, ROW_PARALLEL[module])
            a = a[:, lo:hi].contiguous()
        else:
            raise UnsupportedModelError(f"tensor parallelism: LoRA on module {module!r} has "
                                        "no sharding rule")
        out[(layer, module)] = (a, b)
    return out


def _insert_after(g: fx.Graph, node: fx.Node, make: Callable[[fx.Node], fx.Node]) -> None:
    """Route every user of `node` through the node(s) `make` builds on it."""
    users = list(node.users)
    with g.inserting_before(node.next):   # in creation order, right after `node`
        new = make(node)
    for user in users:
        user.replace_input_with(node, new)


def insert_collectives(mg: ModelGraph, shard: Shard) -> ModelGraph:
    g, vocab = mg.graph, shard.spec.vocab_size
    start, size = shard.vocab_start, shard.vocab_rows
    for node in _linear_nodes(mg):
        role = node.meta.get("role")
        if role in ROW_PARALLEL:
            _insert_after(g, node, lambda n: g.call_function(ops.all_reduce, (n,)))
        elif role == LM_HEAD:
            _insert_after(g, node, lambda n: g.call_function(
                ops.narrow_last, (g.call_function(ops.all_gather_last, (n,)), vocab)))
    for node in _expert_nodes(mg):
        _insert_after(g, node, lambda n: g.call_function(ops.all_reduce, (n,)))
    for node in mg.op_nodes(ops.embedding) + mg.op_nodes(ops.embedding_packed):
        if node.meta.get("role") != EMBED:
            continue
        ids = node.args[0]
        with g.inserting_before(node):
            local = g.call_function(ops.local_vocab_ids, (ids, start, size))
        node.args = (local, *node.args[1:])
        _insert_after(g, node, lambda n: g.call_function(ops.all_reduce, (
            g.call_function(ops.mask_foreign_rows, (n, ids, start, size)),)))
    g.lint()
    return mg


def shard_model(full: ModelGraph, spec: ModelSpec, build_graph: BuildGraph, rank: int,
                world: int) -> tuple[ModelGraph, ModelSpec]:
    """Rank `rank`'s graph (built by the architecture's builder from its shard) and its spec."""
    check_shardable(spec, world)
    shard = Shard(rank, world, spec)
    local_spec = shard.local_spec()
    return insert_collectives(build_graph(local_spec, shard_weights(full, shard)), shard), \
        local_spec

