"""Pipeline parallelism end to end on this machine, float32, 1 thread per rank, against one
process: PP=2 (stories260K, random-weight Llama and Qwen3 shapes) and TP=2 x PP=2 give the
same greedy tokens, also with preemption (a pool too small for the batch) and copy-on-write
siblings; a stage's KV pool holds its layers only, so a byte budget holds more blocks; a
killed stage fails every open request with the stage named and the engine stays dead;
configurations that cannot run are refused before any rank starts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from pydantic import ValidationError

from hf_fixtures import CASES, STORIES_260K, build_hf_model, save_model_dir
from parallel_fixtures import assert_killed_worker_fails_requests
from tessellm import LLM, SamplingParams
from tessellm.errors import ConfigError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ([1, 403, 407, 261, 378], [1, *range(20, 200, 10)], [1, 5, 6])
OPTIONS = dict(device="cpu", dtype="float32", num_threads=1, max_num_seqs=4, block_size=16,
               num_kv_blocks=32, load_progress=False)


def _llm(path: Path, cache: Path, tp: int = 1, pp: int = 1, **extra) -> LLM:
    """Pipelined steps split however few tokens they have, so every test's decode steps
    run through micro-batches too."""
    return LLM(str(path), cache_dir=str(cache), tensor_parallel_size=tp,
               pipeline_parallel_size=pp, **{**OPTIONS, "pipeline_micro_batch_tokens": 1,
                                             **extra})


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list:
    return [[s.token_ids for s in o.outputs] for o in llm.generate([list(p) for p in prompts],
                                                                   params)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pp-cache")


@pytest.fixture(scope="module")
def want(cache) -> list:
    with _llm(STORIES_260K, cache) as one:
        return _tokens(one)


def test_two_stages_equal_one_process(cache, want):
    with _llm(STORIES_260K, cache, pp=2) as two:
        assert two.engine.parts.parallel.layout.pp == 2
        assert len(two.engine.parts.kv_caches) == 3   # layers 0-2 of 5 on stage 0
        assert _tokens(two) == want
        stats = two.engine.runner.pipe.stats   # 3 requests: steps of 2 micro-batches
        assert stats.micro_batches == 2 * stats.steps


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_micro_batches_of_chunked_mixed_steps_with_prompt_logprobs_equal_one_process(
        cache, micro_batches):
    """Prompts chunked 24 tokens a step (decodes and prompt chunks in one step, chunks that
    sample nothing) with prompt logprobs (logits rows of several micro-batches put back in
    the step's order): the same tokens and logprobs as one process, through 1 (synchronous)
    or 3 micro-batches."""
    prompts = [[1, *range(20 + 9 * i, 30 + 13 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    chunked = dict(max_num_batched_tokens=24, max_num_seqs=5)
    results = []
    for pp, extra in ((1, {}), (2, dict(pipeline_micro_batches=micro_batches))):
        with _llm(STORIES_260K, cache, pp=pp, **chunked, **extra) as llm:
            outs = llm.generate([list(p) for p in prompts], params)
            results.append([(o.outputs[0].token_ids, _prompt_logprobs(o)) for o in outs])
            if pp == 2:
                stats = llm.engine.runner.pipe.stats
                assert (stats.micro_batches > stats.steps) == (micro_batches > 1)
    one, pipelined = results
    assert [tokens for tokens, _ in pipelined] == [tokens for tokens, _ in one]
    for (_, want_lps), (_, got_lps) in zip(one, pipelined):
        assert [lp and lp[0] for lp in got_lps] == [lp and lp[0] for lp in want_lps]
        # float32 logits of different row groupings: equal within rounding (rounding to 4
        # decimals once split -27.64495 into -27.6449 and -27.645)
        assert [lp and lp[1] for lp in got_lps] == pytest.approx(
            [lp and lp[1] for lp in want_lps], abs=1e-3)


def _prompt_logprobs(out) -> list:
    """(token, logprob) of each prompt position's own token (None for the first)."""
    return [None if lp is None else (lp.token_id, lp.logprob) for lp in out.prompt_logprobs]


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_random_weight_models_two_stages_equal_one(case, tmp_path, cache):
    c = CASES[case]
    tok = c.tokenizer()
    path = save_model_dir(build_hf_model(c, tok), tok, tmp_path / case)
    prompts = [[1, 5, 9, 13], [1, *range(30, 60)]]
    with _llm(path, cache) as one:
        want = _tokens(one, prompts)
    with _llm(path, cache, pp=2) as two:
        assert _tokens(two, prompts) == want


def test_preemption_and_copy_on_write_flow_through_the_stages(cache):
    """A pool too small for the batch (preemptions) and n=2 siblings (copy-on-write blocks
    replayed on every stage): the same tokens as one process."""
    prompts = [[1, *range(20 + 7 * i, 60 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
    results = []
    for pp in (1, 2):
        with _llm(STORIES_260K, cache, pp=pp, num_kv_blocks=12) as llm:
            results.append(_tokens(llm, prompts, params))
            assert llm.engine.stats.num_preemptions > 0
    assert results[0] == results[1]


def test_tensor_by_pipeline_ranks_equal_one_process(cache, want):
    """TP=2 x PP=2: four ranks, each stage's all-reduces on its own pair."""
    with _llm(STORIES_260K, cache, tp=2, pp=2) as four:
        parts = four.engine.parts
        assert parts.parallel.world_size == 4
        assert parts.kv_caches[0].shape[2] == parts.spec.num_kv_heads // 2
        assert _tokens(four) == want
        assert parts.parallel.stats.calls > 0


def test_a_stage_holds_its_layers_kv_only_so_a_budget_holds_more_blocks(cache):
    budget = dict(num_kv_blocks=None, kv_cache_bytes=1 << 20)
    with _llm(STORIES_260K, cache, **budget) as one:
        one_blocks = one.engine.kv.num_blocks
    with _llm(STORIES_260K, cache, pp=2, **budget) as two:
        # 5 layers: stage 0 holds 3, stage 1 holds 2; the shared block table takes the minimum
        assert two.engine.kv.num_blocks == one_blocks * 5 // 3
        assert len(two.engine.parts.kv_caches) == 3


def test_killing_a_stage_fails_every_open_request_and_the_engine_stays_dead(cache):
    llm = _llm(STORIES_260K, cache, pp=2, num_kv_blocks=64)
    try:
        assert_killed_worker_fails_requests(llm, r"pipeline stage 1 \(rank 1\)")
    finally:
        llm.close()


@pytest.mark.parametrize("options,error,match", [
    (dict(pipeline_parallel_size=0), ValidationError, "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=6), ConfigError, "pipeline_parallel_size=6 exceeds the "
     "model's 5 decoder layers"),
    (dict(pipeline_parallel_size=2, enable_lora=True), ValidationError,
     "enable_lora is not supported with pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, async_scheduling=True), ValidationError,
     "async_scheduling is not supported with pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 2}),
     ValidationError, "speculative_config is not supported with pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, pipeline_micro_batches=0), ValidationError,
     "pipeline_micro_batches"),
    (dict(pipeline_parallel_size=2, pipeline_micro_batch_tokens=0), ValidationError,
     "pipeline_micro_batch_tokens"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=3), ConfigError,
     "tensor_parallel_size=3 cannot split"),
])
def test_configurations_that_cannot_run_are_refused_before_any_rank_starts(
        options, error, match, cache, monkeypatch):
    from tessellm.parallel import launch

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch.LocalWorkers, "spawn", no_workers)
    with pytest.raises(error, match=match):
        LLM(str(STORIES_260K), cache_dir=str(cache), **{**OPTIONS, **options})
    assert not dist.is_initialized()


@pytest.mark.parametrize("launcher_env,match", [
    ({}, r"distributed_executor_backend='ray' starts its ranks on Ray, which is not "
         r"installed .*pip install 'tessellm\[ray\]'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "'ray' starts the ranks as Ray actors: run it without a launcher"),
])
def test_the_ray_backend_without_ray_or_under_a_launcher_is_refused(
        launcher_env, match, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` fails: nothing reaches Ray
    for key, value in launcher_env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=match):
        LLM(str(STORIES_260K), cache_dir=str(cache), pipeline_parallel_size=2,
            distributed_executor_backend="ray", **OPTIONS)
    assert not dist.is_initialized()
