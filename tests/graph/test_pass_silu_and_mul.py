"""fuse_silu_and_mul: mul(silu(x[:d]), x[d:]) of one split -> silu_and_mul(x).

It matches the halves of the fused gate/up output, so it applies only after gate/up fusion.
"""
from __future__ import annotations

import pytest
import torch
from graph_fixtures import LLAMA_FAMILY, make_model, run_graph

from tessellm.graph import ops
from tessellm.graph.passes.dead_code import remove_dead_code
from tessellm.graph.passes.fuse_linears import fuse_gate_up, fuse_qkv
from tessellm.graph.passes.fuse_silu_and_mul import fuse_silu_and_mul


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_applies_after_gate_up_fusion(arch: str) -> None:
    model = make_model(arch)
    mg, spec = model.graph, model.spec
    L = spec.num_layers
    fuse_gate_up(mg)

    fuse_silu_and_mul(mg)
    mg.graph.lint()

    assert mg.count(ops.silu_and_mul) == L
    assert mg.count(ops.silu) == 0 and mg.count(ops.mul) == 0
    for node in mg.op_nodes(ops.silu_and_mul):
        (x,) = node.args
        assert x.target is ops.linear and x.meta["role"] == "gate_up_proj"
        assert x.meta["layer"] == node.meta["layer"]
        assert dict(node.meta["dims"]) == {"features": spec.intermediate_size}
        (down,) = node.users
        assert down.meta["role"] == "down_proj"
    # the split and its getitems are now unread; dead-code removal drops them
    remove_dead_code(mg)
    assert mg.count(ops.split_last) == 0


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_keeps_logits(arch: str) -> None:
    expected = run_graph(make_model(arch))
    model = make_model(arch)
    remove_dead_code(fuse_silu_and_mul(fuse_gate_up(fuse_qkv(model.graph))))
    assert model.graph.count(ops.silu_and_mul) == model.spec.num_layers
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_does_not_apply_without_gate_up_fusion() -> None:
    model = make_model("llama")
    mg = model.graph
    before = [n.format_node() for n in mg.graph.nodes]
    fuse_silu_and_mul(mg)
    assert mg.count(ops.silu_and_mul) == 0
    assert [n.format_node() for n in mg.graph.nodes] == before


def test_does_not_apply_to_the_qkv_split() -> None:
    """Only a two-way split into equal halves matches; qkv's three-way split never does."""
    model = make_model("llama")
    mg = fuse_qkv(model.graph)
    (split, *_) = mg.op_nodes(ops.split_last)
    q, k = sorted(split.users, key=lambda n: n.args[1])[:2]
    with mg.graph.inserting_before(max(q, k, key=lambda n: list(mg.graph.nodes).index(n)).next):
        act = mg.graph.call_function(ops.silu, (q,))
        mul = mg.graph.call_function(ops.mul, (act, k))
    act.meta["dims"] = mul.meta["dims"] = (("features", 32),)
    mg.graph.lint()
    fuse_silu_and_mul(mg)
    assert mul in mg.graph.nodes and act in mg.graph.nodes


def test_keeps_silu_that_has_another_reader() -> None:
    """silu(gate) read elsewhere must survive, so the pattern is left as it is."""
    model = make_model("llama")
    mg = fuse_gate_up(model.graph)
    act = mg.op_nodes(ops.silu)[0]
    mul = next(iter(act.users))
    with mg.graph.inserting_after(mul):
        extra = mg.graph.call_function(ops.add, (act, mul))
    extra.meta["dims"] = mul.meta["dims"]
    mul.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    fuse_silu_and_mul(mg)
    mg.graph.lint()
    assert mg.count(ops.silu_and_mul) == model.spec.num_layers - 1
    assert act in mg.graph.nodes and mul in mg.graph.nodes
