"""Priorities through the whole engine (stories260K, float32, CPU, 4-token blocks, a pool too
small for all requests): a high-priority request that arrives last evicts a running
low-priority one and finishes first; the low ones still finish; every greedy output equals
the one of an unpreempted run."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.errors import InvalidRequestError

LOW = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
HIGH = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TEXTS = ["Once upon a time, there was a little girl named Lily who",
         "The big brown dog ran to the park and saw a",
         "Tom and his mom went to the store to buy some",
         "One day, a small bird flew over the tall green tree and"]


def make_llm(stories_dir, **options) -> LLM:
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
               block_size=4, max_num_seqs=4, **options)


@pytest.fixture(scope="module")
def roomy(stories_dir) -> LLM:
    return make_llm(stories_dir)


@pytest.fixture(scope="module")
def prompts(roomy: LLM) -> list[list[int]]:
    return [roomy.encode(t)[:16] for t in TEXTS]


@pytest.fixture(scope="module")
def reference(roomy: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each request alone: no batching, no preemption."""
    params = [LOW, LOW, LOW, HIGH]
    return [roomy.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]


def test_a_late_high_priority_request_evicts_and_finishes_first(stories_dir, prompts,
                                                                reference) -> None:
    llm = make_llm(stories_dir, num_kv_blocks=22, aging_interval_steps=200)
    engine = llm.engine
    lows = [engine.add_request(p, LOW, priority=2) for p in prompts[:3]]
    finished_at: dict[str, int] = {}
    step = 0
    for _ in range(10):                        # 25 tokens each: 7 blocks of 22, 1 free
        for r in engine.step():
            finished_at[r.request_id] = step
        step += 1
    running = [r for r in lows if r.status.value == "running"]
    assert len(running) == 3 and engine.kv.num_free_blocks == 1
    preempted_before = engine.stats.num_preemptions
    high = engine.add_request(prompts[3], HIGH, priority=0)
    engine.step()                              # high is admitted by evicting the latest low
    step += 1
    assert high.num_computed_tokens == len(prompts[3]) and len(high.output_token_ids) == 1
    assert lows[2].status.value == "waiting" and lows[2].num_preemptions == 1
    assert engine.stats.num_preemptions == preempted_before + 1
    while engine.has_unfinished():
        for r in engine.step():
            finished_at[r.request_id] = step
        step += 1
        assert step < 500
    assert engine.stats.num_preemptions > preempted_before
    assert high.num_preemptions == 0 and lows[2].num_preemptions >= 1
    assert all(finished_at[high.request_id] < finished_at[r.request_id] for r in running)
    assert [r.output_token_ids for r in lows + [high]] == reference
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_generate_with_priorities_gives_the_unpreempted_tokens(stories_dir, prompts,
                                                               reference) -> None:
    llm = make_llm(stories_dir, num_kv_blocks=22)
    out = llm.generate(prompts, [LOW, LOW, LOW, HIGH], priority=[2, 2, 2, 0])
    assert [o.token_ids for o in out] == reference
    assert llm.engine.stats.num_preemptions > 0
    same = llm.generate(prompts[:1], LOW, priority=1)
    assert same[0].token_ids == reference[0]


@pytest.mark.parametrize("priority", [3, -1, [0, 0, 0, 3], [0, 0], True])
def test_bad_priorities_queue_nothing(roomy, prompts, priority) -> None:
    with pytest.raises(InvalidRequestError, match="priorit"):
        roomy.generate(prompts, HIGH, priority=priority)
    assert not roomy.engine.has_unfinished()


def test_priority_levels_and_sla_reach_the_scheduler(stories_dir, prompts) -> None:
    llm = make_llm(stories_dir, priority_levels=5, aging_interval_steps=7,
                   sla_itl_p99_ms=10_000, sla_window_steps=2)
    sched = llm.engine.scheduler
    assert (sched.config.priority_levels, sched.config.aging_interval_steps) == (5, 7)
    llm.generate(prompts, HIGH, priority=4)
    assert sched.sla is not None and sched.sla.last_p99_itl_s is not None
    assert sched.max_num_seqs_now == 4                       # well within a 10 s SLA
    with pytest.raises(Exception, match="sla_min_num_seqs"):
        make_llm(stories_dir, sla_itl_p99_ms=50, sla_min_num_seqs=8)


def test_engine_config_validates_the_scheduling_options() -> None:
    from pydantic import ValidationError

    from tessellm.config import EngineConfig
    for bad in (dict(priority_levels=0), dict(priority_levels=65), dict(aging_interval_steps=-1),
                dict(sla_itl_p99_ms=0), dict(sla_window_steps=0)):
        with pytest.raises(ValidationError):
            EngineConfig(**bad)
    c = EngineConfig()
    assert (c.priority_levels, c.aging_interval_steps, c.sla_itl_p99_ms) == (3, 500, None)
