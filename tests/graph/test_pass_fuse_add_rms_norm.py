"""fuse_add_rms_norm: rms_norm(add(a, b)) -> fused_add_rms_norm(a, b) -> (normed, sum).

Every residual add of a Llama-family graph feeds an rms_norm (the next layer's input norm, the
post-attention norm or the final norm), so all of them fuse; the residual stream then reads the
fused node's second output.
"""
from __future__ import annotations

import operator

import pytest
import torch
from graph_fixtures import LLAMA_FAMILY, make_model, run_graph

from tessellm.graph import ops
from tessellm.graph.passes.dead_code import remove_dead_code
from tessellm.graph.passes.fuse_add_rms_norm import fuse_add_rms_norm


def _item(fused, index: int):
    items = [u for u in fused.users if u.target is operator.getitem and u.args[1] == index]
    return items[0] if items else None


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_every_add_rms_norm_pair_fuses(arch: str) -> None:
    model = make_model(arch)
    mg, spec = model.graph, model.spec
    L = spec.num_layers
    qk_norms = 2 * L if spec.qk_norm else 0
    assert mg.count(ops.add) == 2 * L and mg.count(ops.rms_norm) == 2 * L + 1 + qk_norms
    adds = mg.op_nodes(ops.add)
    norm_weights = [u.args[1].target for a in adds for u in a.users if u.target is ops.rms_norm]
    assert len(norm_weights) == 2 * L

    fuse_add_rms_norm(mg)
    mg.graph.lint()

    fused = mg.op_nodes(ops.fused_add_rms_norm)
    assert len(fused) == 2 * L
    assert mg.count(ops.add) == 0
    # left: layer 0's input norm (reads the embedding) and the q/k norms
    assert mg.count(ops.rms_norm) == 1 + qk_norms
    assert [f.args[2].target for f in fused] == norm_weights
    assert all(f.args[3] == spec.norm_eps for f in fused)
    assert all(dict(f.meta["dims"]) == {"hidden": spec.hidden_size} for f in fused)
    assert [f.meta["role"] for f in fused[:2]] == ["add_post_attention_norm", "add_input_norm"]
    assert fused[-1].meta["role"] == "add_final_norm"

    # the residual stream: each fused node's residual input is the previous one's sum output
    assert fused[0].args[1].target is ops.embedding
    for prev, nxt in zip(fused, fused[1:]):
        assert nxt.args[1] is _item(prev, 1)
    # and the normed output is what the next projections read
    for f in fused:
        normed = _item(f, 0)
        assert normed is not None and normed.users
        assert all(u.target in (ops.linear, ops.select_rows) for u in normed.users)
    # the final sum is read by nobody; dead-code removal drops that getitem
    last_sum = _item(fused[-1], 1)
    assert last_sum is not None and not last_sum.users
    remove_dead_code(mg)
    assert _item(fused[-1], 1) is None


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_keeps_logits(arch: str) -> None:
    expected = run_graph(make_model(arch))
    model = make_model(arch)
    remove_dead_code(fuse_add_rms_norm(model.graph))
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_leaves_layer_norm_graphs_alone() -> None:
    """GPT-2 adds feed layer_norm, not rms_norm: nothing to fuse."""
    model = make_model("gpt2")
    before = [n.format_node() for n in model.graph.graph.nodes]
    fuse_add_rms_norm(model.graph)
    assert [n.format_node() for n in model.graph.graph.nodes] == before


def test_add_read_only_by_another_add_is_kept() -> None:
    """An add whose sum feeds no rms_norm stays an add."""
    model = make_model("llama")
    mg = model.graph
    final_norm = next(n for n in mg.op_nodes(ops.rms_norm) if n.meta["role"] == "final_norm")
    last_add = final_norm.args[0]
    with mg.graph.inserting_after(last_add):
        doubled = mg.graph.call_function(ops.add, (last_add, last_add))
    doubled.meta["dims"] = last_add.meta["dims"]
    final_norm.replace_input_with(last_add, doubled)
    expected = run_graph(model)

    fuse_add_rms_norm(mg)
    mg.graph.lint()
    assert mg.op_nodes(ops.add) == [last_add]  # its reader is `doubled`, which got fused
    assert final_norm not in mg.graph.nodes
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_sum_read_between_add_and_norm() -> None:
    """E.g. a plugin architecture that taps the residual stream right after the add."""
    model = make_model("llama")
    mg = model.graph
    final_norm = next(n for n in mg.op_nodes(ops.rms_norm) if n.meta["role"] == "final_norm")
    summed = final_norm.args[0]
    with mg.graph.inserting_before(summed.next):
        tap = mg.graph.call_function(ops.silu, (summed,))  # reads the sum before the norm
    tap.meta["dims"] = summed.meta["dims"]
    select = next(n for n in mg.graph.nodes if n.target is ops.select_rows)
    with mg.graph.inserting_before(select):
        joined = mg.graph.call_function(ops.add, (final_norm, tap))
    joined.meta["dims"] = summed.meta["dims"]
    select.replace_input_with(final_norm, joined)
    mg.graph.lint()
    expected = run_graph(model)

    fuse_add_rms_norm(mg)
    mg.graph.lint()
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)
