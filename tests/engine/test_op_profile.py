"""OpProfile: per op kind time and calls while active, the plan untouched after."""
from __future__ import annotations

from tessellm import LLM, SamplingParams
from tessellm.engine.op_profile import STRUCTURAL, OpProfile


def test_profile_attributes_every_kernel_call_and_restores_the_plan(stories_dir) -> None:
    llm = LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
              kernel_selection="first")
    plan = llm.engine.parts.plan
    before = [ins.fn for ins in plan.instructions]
    with OpProfile(llm.engine) as prof:
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0.0))
    report = prof.report()
    assert [ins.fn for ins in plan.instructions] == before
    assert report["steps"] == 8
    ops = report["ops"]
    layers = llm.engine.parts.spec.num_layers
    # fused qkv, o, fused gate_up, down per layer, and the LM head: eager steps' calls, and
    # those of the native decode program's Python nodes (torch linears, fp32 dense)
    linear = sum(o["calls_per_step"] for kind, o in ops.items()
                 if kind.removesuffix(" (Python node)") == "linear")
    assert linear == 4 * layers + 1
    assert ops["write_kv_cache"]["calls_per_step"] == layers
    assert ops["attention_decode"]["calls_per_step"] + ops["attention_prefill"][
        "calls_per_step"] == layers
    assert STRUCTURAL in ops
    assert abs(sum(o["share"] for o in ops.values()) - 1) < 0.01
    assert report["stages_ms_per_step"]["execute"] > 0
