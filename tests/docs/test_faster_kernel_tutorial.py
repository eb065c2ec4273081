"""The kernel tutorial's plugin (docs/examples/faster_kernel) adds an rms_norm kernel to the
existing cpu device: it is offered beside cpu's own, the profiler checks it against the
reference and ranks it (float32 only, as its predicate says), and forced it runs stories260K
to the reference tokens."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tessellm import LLM, SamplingParams
from tessellm.cli.kernels_table import plan_queries
from tessellm.config import EngineConfig
from tessellm.engine.builder import build_engine_parts
from tessellm.kernels.profiler import KernelSelector
from tessellm.kernels.registry import Kernel, KernelQuery
from tessellm.plugins import PluginManager

NAME = "rms_norm_functional"


@pytest.fixture()
def manager(tutorial_plugins) -> PluginManager:
    return tutorial_plugins("faster_kernel", "fast_rms_norm", "tessellm_fast_rms_norm.plugin")


def test_it_is_offered_beside_the_devices_own_kernels(manager) -> None:
    record = next(r for r in manager.records if r.name == "fast_rms_norm")
    assert record.status == "loaded" and record.error is None
    names = [k.name for k in manager.kernel_registry().kernels("cpu", "rms_norm")]
    assert NAME in names and len(names) > 1 and names[-1] == NAME   # after cpu's own


def test_the_profiler_checks_and_ranks_it_on_the_models_queries(manager, stories_dir,
                                                                tmp_path) -> None:
    parts = build_engine_parts(EngineConfig(model=str(stories_dir), device="cpu",
                                            dtype="float32", load_progress=False,
                                            kernel_selection="first",
                                            cache_dir=str(tmp_path)), manager)
    queries = [q for q in plan_queries(parts.plan, [1, 16]) if q.op == "rms_norm"]
    assert queries
    for q in queries:
        ranking = {c.name: c for c in parts.selector.decide(q).ranking}
        assert ranking[NAME].correct and ranking[NAME].best_us > 0, ranking[NAME]
    half = KernelQuery("rms_norm", torch.bfloat16, 16, queries[0].dims)
    assert NAME not in {k.name for k in manager.kernel_registry().candidates("cpu", half)}


def test_a_wrong_variant_is_rejected_never_chosen(manager) -> None:
    registry = manager.kernel_registry()
    ours = next(k for k in registry.kernels("cpu", "rms_norm") if k.name == NAME)
    registry.register(dataclasses.replace(ours, name="rms_norm_off",
                                          fn=lambda x, w, eps: ours.fn(x, w, eps) * 1.01))
    selector = KernelSelector(registry, "cpu", "cpu", lambda: None)
    decision = selector.decide(KernelQuery("rms_norm", torch.float32, 16, (("hidden", 64),)))
    off = next(c for c in decision.ranking if c.name == "rms_norm_off")
    assert not off.correct and "differs from reference" in off.error
    assert decision.choice != "rms_norm_off"
    assert next(c for c in decision.ranking if c.name == NAME).correct


def _first_unrestricted(kernels):
    """The first kernel whose `supports` is the default (every call), else the first."""
    default = Kernel.__dataclass_fields__["supports"].default
    return next((k for k in kernels if k.supports is default), kernels[0])


def test_forced_it_runs_the_model_to_the_reference_tokens(manager, stories_dir) -> None:
    registry = manager.kernel_registry()
    # every other op named too (its first kernel that takes every call, so that no bucket
    # lacks it: a native kernel may take only a few rows), so nothing else is profiled: fast
    policy = {op: _first_unrestricted(registry.kernels("cpu", op)).name
              for op in registry.ops("cpu")}
    llm = LLM(str(stories_dir), plugins=manager, device="cpu", dtype="float32",
              load_progress=False, kernel_selection={**policy, "rms_norm": NAME})
    assert NAME in set(llm.engine.parts.selector.chosen().values())
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    assert llm.encode(ref["prompt"]) + out.token_ids == ref["token_ids"]
