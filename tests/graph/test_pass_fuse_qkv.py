"""fuse_qkv: the q/k/v linears of a layer become one linear over the concatenated weights.

Shown per family: Llama (no bias), Qwen2 (q/k/v bias only), Qwen3 (q/k norm after the split)
and GPT-2 (bias everywhere, split from c_attn at load and fused again here).
"""
from __future__ import annotations

import operator

import pytest
import torch
from graph_fixtures import LLAMA_FAMILY, make_model, run_graph, weight_readers

from tessellm.graph import ops
from tessellm.graph.passes.dead_code import remove_dead_code
from tessellm.graph.passes.fuse_linears import fuse_qkv

ATTN_PREFIX = {"llama": "model.layers.{i}.self_attn", "qwen2": "model.layers.{i}.self_attn",
               "qwen3": "model.layers.{i}.self_attn", "gpt2": "h.{i}.attn"}


def _roles(mg, role: str) -> list:
    return [n for n in mg.op_nodes(ops.linear) if n.meta.get("role") == role]


@pytest.mark.parametrize("arch", [*LLAMA_FAMILY, "gpt2"])
def test_qkv_fusion_rewrites_graph_and_weights(arch: str) -> None:
    model = make_model(arch)
    mg, spec = model.graph, model.spec
    L = spec.num_layers
    linears_before = mg.count(ops.linear)
    originals = {i: {r: mg.weights[f"{ATTN_PREFIX[arch].format(i=i)}.{r}_proj.weight"].clone()
                     for r in "qkv"} for i in range(L)}
    has_bias = spec.qkv_bias

    fuse_qkv(mg)
    mg.graph.lint()

    assert mg.count(ops.linear) == linears_before - 2 * L
    assert mg.count(ops.split_last) == L
    assert not _roles(mg, "q_proj") and not _roles(mg, "k_proj") and not _roles(mg, "v_proj")
    fused = _roles(mg, "qkv_proj")
    assert sorted(n.meta["layer"] for n in fused) == list(range(L))
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for node in fused:
        i = node.meta["layer"]
        w = mg.weights[node.args[1].target]
        assert torch.equal(w, torch.cat([originals[i][r] for r in "qkv"]))
        assert dict(node.meta["dims"]) == {"in_features": spec.hidden_size,
                                           "out_features": q_out + 2 * kv_out,
                                           "bias": int(has_bias)}
        assert (node.args[2] is not None) == has_bias
        (split,) = node.users
        assert split.target is ops.split_last and split.args[1] == (q_out, kv_out, kv_out)
        assert sorted(u.args[1] for u in split.users) == [0, 1, 2]
        assert all(u.target is operator.getitem for u in split.users)
    if has_bias:
        for i in range(L):
            p = ATTN_PREFIX[arch].format(i=i)
            assert torch.equal(mg.weights[f"qkv_proj.{i}.bias"],
                               torch.cat([mg.weights[f"{p}.{r}_proj.bias"] for r in "qkv"]))
    else:
        assert not any(name.startswith("qkv_proj") and name.endswith("bias")
                       for name in mg.weights)

    # the originals are still held (dead) until dead-code removal drops them
    stale = {f"{ATTN_PREFIX[arch].format(i=i)}.{r}_proj.{kind}" for i in range(L) for r in "qkv"
             for kind in (("weight", "bias") if has_bias else ("weight",))}
    assert stale <= set(mg.weights)
    remove_dead_code(mg)
    assert not stale & set(mg.weights)
    assert not stale & weight_readers(mg)
    assert {f"qkv_proj.{i}.weight" for i in range(L)} <= set(mg.weights)


@pytest.mark.parametrize("arch", [*LLAMA_FAMILY, "gpt2"])
def test_qkv_fusion_keeps_logits(arch: str) -> None:
    expected = run_graph(make_model(arch))
    model = make_model(arch)
    remove_dead_code(fuse_qkv(model.graph))
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_qkv_fusion_skips_a_layer_whose_siblings_disagree_on_bias() -> None:
    model = make_model("qwen2")
    mg = model.graph
    k0 = next(n for n in _roles(mg, "k_proj") if n.meta["layer"] == 0)
    k0.args = (k0.args[0], k0.args[1], None)  # layer 0: q and v have a bias, k has none
    expected = run_graph(model)

    fuse_qkv(mg)
    mg.graph.lint()
    assert [n.meta["layer"] for n in _roles(mg, "qkv_proj")] == [1]
    assert [n.meta["layer"] for n in _roles(mg, "k_proj")] == [0]
    assert "qkv_proj.0.weight" not in mg.weights
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_qkv_fusion_is_idempotent() -> None:
    model = make_model("llama")
    fuse_qkv(model.graph)
    n_nodes = len(model.graph.graph.nodes)
    fuse_qkv(model.graph)
    assert len(model.graph.graph.nodes) == n_nodes
    assert len(_roles(model.graph, "qkv_proj")) == model.spec.num_layers
