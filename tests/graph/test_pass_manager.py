"""run_passes: passes run in order; a fusion whose op the device lacks is skipped, with why."""
from __future__ import annotations

import pytest
import torch
from graph_fixtures import (LLAMA_FAMILY, REF_DEVICE, make_model, reference_registry,
                            run_graph, weight_readers)

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph
from tessellm.graph.passes import GraphPass, default_passes, run_passes
from tessellm.graph.passes.fuse_linears import fuse_gate_up
from tessellm.graph.passes.fuse_silu_and_mul import fuse_silu_and_mul

DEFAULT_ORDER = ["fuse_qkv", "fuse_gate_up", "fuse_silu_and_mul", "fuse_add_rms_norm",
                 "remove_dead_code"]


def _has_kernel(skip: tuple[str, ...] = ()):
    registry = reference_registry(skip)
    return lambda op: registry.has_op(REF_DEVICE, op)


def _snapshot(mg: ModelGraph) -> tuple[list[str], set[str]]:
    return [n.format_node() for n in mg.graph.nodes], set(mg.weights)


def test_default_passes_order_and_requirements() -> None:
    passes = default_passes()
    assert [p.name for p in passes] == DEFAULT_ORDER
    assert {p.name: p.requires for p in passes} == {
        "fuse_qkv": ("linear",), "fuse_gate_up": ("linear",),
        "fuse_silu_and_mul": ("silu_and_mul",), "fuse_add_rms_norm": ("fused_add_rms_norm",),
        "remove_dead_code": ()}


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_all_default_passes_on_a_full_device(arch: str) -> None:
    expected = run_graph(make_model(arch))
    model = make_model(arch)
    L = model.spec.num_layers
    mg, report = run_passes(model.graph, default_passes(), _has_kernel())
    assert report.applied == DEFAULT_ORDER and report.skipped == {}
    assert mg.count(ops.linear) == 4 * L + 1
    assert mg.count(ops.split_last) == L  # qkv's; gate/up's went with silu_and_mul
    assert mg.count(ops.silu_and_mul) == L
    assert mg.count(ops.fused_add_rms_norm) == 2 * L
    assert mg.count(ops.add) == mg.count(ops.mul) == mg.count(ops.silu) == 0
    assert weight_readers(mg) == set(mg.weights)
    model.graph = mg
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_fusion_skipped_when_device_lacks_its_kernel() -> None:
    model = make_model("llama")
    mg0 = model.graph
    before = _snapshot(mg0)
    fuse_pass = next(p for p in default_passes() if p.name == "fuse_add_rms_norm")
    mg, report = run_passes(mg0, [fuse_pass], _has_kernel(skip=("fused_add_rms_norm",)))
    assert report.applied == []
    assert report.skipped == {"fuse_add_rms_norm": "device has no kernel for fused_add_rms_norm"}
    assert _snapshot(mg) == before


def test_skipped_fusion_leaves_its_pattern_while_others_apply() -> None:
    expected = run_graph(make_model("qwen3"))
    model = make_model("qwen3")
    L = model.spec.num_layers
    mg, report = run_passes(model.graph, default_passes(),
                            _has_kernel(skip=("fused_add_rms_norm", "silu_and_mul")))
    assert report.applied == ["fuse_qkv", "fuse_gate_up", "remove_dead_code"]
    assert report.skipped == {
        "fuse_silu_and_mul": "device has no kernel for silu_and_mul",
        "fuse_add_rms_norm": "device has no kernel for fused_add_rms_norm"}
    assert mg.count(ops.fused_add_rms_norm) == mg.count(ops.silu_and_mul) == 0
    assert mg.count(ops.add) == 2 * L and mg.count(ops.silu) == mg.count(ops.mul) == L
    assert mg.count(ops.split_last) == 2 * L
    # the lowered graph holds no op the device lacks
    model.graph = mg
    torch.testing.assert_close(run_graph(model), expected, rtol=1e-5, atol=1e-5)


def test_skip_reason_names_every_missing_op() -> None:
    p = GraphPass("needs_two", lambda mg: mg, ("rms_norm", "fancy_op", "other_op"))
    _, report = run_passes(make_model("llama").graph, [p], _has_kernel())
    assert report.skipped == {"needs_two": "device has no kernel for fancy_op, other_op"}


def test_passes_run_in_the_given_order() -> None:
    calls: list[str] = []
    asked: list[str] = []

    def recorder(name: str):
        def run(mg: ModelGraph) -> ModelGraph:
            calls.append(name)
            return mg
        return run

    passes = [GraphPass("c", recorder("c")), GraphPass("a", recorder("a"), ("linear",)),
              GraphPass("missing", recorder("missing"), ("nope",)), GraphPass("b", recorder("b"))]
    has = _has_kernel()
    _, report = run_passes(make_model("llama").graph, passes,
                           lambda op: asked.append(op) or has(op))
    assert calls == ["c", "a", "b"]
    assert report.applied == ["c", "a", "b"] and list(report.skipped) == ["missing"]
    assert asked == ["linear", "nope"]


def test_silu_and_mul_before_gate_up_finds_nothing() -> None:
    """Order matters: silu_and_mul matches the halves gate/up fusion leaves behind."""
    passes = [GraphPass("fuse_silu_and_mul", fuse_silu_and_mul, ("silu_and_mul",)),
              GraphPass("fuse_gate_up", fuse_gate_up, ("linear",))]
    mg, report = run_passes(make_model("llama").graph, passes, _has_kernel())
    assert report.applied == ["fuse_silu_and_mul", "fuse_gate_up"]
    assert mg.count(ops.silu_and_mul) == 0 and mg.count(ops.silu) == mg.num_layers


def test_a_pass_that_breaks_the_graph_is_caught() -> None:
    """The manager lints after every pass: a node reading a later node is refused."""
    def breaks(mg: ModelGraph) -> ModelGraph:
        first = next(n for n in mg.op_nodes())
        last = mg.op_nodes()[-1]
        first.args = (last, *first.args[1:])
        return mg

    with pytest.raises(RuntimeError):
        run_passes(make_model("llama").graph, [GraphPass("breaks", breaks)], _has_kernel())
