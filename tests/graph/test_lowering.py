"""lower(): every node bound to what runs it; slots released after their last reader; kernels
chosen once per token bucket; the attention composite split into decode and prefill parts."""
from __future__ import annotations

import gc
import operator
import weakref

import pytest
import torch
from graph_fixtures import (BLOCK_SIZE, CONFIGS, REF_DEVICE, TinyModel, kv_caches,
                            lower_reference, make_model, metadata, prefill_feeds, prompt,
                            reference_registry, run_graph, step_feeds)

from tessellm.errors import KernelError
from tessellm.graph import ops
from tessellm.graph.lowering import AttentionSite, KernelSite, lower
from tessellm.graph.passes import default_passes, run_passes
from tessellm.graph.plan import Slot
from tessellm.kernels.profiler import KernelSelector
from tessellm.kernels.registry import KernelQuery

STRUCTURAL = (operator.getitem, ops.split_last, ops.per_head, ops.merge_heads, ops.select_rows)


def _fused(arch: str) -> TinyModel:
    model = make_model(arch)
    registry = reference_registry()
    model.graph, _ = run_passes(model.graph, default_passes(),
                                lambda op: registry.has_op(REF_DEVICE, op))
    return model


class SpySelector(KernelSelector):
    """Records every query the plan asks for."""

    def __init__(self) -> None:
        super().__init__(reference_registry(), REF_DEVICE, "cpu", lambda: None, policy="first")
        self.queries: list[KernelQuery] = []

    def select(self, query: KernelQuery):
        self.queries.append(query)
        return super().select(query)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_call_function_node_is_bound(arch: str, fused: bool) -> None:
    model = _fused(arch) if fused else make_model(arch)
    nodes = [n for n in model.graph.graph.nodes if n.op == "call_function"]
    plan = lower(model.graph, SpySelector(), torch.bfloat16)

    assert len(plan.instructions) == len(nodes)
    for ins, node in zip(plan.instructions, nodes):
        assert ins.label == node.format_node()
        name = ops.op_name(node.target)
        if name == "attention":
            assert isinstance(ins.fn, AttentionSite)
            assert (ins.fn.decode.op, ins.fn.prefill.op, ins.fn.write.op) == (
                "attention_decode", "attention_prefill", "write_kv_cache")
            assert ins.fn.prefill.dims == node.meta["dims"]
            assert dict(ins.fn.write.dims) == {"num_kv_heads": model.spec.num_kv_heads,
                                               "head_dim": model.spec.head_dim}
        elif name is not None:
            assert isinstance(ins.fn, KernelSite)
            assert (ins.fn.op, ins.fn.dims, ins.fn.dtype) == (
                name, node.meta["dims"], torch.bfloat16)
        else:
            assert node.target in STRUCTURAL and ins.fn is node.target
    # inputs: every placeholder; constants: every weight read
    assert set(plan.inputs) == {n.target for n in model.graph.graph.nodes if n.op == "placeholder"}
    assert {id(t) for t in plan.constants.values()} == {id(t) for t in model.graph.weights.values()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_intermediate_is_released_once_after_its_last_reader(arch: str) -> None:
    plan = lower_reference(_fused(arch).graph)
    produced = {ins.out: i for i, ins in enumerate(plan.instructions)}
    readers: dict[int, list[int]] = {}
    for i, ins in enumerate(plan.instructions):
        for a in ins.args:
            if isinstance(a, Slot) and a.index in produced:
                readers.setdefault(a.index, []).append(i)
    released_at: dict[int, list[int]] = {}
    for i, ins in enumerate(plan.instructions):
        for r in ins.release:
            released_at.setdefault(r, []).append(i)

    assert plan.output in produced and plan.output not in released_at
    assert set(released_at) <= set(produced)  # never an input or a weight
    for slot in produced:
        if slot == plan.output:
            continue
        assert slot in readers, f"dead value in a graph after dead-code removal: {slot}"
        label = plan.instructions[produced[slot]].label
        assert released_at.get(slot) == [max(readers[slot])], label

    # simulate: no instruction reads a released slot; only the output is live at the end
    live: set[int] = set()
    for ins in plan.instructions:
        assert all(a.index in live or a.index not in produced
                   for a in ins.args if isinstance(a, Slot)), ins.label
        live.add(ins.out)
        live -= set(ins.release)
    assert live == {plan.output}


def test_intermediates_are_freed_while_the_plan_runs() -> None:
    model = _fused("llama")
    plan = lower_reference(model.graph)
    refs: list[weakref.ref] = []
    alive_before_last: list[int] = []

    def tracking(fn, last: bool):
        def run(*args):
            if last:
                gc.collect()
                alive_before_last.append(sum(r() is not None for r in refs))
            out = fn(*args)
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    refs.append(weakref.ref(t))
            return out
        return run

    for i, ins in enumerate(plan.instructions):
        ins.fn = tracking(ins.fn, last=i == len(plan.instructions) - 1)
    logits = plan.run(prefill_feeds(model.spec, 9))
    assert logits.shape == (9, model.spec.vocab_size)
    assert len(refs) > 50
    # before the LM head only its input (the selected rows) is still held
    assert alive_before_last == [1]


def test_unknown_target_raises_kernel_error() -> None:
    mg = make_model("llama").graph
    x = mg.op_nodes(ops.embedding)[0]
    with mg.graph.inserting_before(x.next):
        odd = mg.graph.call_function(torch.relu, (x,))
    x.replace_all_uses_with(odd, delete_user_cb=lambda u: u is not odd)
    with pytest.raises(KernelError, match="unknown target"):
        lower_reference(mg)


def test_module_calls_and_nested_node_arguments_are_refused() -> None:
    mg = make_model("llama").graph
    x = mg.op_nodes(ops.embedding)[0]
    with mg.graph.inserting_before(x.next):
        mod = mg.graph.call_module("some_module", (x,))
    with pytest.raises(KernelError, match="node kind 'call_module'"):
        lower_reference(mg)
    mg.graph.erase_node(mod)
    with mg.graph.inserting_before(x.next):
        mg.graph.call_function(operator.getitem, ((x, x), 0))
    with pytest.raises(KernelError, match="nested node arguments"):
        lower_reference(mg)


def test_kernels_are_chosen_once_per_token_bucket() -> None:
    model = _fused("llama")
    spy = SpySelector()
    plan = lower(model.graph, spy, torch.float32)
    plan.run(prefill_feeds(model.spec, 5))
    first = list(spy.queries)
    assert first and {q.num_tokens for q in first} == {8}
    # the LM head reads the 5 selected rows (bucket 8 too); no decodes: no attention_decode
    assert "attention_decode" not in {q.op for q in first}
    n_sites = sum(isinstance(i.fn, KernelSite) for i in plan.instructions)
    n_attn = sum(isinstance(i.fn, AttentionSite) for i in plan.instructions)
    assert len(first) == n_sites + 2 * n_attn  # write + prefill per attention

    plan.run(prefill_feeds(model.spec, 7))  # same bucket: nothing new asked
    assert spy.queries == first
    plan.run(prefill_feeds(model.spec, 9))  # bucket 16
    new = spy.queries[len(first):]
    assert len(new) == len(first) and {q.num_tokens for q in new} == {16}


def test_mixed_decode_and_prefill_step_matches_single_prefills() -> None:
    """Step 2 batches a decode of sequence A with a chunked prefill of B (with context)."""
    model = _fused("qwen3")
    spec = model.spec
    plan = lower_reference(model.graph)
    a, b = prompt(spec, 7, seed=1), prompt(spec, 10, seed=2)
    caches = kv_caches(spec, num_blocks=8)
    table_a, table_b = [5, 2], [7, 0, 3]  # shuffled blocks of BLOCK_SIZE 4

    # step 1: A's first 6 tokens and B's first 3 (both prefills)
    meta1 = metadata([6, 3], [6, 3], [table_a, table_b[:1]], num_decodes=0)
    plan.run(step_feeds(a[:6] + b[:3], [*range(6), *range(3)], meta1, caches, [5, 8]))
    # step 2: A decodes its 7th token; B prefills tokens 3..9 over its cached 3
    meta2 = metadata([1, 7], [7, 10], [table_a, table_b], num_decodes=1)
    assert BLOCK_SIZE == 4 and meta2.num_decode_tokens == 1
    got = plan.run(step_feeds(a[6:] + b[3:], [6, *range(3, 10)], meta2, caches,
                              [0, *range(1, 8)]))

    want_a = _single_prefill(model, a)[-1]
    want_b = _single_prefill(model, b)[3:]
    torch.testing.assert_close(got[0], want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:], want_b, rtol=1e-5, atol=1e-5)


def _single_prefill(model: TinyModel, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    meta = metadata([n], [n], [list(range((n + BLOCK_SIZE - 1) // BLOCK_SIZE))], 0)
    feeds = step_feeds(tokens, list(range(n)), meta, kv_caches(model.spec, 4), list(range(n)))
    return lower_reference(model.graph).run(feeds)


def test_lowered_plan_runs_twice_with_the_same_result() -> None:
    model = _fused("gpt2")
    plan = lower_reference(model.graph)
    first = plan.run(prefill_feeds(model.spec, 6))
    torch.testing.assert_close(plan.run(prefill_feeds(model.spec, 6)), first, rtol=0, atol=0)
    torch.testing.assert_close(run_graph(make_model("gpt2"), 6), first, rtol=1e-5, atol=1e-5)
