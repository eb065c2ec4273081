"""fuse_gate_up: a layer's gate and up linears become one linear over cat(gate, up)."""
from __future__ import annotations

import pytest
import torch
from graph_fixtures import LLAMA_FAMILY, make_model, run_graph, weight_readers

from tessellm.graph import ops
from tessellm.graph.passes.dead_code import remove_dead_code
from tessellm.graph.passes.fuse_linears import fuse_gate_up


def _roles(mg, role: str) -> list:
    return [n for n in mg.op_nodes(ops.linear) if n.meta.get("role") == role]


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_gate_up_fusion_rewrites_graph_and_weights(arch: str) -> None:
    model = make_model(arch)
    mg, spec = model.graph, model.spec
    L, I = spec.num_layers, spec.intermediate_size
    before = mg.count(ops.linear)
    mlp = "model.layers.{i}.mlp.{r}_proj.weight"
    originals = {i: torch.cat([mg.weights[mlp.format(i=i, r=r)] for r in ("gate", "up")])
                 for i in range(L)}

    fuse_gate_up(mg)
    mg.graph.lint()

    assert mg.count(ops.linear) == before - L
    assert not _roles(mg, "gate_proj") and not _roles(mg, "up_proj")
    fused = _roles(mg, "gate_up_proj")
    assert sorted(n.meta["layer"] for n in fused) == list(range(L))
    for node in fused:
        i = node.meta["layer"]
        assert node.args[1].target == f"gate_up_proj.{i}.weight"
        assert torch.equal(mg.weights[f"gate_up_proj.{i}.weight"], originals[i])
        assert node.args[2] is None
        assert dict(node.meta["dims"]) == {"in_features": spec.hidden_size,
                                           "out_features": 2 * I, "bias": 0}
        (split,) = node.users
        assert split.target is ops.split_last and split.args[1] == (I, I)
    # the activation is untouched: silu(gate half) * up half
    assert mg.count(ops.silu) == L and mg.count(ops.mul) == L
    assert mg.count(ops.silu_and_mul) == 0
    for mul in mg.op_nodes(ops.mul):
        act, up = mul.args
        assert act.target is ops.silu and act.args[0].args[1] == 0 and up.args[1] == 1

    stale = {mlp.format(i=i, r=r) for i in range(L) for r in ("gate", "up")}
    assert stale <= set(mg.weights)
    remove_dead_code(mg)
    assert not stale & (set(mg.weights) | weight_readers(mg))


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_gate_up_fusion_keeps_logits(arch: str) -> None:
    expected = run_graph(make_model(arch))
    model = make_model(arch)
    remove_dead_code(fuse_gate_up(model.graph))
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_gate_up_fusion_leaves_gpt2_alone() -> None:
    """GPT-2's MLP has one input linear (c_fc): nothing to fuse."""
    model = make_model("gpt2")
    before = [n.format_node() for n in model.graph.graph.nodes]
    weights = set(model.graph.weights)
    fuse_gate_up(model.graph)
    assert [n.format_node() for n in model.graph.graph.nodes] == before
    assert set(model.graph.weights) == weights


def test_gate_up_fusion_after_qkv_fusion_fuses_both() -> None:
    from tessellm.graph.passes.fuse_linears import fuse_qkv
    expected = run_graph(make_model("qwen2"))
    model = make_model("qwen2")
    mg = remove_dead_code(fuse_gate_up(fuse_qkv(model.graph)))
    L = model.spec.num_layers
    assert mg.count(ops.linear) == 4 * L + 1  # qkv, o, gate_up, down per layer; lm_head
    assert mg.count(ops.split_last) == 2 * L
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)
