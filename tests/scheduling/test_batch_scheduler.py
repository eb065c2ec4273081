"""Batch scheduler with priorities: truly preemptive (a waiting request evicts running ones of
a worse level, for blocks or for a sequence slot), never in vain and never an equal, the
budget served in priority order, aging against starvation; random workloads keep every
invariant and give the tokens of an unconstrained run; each request's grant is
min(missing, budget), prompt-logprob requests in chunks of PROMPT_LOGITS_CHUNK."""
from __future__ import annotations

import pytest
from hypothesis import event, given, settings, strategies as st

from scheduling_fixtures import (Tracker, assert_finished_as_alone, check_step, make_request,
                                 make_scheduler)
from tessellm.request import FinishReason, Request, RequestStatus
from tessellm.sampling_params import SamplingParams
from tessellm.scheduling import SchedulerError
from tessellm.scheduling.batch_scheduler import PROMPT_LOGITS_CHUNK, num_new_tokens


def names(requests) -> list[str]:
    return [r.request_id for r in requests]


def shape(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def test_grant_prefill_chunk_decode_and_hit() -> None:
    r = make_request("a", 50, 4)
    assert num_new_tokens(r, 64) == 50
    assert num_new_tokens(r, 16) == 16
    assert num_new_tokens(r, 64, num_computed=48) == 2      # after a prefix-cache hit
    r.num_computed_tokens = 50
    r.output_token_ids.append(3)
    assert num_new_tokens(r, 64) == 1                       # decode
    r.num_computed_tokens = 51
    with pytest.raises(SchedulerError, match="'a'"):
        num_new_tokens(r, 64)
    logits = Request("p", [7] * 600, SamplingParams(max_tokens=1, prompt_logprobs=0), 0.0)
    assert num_new_tokens(logits, 1000) == PROMPT_LOGITS_CHUNK


@given(prompt=st.integers(1, 300), done=st.integers(0, 299), budget=st.integers(1, 500))
def test_grant_is_the_missing_tokens_under_the_budget(prompt: int, done: int,
                                                        budget: int) -> None:
    done = min(done, prompt - 1)
    assert num_new_tokens(make_request("a", prompt, 1), budget, done) == \
        min(prompt - done, budget)


def reference_tokens(specs: list[tuple[str, int, int]]) -> dict[str, list[int]]:
    """Each request alone in a roomy scheduler: the tokens any schedule must reproduce."""
    result = {}
    for rid, n_prompt, max_tokens in specs:
        t = Tracker(make_scheduler(num_blocks=256))
        r = t.add(make_request(rid, n_prompt, max_tokens, tokens=list(range(1, n_prompt + 1))))
        t.run()
        result[rid] = r.output_token_ids
    return result


def test_high_priority_arriving_last_finishes_before_the_running_low_ones() -> None:
    """The stated scenario: four low-priority requests fill a pool too small for all; a
    high-priority request arrives last, evicts the latest low one, finishes first; the low
    ones still finish, with the tokens of an unpreempted run."""
    specs = [(f"low{i}", 10, 12) for i in range(4)] + [("high", 10, 6)]
    t = Tracker(make_scheduler(num_blocks=13, block_size=4, levels=3, aging=50))
    lows = [t.add(make_request(rid, p, m, priority=2, tokens=list(range(1, p + 1))))
            for rid, p, m in specs[:4]]
    for _ in range(3):
        out = t.step()
        assert out.preempted == []
    assert all(r.status is RequestStatus.RUNNING for r in lows)
    assert t.sched.kv.num_free_blocks == 1                # 3 blocks each
    high = t.add(make_request("high", 10, 6, priority=0, tokens=list(range(1, 11))))
    out = t.step()
    assert names(out.preempted)[0] == "low3"              # the latest low one, for high
    assert ("high", 10) in shape(out)
    t.run()
    assert all(t.finished_at["high"] < t.finished_at[r.request_id] for r in lows)
    assert high.num_preemptions == 0 and lows[3].num_preemptions >= 1
    ref = reference_tokens(specs)
    for r in lows + [high]:
        assert r.output_token_ids == ref[r.request_id]
        assert r.finish_reason is FinishReason.LENGTH
    assert t.sched.kv.num_free_blocks == t.sched.kv.num_blocks


def test_a_waiting_request_never_evicts_an_equal() -> None:
    t = Tracker(make_scheduler(num_blocks=8, block_size=4, max_num_seqs=3, levels=2))
    for rid in "ab":
        t.add(make_request(rid, 10, 4, priority=1))      # up to 4 blocks each: the whole pool
    t.step()
    t.step()
    t.step()
    t.add(make_request("c", 4, 2, priority=1))
    while "a" not in t.finished_at:
        out = t.step()
        assert out.preempted == [] and "c" not in names(s.request for s in out.scheduled)
    t.run()


def test_a_full_batch_makes_room_for_a_better_request() -> None:
    """Blocks are plenty, but the sequence cap is reached: the worst running request goes."""
    t = Tracker(make_scheduler(num_blocks=64, max_num_seqs=2, levels=3))
    t.add(make_request("p1", 4, 8, priority=1))
    t.add(make_request("p2", 4, 8, priority=2))
    t.step()
    t.add(make_request("h", 4, 2, priority=0))
    out = t.step()
    assert names(out.preempted) == ["p2"]
    assert shape(out) == [("p1", 1), ("h", 4)]
    t.add(make_request("h2", 4, 2, priority=1))          # equal to p1: no slot for it
    out = t.step()
    assert out.preempted == [] and "h2" not in names(s.request for s in out.scheduled)
    t.run()


def test_no_eviction_in_vain() -> None:
    """The high request would need more than all lower-priority blocks: nobody is evicted."""
    t = Tracker(make_scheduler(num_blocks=8, block_size=4, levels=3))
    t.add(make_request("mid", 20, 2, priority=0))        # 5 blocks, 6 with its output
    t.add(make_request("low", 4, 2, priority=2))         # 1 block
    t.step()
    t.add(make_request("high", 13, 2, priority=0))       # 4 blocks; 2 free + low's 1: short
    out = t.step()
    assert out.preempted == [] and "high" not in names(s.request for s in out.scheduled)
    assert shape(out) == [("mid", 1), ("low", 1)]
    t.run()


def test_shared_blocks_of_a_victim_count_when_they_become_hits() -> None:
    """The victim holds the cached prefix the high request hits; evicting it frees those
    blocks, which the high request revives instead of computing them."""
    prefix = list(range(1, 17))                           # 4 full blocks
    t = Tracker(make_scheduler(num_blocks=7, block_size=4, levels=2, caching=True))
    low = t.add(make_request("low", 21, 8, priority=1, tokens=prefix + [99] * 5))
    t.step()                                              # low holds 6 blocks, 5 cached
    assert len(t.sched.kv.block_table("low")) == 6 and t.sched.kv.num_free_blocks == 1
    high = t.add(make_request("high", 24, 2, priority=0, tokens=prefix + [50] * 8))
    # high hits low's first 4 blocks and needs 2 fresh ones: 1 is free. Evicting low frees
    # its 6 blocks, 4 of which high then revives: 2 + 4 <= 7.
    out = t.step()
    assert names(out.preempted) == ["low"]
    assert shape(out) == [("high", 8)] and high.num_computed_tokens == 24   # 16 hit + 8
    assert t.sched.prefix_cache_hits == 16
    t.run()
    assert low.finish_reason is FinishReason.LENGTH and len(low.output_token_ids) == 8


def test_the_budget_goes_to_the_better_request_first() -> None:
    t = Tracker(make_scheduler(budget=16, levels=3))
    t.add(make_request("low", 100, 2, priority=2))
    out = t.step()
    assert shape(out) == [("low", 16)]
    t.add(make_request("high", 10, 2, priority=0))
    out = t.step()
    assert shape(out) == [("high", 10), ("low", 6)] and out.preempted == []
    t.run()


def test_running_requests_preempt_the_lowest_priority_first() -> None:
    """high arrived last, but when blocks run out the low request is the victim."""
    t = Tracker(make_scheduler(num_blocks=4, block_size=4, levels=3))
    t.add(make_request("low", 6, 8, priority=2))
    t.add(make_request("high", 6, 8, priority=0))
    for _ in range(3):
        assert t.step().preempted == []
    out = t.step()                                        # both need a 3rd block; 0 free
    assert names(out.preempted) == ["low"] and shape(out) == [("high", 1)]
    t.run()
    assert t.finished_at["high"] < t.finished_at["low"]


def test_an_aged_request_is_not_evicted_by_those_it_overtook() -> None:
    t = Tracker(make_scheduler(num_blocks=64, max_num_seqs=1, levels=3, aging=2))
    t.add(make_request("first", 4, 6, priority=0))
    t.add(make_request("old", 4, 6, priority=2))
    for _ in range(5):
        t.step()
    assert t.sched.effective_priority("old") == 0 and names(t.sched.running) == ["first"]
    t.add(make_request("new", 4, 3, priority=0))        # arrives later: queued behind "old"
    while "first" not in t.finished_at:
        t.step()
    out = t.step()
    assert shape(out) == [("old", 4)]
    assert t.sched.effective_priority("old") == 0       # its admitted level, while it runs
    t.add(make_request("newer", 4, 3, priority=0))
    out = t.step()
    assert out.preempted == [] and names(t.sched.running) == ["old"]
    t.run()
    assert t.finished_at["old"] < t.finished_at["new"] < t.finished_at["newer"]


def stream_until(aging: int, steps: int) -> tuple[Tracker, Request]:
    """One seq slot; a priority-0 request arrives every other step; a priority-2 request
    arrived first. Returns after `steps` steps with the stream still going."""
    t = Tracker(make_scheduler(num_blocks=64, max_num_seqs=1, levels=3, aging=aging))
    t.add(make_request("h0", 4, 2, priority=0))
    low = t.add(make_request("low", 4, 2, priority=2))
    for i in range(steps):
        if i % 2 == 0:
            t.add(make_request(f"h{i + 1}", 4, 2, priority=0))
        t.step()
    return t, low


def test_aging_prevents_starvation() -> None:
    starved, low = stream_until(aging=0, steps=60)
    assert low.status is RequestStatus.WAITING and low.num_computed_tokens == 0
    for r in starved.sched.running + starved.sched.waiting:
        starved.sched.abort(r.request_id)
    aged, low = stream_until(aging=5, steps=60)
    assert low.finish_reason is FinishReason.LENGTH
    assert aged.finished_at["low"] < 25
    aged.run()


workload = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 8),
                              st.integers(0, 2)), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 4),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 40),
       aging=st.sampled_from([0, 1, 3, 10]),
       caching=st.booleans(), shared=st.booleans())
def test_random_priority_workloads(reqs: list[tuple[int, int, int, int]], block_size: int,
                                   extra_blocks: int, max_num_seqs: int, budget: int,
                                   aging: int, caching: bool,
                                   shared: bool) -> None:
    """Requests of random priorities arrive at random steps in a pool that forces
    preemption. Every step keeps the limits, the block accounting and the eviction rule;
    every request finishes with the tokens it has when run alone."""
    needed = max(-(-(p + m) // block_size) for p, m, _, _ in reqs)
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           levels=3, aging=aging, caching=caching)
    t = Tracker(sched)
    prompts = [list(range(1, p + 1)) if shared else [i + 1] * p
               for i, (p, _, _, _) in enumerate(reqs)]
    requests = [make_request(str(i), p, m, priority=prio, tokens=prompts[i])
                for i, (p, m, _, prio) in enumerate(reqs)]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    while order or sched.has_unfinished:
        while order and reqs[order[0]][2] <= t.steps:
            t.add(requests[order.pop(0)])
        busy = sched.has_unfinished
        out = t.step()
        assert out.num_batched_tokens >= 1 or not busy      # progress every busy step
        assert t.steps < 5000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.num_waiting == sched.num_running == 0
    for r, (_, m, _, _) in zip(requests, reqs):
        assert_finished_as_alone(r, m)
    event(f"preemptions: {min(sched.num_preemptions, 3)}")
    event(f"evictions for a better waiting request: {min(t.evictions_for_waiting, 2)}")


def test_preempt_is_the_one_hook_for_victims() -> None:
    """Every eviction goes through Scheduler.preempt (what a swap mode overrides), after the
    victim left `running`, and before the step's output is returned."""
    from tessellm.scheduler import Scheduler

    calls: list[tuple[str, int]] = []

    class Recording(Scheduler):
        def preempt(self, request: Request) -> None:
            assert request not in self.running
            calls.append((request.request_id, len(self.kv.block_table(request.request_id))))
            super().preempt(request)

    base = make_scheduler(num_blocks=4, block_size=4, levels=2)
    t = Tracker(Recording(base.config, base.kv))
    t.add(make_request("low", 8, 4, priority=1))
    t.step()
    t.add(make_request("high", 8, 2, priority=0))
    out = t.step()
    assert names(out.preempted) == ["low"] and calls == [("low", 2)]
    assert t.sched.num_preemptions == 1
    t.run()


@settings(max_examples=80, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 4]), extra_blocks=st.integers(0, 4),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 40),
       aging=st.sampled_from([0, 2]), data=st.data())
def test_random_aborts_and_a_moving_sla_cap_leave_nothing_behind(
        reqs: list[tuple[int, int, int, int]], block_size: int, extra_blocks: int,
        max_num_seqs: int, budget: int, aging: int, data: st.DataObject) -> None:
    """Requests of random priorities are aborted at random times (also between schedule()
    and update_from_output()) while synthetic step timings move the SLA cap up and down."""
    from tessellm.scheduler import SLAConfig
    needed = max(-(-(p + m) // block_size) for p, m, _, _ in reqs)
    sla = SLAConfig(itl_p99_s=0.5, window_steps=1, grow_step=1)
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           levels=3, aging=aging, caching=True, sla=sla)
    t = Tracker(sched)
    requests = [t.add(make_request(str(i), p, m, priority=prio, tokens=[i % 3 + 1] * p))
                for i, (p, m, _, prio) in enumerate(reqs)]
    while sched.has_unfinished:
        levels = {r.request_id: sched.effective_priority(r.request_id)
                  for r in sched.running + sched.waiting}
        was_running = {r.request_id for r in sched.running}
        cap = sched.max_num_seqs_now
        out = sched.schedule()
        check_step(sched, out, levels, was_running, t.arrival)
        admitted = [s for s in out.scheduled if s.request.request_id not in was_running]
        assert not admitted or sched.num_running <= cap
        if data.draw(st.integers(0, 7)) == 0:
            sched.abort(data.draw(st.sampled_from(requests)).request_id)
        sched.update_from_output(out, t.model.run(out))
        sched.observe_step(data.draw(st.sampled_from([0.1, 1.0])), out.num_decodes)
        t.steps += 1
        assert t.steps < 5000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(r.is_finished for r in requests)
