"""remove_dead_code: drops nodes nobody reads, then weights no get_attr node reads."""
from __future__ import annotations

import pytest
import torch
from graph_fixtures import CONFIGS, make_model, run_graph, weight_readers

from tessellm.graph import ops
from tessellm.graph.ir import linear_dims
from tessellm.graph.passes.dead_code import remove_dead_code


def _snapshot(mg) -> tuple[list[str], set[str]]:
    return [n.format_node() for n in mg.graph.nodes], set(mg.weights)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_builders_leave_nothing_dead(arch: str) -> None:
    mg = make_model(arch).graph
    before = _snapshot(mg)
    remove_dead_code(mg)
    assert _snapshot(mg) == before
    assert weight_readers(mg) == set(mg.weights)


def test_drops_an_unused_node_and_its_weight() -> None:
    model = make_model("llama")
    mg = model.graph
    nodes_before, weights_before = _snapshot(mg)
    expected = run_graph(model)
    h = model.spec.hidden_size
    mg.weights["extra.weight"] = torch.randn(8, h)
    mg.weights["orphan.weight"] = torch.randn(3)  # read by no node at all
    x = mg.op_nodes(ops.embedding)[0]
    with mg.graph.inserting_before(x.next):
        w = mg.graph.get_attr("extra.weight")
        unused = mg.graph.call_function(ops.linear, (x, w, None))
    unused.meta["dims"] = tuple(sorted(linear_dims(h, 8, False).items()))
    assert mg.count(ops.linear) == 16

    remove_dead_code(mg)
    mg.graph.lint()

    assert unused not in mg.graph.nodes and w not in mg.graph.nodes
    assert "extra.weight" not in mg.weights and "orphan.weight" not in mg.weights
    assert _snapshot(mg) == (nodes_before, weights_before)
    torch.testing.assert_close(run_graph(model), expected, rtol=0, atol=0)


def test_drops_chains_of_dead_nodes() -> None:
    """A dead node's inputs that only it read are dead too."""
    model = make_model("llama")
    mg = model.graph
    nodes_before, weights_before = _snapshot(mg)
    x = mg.op_nodes(ops.embedding)[0]
    with mg.graph.inserting_before(x.next):
        a = mg.graph.call_function(ops.silu, (x,))
        b = mg.graph.call_function(ops.per_head, (a, 8))
        c = mg.graph.call_function(ops.merge_heads, (b,))
    remove_dead_code(mg)
    assert not {a, b, c} & set(mg.graph.nodes)
    assert _snapshot(mg) == (nodes_before, weights_before)


def test_keeps_every_graph_input() -> None:
    """Placeholders are the plan's inputs: even one nobody reads stays."""
    mg = make_model("gpt2").graph
    with mg.graph.inserting_after(next(n for n in mg.graph.nodes if n.op == "placeholder")):
        mg.graph.placeholder("unused_input")
    names = [n.target for n in mg.graph.nodes if n.op == "placeholder"]
    remove_dead_code(mg)
    assert [n.target for n in mg.graph.nodes if n.op == "placeholder"] == names
    assert {f"kv_cache_{i}" for i in range(mg.num_layers)} <= set(names)
