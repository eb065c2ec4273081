"""End to end on the CPU and on the out-of-tree `sim` device (async transfers, separate memory)."""
from __future__ import annotations

import json

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.llm_engine import StepError
from tessellm.engine.model_runner import ModelRunner


def _reference(stories_dir):
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    ids = ref["token_ids"]
    ids = json.loads(ids) if isinstance(ids, str) else ids
    return ref, ids


@pytest.fixture(scope="module", params=["cpu", "sim"])
def stories_llm(request, stories_dir):
    return LLM(str(stories_dir), device=request.param, dtype="float32", load_progress=False)


def test_stories_greedy_matches_reference(stories_llm, stories_dir):
    ref, ref_ids = _reference(stories_dir)
    out = stories_llm.generate([ref["prompt"]],
                               SamplingParams(max_tokens=ref["max_new_tokens"], temperature=0.0))[0]
    prompt_ids = stories_llm.encode(ref["prompt"])
    assert prompt_ids + out.token_ids == ref_ids
    assert ref["prompt"] + out.text == ref["text"]
    assert out.finish_reason == "length"


def test_sim_matches_cpu_on_a_batch(stories_dir):
    prompts = ["Once upon a time", "The cat", "Lily and Ben went to the park. They",
               "One day, a little bird"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = {}
    for dev in ("cpu", "sim"):
        llm = LLM(str(stories_dir), device=dev, dtype="float32", load_progress=False,
                  max_num_batched_tokens=16, max_num_seqs=3)
        outs[dev] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["cpu"] == outs["sim"]


def test_sim_weights_and_kv_live_in_sim_memory(stories_dir):
    llm = LLM(str(stories_dir), device="sim", dtype="float32", load_progress=False)
    parts = llm.engine.parts
    alloc = parts.device.allocator()
    assert all(alloc.owns(c) for c in parts.kv_caches)
    assert all(alloc.owns(w) for w in parts.plan.constants.values() if hasattr(w, "data_ptr"))
    stats = alloc.stats()
    assert stats.by_tag["weights"] > 0 and stats.by_tag["kv_cache"] > 0


def test_forgetting_to_wait_on_transfer_events_fails(stories_dir, monkeypatch):
    """The sim stream poisons the destination until its copy lands: an engine that reads
    device inputs without waiting on the event must not produce the right tokens."""
    llm = LLM(str(stories_dir), device="sim", dtype="float32", load_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    good = llm.generate(["Once upon a time"], params)[0].token_ids
    monkeypatch.setattr(ModelRunner, "wait", lambda self, event: None)
    try:
        bad = llm.generate(["Once upon a time"], params)[0].token_ids
    except StepError as e:  # poisoned ids index out of range: the step fails
        assert [r.finish_reason.value for r in e.failed] == ["error"]
        bad = None
    assert bad != good
    monkeypatch.undo()
    assert llm.generate(["Once upon a time"], params)[0].token_ids == good


def test_failing_step_fails_only_its_requests_and_frees_blocks(stories_dir, monkeypatch):
    llm = LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    good = llm.generate(["Once upon a time"], params)[0].token_ids
    real_launch = ModelRunner.launch
    calls = {"n": 0}

    def flaky(self, out, kv, previous=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_launch(self, out, kv, previous)

    monkeypatch.setattr(ModelRunner, "launch", flaky)
    with pytest.raises(StepError, match="injected failure") as info:
        llm.generate(["Once upon a time", "The cat"], params)
    assert {r.finish_reason.value for r in info.value.failed} == {"error"}
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert llm.generate(["Once upon a time"], params)[0].token_ids == good
