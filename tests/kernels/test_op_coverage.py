"""REQUIRED_OPS and OPTIONAL_OPS split every op with a reference, and every op the built-in
architectures' graphs lower to on the CPU (unfused, and with the default passes) is one of
them; the conformance kit fails a device that lacks a required op and names it."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.kernels.op_coverage import OPTIONAL_OPS, REQUIRED_OPS
from tessellm.kernels.reference import REFERENCE_OPS
from tessellm.plugins import PluginManager
from tessellm.testing.suite import plan_checks


def test_the_two_sets_split_every_reference_op() -> None:
    assert not REQUIRED_OPS & OPTIONAL_OPS
    assert REQUIRED_OPS | OPTIONAL_OPS == set(REFERENCE_OPS)


@pytest.mark.parametrize("passes", ["none", "default"])
def test_every_op_a_graph_selects_is_covered(stories_dir, passes: str) -> None:
    llm = LLM(str(stories_dir), dtype="float32", load_progress=False, kernel_selection="first",
              graph_passes=passes)
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0.0))
    ops = {q.op for q in llm.engine.parts.selector.chosen()}
    assert ops and ops <= REQUIRED_OPS | OPTIONAL_OPS
    if passes == "none":
        assert ops & OPTIONAL_OPS <= {"greedy_tokens", "sample_tokens", "apply_token_bitmask",
                                      "embedding_packed", "linear_packed"}


def test_conformance_names_a_missing_required_op(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = PluginManager().load()
    registry = manager.kernel_registry()
    real_ops = registry.ops
    monkeypatch.setattr(registry, "ops", lambda device: [o for o in real_ops(device)
                                                         if o != "layer_norm"])
    monkeypatch.setattr(manager, "kernel_registry", lambda: registry)
    check = next(c for c in plan_checks("cpu", manager, groups=["kernels"])
                 if c.name == "kernels.ops")
    with pytest.raises(Exception, match="layer_norm"):
        check.run()
