"""Kernels that read their weight in a layout of their own (WeightLayout): the profiler checks
them on prepared weights, plan sites prepare a weight once, and adopt_weight_layouts leaves
each weight in exactly one form (dropping the plain one where a single site reads it)."""
from __future__ import annotations

import pytest
import torch
from graph_fixtures import REF_DEVICE, make_model, prefill_feeds, reference_registry

from tessellm.errors import KernelError
from tessellm.graph.lowering import KernelSite, adopt_weight_layouts, lower, select_all_kernels
from tessellm.kernels.profiler import KernelSelector
from tessellm.kernels.registry import Kernel, KernelQuery, WeightLayout

# the "layout": the weight stored transposed; its kernel multiplies by it directly
TRANSPOSED = WeightLayout("transposed", lambda w: w.t().contiguous())


def linear_transposed(x, wt, bias=None):
    out = x @ wt
    return out + bias if bias is not None else out


def _registry(layout_kernel: Kernel | None = None, plain: bool = True):
    registry = reference_registry(skip=() if plain else ("linear",))
    registry.register(layout_kernel or Kernel("linear", "linear_t", linear_transposed,
                                              REF_DEVICE, weight_layout=TRANSPOSED))
    return registry


def _selector(registry, policy) -> KernelSelector:
    return KernelSelector(registry, REF_DEVICE, "cpu", lambda: None, policy=policy,
                          min_time_s=0.001, max_reps=4)


def test_the_profiler_checks_a_layout_kernel_on_its_prepared_weight() -> None:
    query = KernelQuery("linear", torch.float32, 4,
                        (("bias", 0), ("in_features", 8), ("out_features", 6)))
    good = _selector(_registry(), "profile").decide(query)
    assert {c.name: c.correct for c in good.ranking} == {"ref_linear": True, "linear_t": True}
    wrong = Kernel("linear", "linear_t", linear_transposed, REF_DEVICE,
                   weight_layout=WeightLayout("not_transposed", lambda w: w.clone()))
    bad = _selector(_registry(wrong), "profile").decide(query)
    assert bad.choice == "ref_linear"
    assert not next(c for c in bad.ranking if c.name == "linear_t").correct


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 ties its LM head to the embedding
def test_adopted_weights_take_one_form_and_outputs_do_not_change(arch: str) -> None:
    model = make_model(arch)
    weights = model.graph.weights
    expected = lower(model.graph, _selector(reference_registry(), "first"),
                     torch.float32).run(prefill_feeds(model.spec))
    plan = lower(model.graph, _selector(_registry(plain=False), "first"), torch.float32)
    for b in (1, 2, 4, 8):
        select_all_kernels(plan, b, 4)
    adopted = adopt_weight_layouts(plan, weights) if arch == "llama" else None
    sites = [i for i in plan.instructions if isinstance(i.fn, KernelSite) and i.fn.op == "linear"]
    if arch == "qwen2":  # the tied head's weight is shared and no plain kernel exists
        with pytest.raises(KernelError, match="plain-weight kernel"):
            adopt_weight_layouts(plan, weights)
        return
    assert adopted == len(sites) and all(len(i.fn._prepared) == 1 for i in sites)
    # the plan holds no plain linear weight any more; `weights` holds the prepared forms
    assert all(i.args[1].index not in plan.constants for i in sites)
    held = [p for i in sites for p in i.fn._prepared.values()]
    assert all(any(p is w for w in weights.values()) for p in held)
    torch.testing.assert_close(plan.run(prefill_feeds(model.spec)), expected)


def test_adopting_twice_changes_nothing() -> None:
    """The server's core and the offline LLM both prepare kernels; an engine prepared twice
    (EngineCoreClient.in_thread over an LLM's engine) must keep reading its prepared weights,
    not fall back to plain kernels whose weights were dropped."""
    model = make_model("llama")
    expected = lower(model.graph, _selector(reference_registry(), "first"),
                     torch.float32).run(prefill_feeds(model.spec))
    plan = lower(model.graph, _selector(_registry(), {"linear": "linear_t"}), torch.float32)
    for b in (1, 2, 4, 8):
        select_all_kernels(plan, b, 4)
    first = adopt_weight_layouts(plan, model.graph.weights)
    assert first > 0
    assert adopt_weight_layouts(plan, model.graph.weights) == 0
    torch.testing.assert_close(plan.run(prefill_feeds(model.spec)), expected)


def test_a_shared_weight_stays_plain_and_mixed_sites_are_unified() -> None:
    model = make_model("qwen2")                     # lm_head reads the embedding's weight
    registry = _registry()                          # plain and transposed kernels both offered
    plan = lower(model.graph, _selector(registry, "profile"), torch.float32)
    for b in (1, 2, 4, 8):
        select_all_kernels(plan, b, 4)
    tied = model.graph.weights["model.embed_tokens.weight"]
    shared_slots = {i for i, w in plan.constants.items() if w is tied}
    assert len(shared_slots) == 2          # read by the embedding and the tied LM head
    adopt_weight_layouts(plan, model.graph.weights)
    for ins in plan.instructions:
        site = ins.fn
        if isinstance(site, KernelSite) and site.op == "linear":
            layouts = {k.weight_layout for k in site._kernels.values()}
            assert len(layouts) == 1                     # one form per site
            if ins.args[1].index in shared_slots:
                assert layouts == {None} and not site._prepared   # shared: plain only
            held = ins.args[1].index in plan.constants
            assert held == (layouts == {None})               # plain kept iff read plain


def test_a_bucket_chosen_after_adoption_fails_clearly() -> None:
    model = make_model("llama")
    registry = _registry()
    forced = {"linear": "linear_t"}
    plan = lower(model.graph, _selector(registry, forced), torch.float32)
    select_all_kernels(plan, 1, 1)
    adopt_weight_layouts(plan, model.graph.weights)
    site = next(i.fn for i in plan.instructions if isinstance(i.fn, KernelSite)
                and i.fn.op == "linear")
    site.selector.policy = {"linear": "ref_linear"}   # as if another bucket chose plain
    site.selector._chosen.clear()
    site._kernels.pop(1, None)
    site._by_bucket.clear()
    with pytest.raises(KernelError, match="plain weight"):
        site(torch.zeros(1, 32), None)


# a second layout: the same transposed weight under another name (so another prepared form)
TRANSPOSED_TOO = WeightLayout("transposed_too", lambda w: w.t().contiguous())
LINEAR_DIMS = (("bias", 0), ("in_features", 8), ("out_features", 6))


def _two_layout_site(times_us: dict[int, dict[str, float]]) -> KernelSite:
    """A linear site over a plain kernel and two layout kernels, with each bucket's profile
    decided in advance: times_us[bucket][kernel name] (what the profiler would have timed)."""
    from tessellm.kernels.profiler import Candidate, Decision
    registry = _registry()
    registry.register(Kernel("linear", "linear_t2", linear_transposed, REF_DEVICE,
                             weight_layout=TRANSPOSED_TOO))
    selector = _selector(registry, "profile")
    for bucket, times in times_us.items():
        query = KernelQuery("linear", torch.float32, bucket, LINEAR_DIMS)
        ranking = sorted((Candidate(name, us, True) for name, us in times.items()),
                         key=lambda c: c.best_us)
        candidates = selector.registry.candidates(REF_DEVICE, query)
        selector.cache.put(selector.cache_key(query, candidates),
                           Decision(ranking[0].name, ranking))
    site = KernelSite("linear", torch.float32, LINEAR_DIMS, selector)
    for bucket in times_us:
        site.fn_for(bucket)
    return site


def test_mixed_layouts_unify_on_the_one_that_loses_least() -> None:
    """Bucket 1 prefers linear_t (10 us against linear_t2's 30: a 3x loss for linear_t2's
    layout), buckets 2 and 4 prefer linear_t2 by 1.2x each: linear_t2's layout loses 3.0,
    linear_t's 2.4 summed, so every bucket moves to linear_t's layout."""
    site = _two_layout_site({1: {"ref_linear": 50, "linear_t": 10, "linear_t2": 30},
                             2: {"ref_linear": 50, "linear_t": 12, "linear_t2": 10},
                             4: {"ref_linear": 50, "linear_t": 12, "linear_t2": 10}})
    assert {b: k.name for b, k in site._kernels.items()} == {1: "linear_t", 2: "linear_t2",
                                                             4: "linear_t2"}
    site.unify_layout()
    assert {b: k.name for b, k in site._kernels.items()} == {1: "linear_t", 2: "linear_t",
                                                             4: "linear_t"}
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    torch.testing.assert_close(site.fn_for(2)(x, w), x @ w.t())


def test_plain_weights_win_when_a_layout_loses_more() -> None:
    """Decode buckets chose the plain kernel, 50x faster there than the layout's (a native
    kernel against oneDNN's prepacked one on a MoE router); a prefill bucket chose the layout
    by 1.3x. The plain form loses 1.3 summed, the layout 100: every bucket reads plain."""
    site = _two_layout_site({1: {"ref_linear": 5, "linear_t": 250, "linear_t2": 300},
                             2: {"ref_linear": 5, "linear_t": 250, "linear_t2": 300},
                             1024: {"ref_linear": 130, "linear_t": 100, "linear_t2": 140}})
    assert site._kernels[1024].name == "linear_t"
    site.unify_layout()
    assert {b: k.name for b, k in site._kernels.items()} == {1: "ref_linear", 2: "ref_linear",
                                                             1024: "ref_linear"}
    assert site.sole_layout() is None


def test_slowdown_is_a_ratio_to_the_fastest_correct_kernel() -> None:
    site = _two_layout_site({8: {"ref_linear": 40, "linear_t": 10, "linear_t2": 25}})
    query = KernelQuery("linear", torch.float32, 8, LINEAR_DIMS)
    assert site.selector.slowdown(query, lambda k: k.weight_layout == TRANSPOSED_TOO) == 2.5
    assert site.selector.slowdown(query, lambda k: k.weight_layout is None) == 4.0
    assert site.selector.slowdown(query, lambda k: k.name == "absent") == float("inf")
