"""Async scheduling: step N+1 is scheduled and launched before step N's ids are read back
(its pending tokens fed on the device). Whatever the mix of requests, the tokens, finish
reasons and logprobs equal the synchronous loop's, on cpu, on the asynchronous `sim` device
(copies on a worker thread, poisoned destinations) and through the decode-graph path; aborts,
preemption, max_model_len and failing steps lose nothing and leak no blocks."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.llm_engine import StepError
from tessellm.engine.model_runner import ModelRunner
from tessellm.errors import ConfigError

PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park. They",
           "One day, a little bird", "Tom had a red ball"]
BASE = dict(dtype="float32", load_progress=False, kernel_selection="first")


def _params(stop_token: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=30, temperature=0.0),
            SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=5),
            SamplingParams(max_tokens=25, temperature=0.0, stop_token_ids=[stop_token]),
            SamplingParams(max_tokens=12, temperature=1.0, seed=9, logprobs=2),
            SamplingParams(max_tokens=1, temperature=0.0)]


def _run(stories_dir, prompts, params, **options):
    llm = LLM(str(stories_dir), **{**BASE, **options})
    outs = llm.generate(prompts, params)
    return llm, [(o.token_ids, o.finish_reason) for o in outs], outs


@pytest.fixture(scope="module")
def stop_token(stories_dir) -> int:
    """A token the greedy continuation of PROMPTS[2] emits early (an EOS-like stop)."""
    llm = LLM(str(stories_dir), **BASE)
    ids = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=25, temperature=0.0))[0].token_ids
    return ids[6]


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_async_steps_give_the_synchronous_tokens(stories_dir, stop_token, device):
    params = _params(stop_token)
    _, sync, sync_outs = _run(stories_dir, PROMPTS, params, device=device,
                              async_scheduling=False)
    llm, got, outs = _run(stories_dir, PROMPTS, params, device=device, async_scheduling=True)
    assert got == sync
    assert got[2][1] == "stop" and len(got[2][0]) < 25          # stopped by its stop token
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in sync_outs]
    stats = llm.engine.stats
    assert stats.num_overlapped_steps >= stats.num_steps // 2
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_logprobs_and_penalties_equal_the_synchronous_loop(stories_dir):
    params = [SamplingParams(max_tokens=10, temperature=0.0, logprobs=3),
              SamplingParams(max_tokens=10, temperature=0.8, seed=1, repetition_penalty=1.3,
                             presence_penalty=0.5)]
    results = {}
    for mode in (False, True):
        llm = LLM(str(stories_dir), device="cpu", async_scheduling=mode, **BASE)
        rids = [llm.engine.add_request(llm.encode(p), sp).request_id
                for p, sp in zip(PROMPTS[:2], params)]
        requests = [llm.engine.scheduler.get_request(r) for r in rids]
        while llm.engine.has_unfinished():
            llm.engine.step()
        results[mode] = [(r.output_token_ids, r.output_logprobs) for r in requests]
        if mode:   # a penalised row keeps its step from staying in flight
            assert llm.engine.stats.num_overlapped_steps == 0
    assert results[True] == results[False]
    assert len(results[True][0][1]) == 10


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_async_scheduling(stories_dir, mode):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    small = dict(device="sim", block_size=4, num_kv_blocks=22, max_num_seqs=4,
                 preemption_mode=mode)
    _, sync, _ = _run(stories_dir, PROMPTS[:4], params, **small, async_scheduling=False)
    llm, got, _ = _run(stories_dir, PROMPTS[:4], params, **small, async_scheduling=True)
    assert got == sync
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.stats.num_overlapped_steps > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_max_model_len_and_chunked_prefill(stories_dir):
    params = SamplingParams(max_tokens=200, temperature=0.0)
    opts = dict(device="cpu", max_model_len=40, max_num_batched_tokens=8, block_size=4)
    _, sync, _ = _run(stories_dir, PROMPTS, params, **opts, async_scheduling=False)
    llm, got, _ = _run(stories_dir, PROMPTS, params, **opts, async_scheduling=True)
    assert got == sync
    assert {reason for _, reason in got} == {"length"}
    assert llm.engine.stats.num_overlapped_steps > 0


def test_n_greater_than_one_forks_with_async_scheduling(stories_dir):
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3)]
    outs = {}
    for mode in (False, True):
        llm = LLM(str(stories_dir), device="cpu", async_scheduling=mode, **BASE)
        outs[mode] = [c.token_ids for c in llm.generate(PROMPTS[:1], params)[0].outputs]
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert outs[True] == outs[False] and len(outs[True]) == 3


def test_abort_while_in_flight(stories_dir):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    _, (alone,), _ = _run(stories_dir, PROMPTS[:1], params, device="cpu")
    llm = LLM(str(stories_dir), device="cpu", async_scheduling=True, **BASE)
    keep = llm.engine.add_request(llm.encode(PROMPTS[0]), params)
    drop = llm.engine.add_request(llm.encode(PROMPTS[1]), params)
    for _ in range(4):
        llm.engine.step()
    assert llm.engine._in_flight is not None and drop.num_pending == 1
    n = len(drop.output_token_ids)
    llm.engine.abort(drop.request_id)          # its token in flight is dropped
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert drop.finish_reason.value == "abort" and len(drop.output_token_ids) == n
    assert (keep.output_token_ids, keep.finish_reason.value) == alone
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_failing_step_with_a_step_in_flight(stories_dir, monkeypatch):
    """The launch of step N+1 fails: its requests fail (blocks freed), step N (in flight)
    still completes for the others, and the engine goes on."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    _, good, _ = _run(stories_dir, PROMPTS[:2], params, device="cpu")
    llm = LLM(str(stories_dir), device="cpu", async_scheduling=True, **BASE)
    real_launch = ModelRunner.launch
    calls = {"n": 0}

    def flaky(self, out, kv, previous=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return real_launch(self, out, kv, previous)

    monkeypatch.setattr(ModelRunner, "launch", flaky)
    with pytest.raises(StepError, match="injected failure") as info:
        llm.generate(PROMPTS[:2], params)
    assert {r.finish_reason.value for r in info.value.failed} == {"error"}
    assert len(info.value.failed) == 2
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == [t for t, _ in good]


def test_failing_readback_of_the_step_in_flight(stories_dir, monkeypatch):
    """Collecting step N fails after N+1 was launched: N's requests fail, N+1 stays in flight
    and a request that joined in N+1 goes on to its synchronous tokens; no block leaks."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    _, (alone,), _ = _run(stories_dir, PROMPTS[1:2], params, device="cpu")
    llm = LLM(str(stories_dir), device="cpu", async_scheduling=True, **BASE)
    failing = llm.engine.add_request(llm.encode(PROMPTS[0]), params)
    for _ in range(3):
        llm.engine.step()                       # `failing` has a step in flight
    joined = llm.engine.add_request(llm.encode(PROMPTS[1]), params)   # its prefill: N+1
    real_collect = ModelRunner.collect

    def fail_once(self, step):
        monkeypatch.setattr(ModelRunner, "collect", real_collect)
        raise RuntimeError("injected readback failure")

    monkeypatch.setattr(ModelRunner, "collect", fail_once)
    with pytest.raises(StepError, match="injected readback failure") as info:
        llm.engine.step()
    assert info.value.failed == [failing] and failing.finish_reason.value == "error"
    assert llm.engine._in_flight is not None and joined.num_pending == 1
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert (joined.output_token_ids, joined.finish_reason.value) == alone
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_decode_graph_steps_take_pending_ids_on_the_device(stories_dir):
    from test_decode_graphs import _manager
    params = SamplingParams(max_tokens=20, temperature=0.0)
    eager = LLM(str(stories_dir), device="cpu", **BASE).generate(PROMPTS[:3], params)
    llm = LLM(str(stories_dir), plugins=_manager(), device="cpu-graphs",
              async_scheduling=True, max_num_seqs=4, **BASE)
    got = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert llm.engine.parts.device.graphs[4].calls > 1
    assert llm.engine.stats.num_overlapped_steps > 0


def test_default_follows_the_device_and_refusals(stories_dir):
    assert not LLM(str(stories_dir), device="cpu", **BASE).engine.async_scheduling
    with pytest.raises((ConfigError, ValueError), match="tensor_parallel_size"):
        LLM(str(stories_dir), device="cpu", async_scheduling=True, tensor_parallel_size=2,
            **BASE)
