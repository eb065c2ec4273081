"""Swap preemption in the scheduler: random workloads in a pool that forces preemption, with
a random host pool (sometimes too small: recompute fallback), random aborts. Every step keeps
the limits and block accounting; host blocks never leak or double up; swapped-out requests
hold no device blocks and keep their computed tokens; swap pairs name the right blocks; every
request finishes with the tokens it has alone; at the end every device and host block is
free."""
from __future__ import annotations

from hypothesis import event, given, settings, strategies as st

from scheduling_fixtures import (Tracker, assert_finished_as_alone, check_step, make_request,
                                 make_scheduler)
from tessellm.cache.block_pool import BlockPoolError
from tessellm.cache.host_pool import HostBlockPool
from tessellm.cache.kv_manager import KVCacheManager
from tessellm.request import FinishReason, RequestStatus

import pytest

workload = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 6),
                              st.integers(0, 2)), min_size=1, max_size=6)


def check_swap(sched, out, tables_before: dict[str, list[int]]) -> None:
    swap, kv = sched.swap_space, sched.kv
    held = [b for r in sched.waiting for b in swap.host_table(r.request_id)]
    assert len(held) == len(set(held))
    assert swap.pool.num_free_blocks + len(held) == swap.pool.num_blocks   # no host leak
    for r in sched.waiting:
        if swap.is_swapped(r.request_id):
            assert kv.block_table(r.request_id) == []
            assert len(swap.host_table(r.request_id)) == kv.num_blocks_needed(
                r.num_computed_tokens) - kv.num_dead_blocks(r.num_computed_tokens) > 0
        else:
            assert r.num_computed_tokens == 0
    for v in out.preempted:   # swap_out pairs: the victim's blocks inside the window, in order
        host = swap.host_table(v.request_id)
        if host:
            first, n = kv.num_dead_blocks(v.num_computed_tokens), len(host)
            assert [p for p in out.swap_out if p[1] in host] == \
                list(zip(tables_before[v.request_id][first:first + n], host))
    host_dst = [h for _, h in out.swap_out]
    assert len(host_dst) == len(set(host_dst))    # a shared device block may go out twice
    resumed = {s.request.request_id for s in out.scheduled if s.request.request_id
               not in tables_before}
    in_dev = {d for _, d in out.swap_in}
    assert in_dev <= {b for rid in resumed for b in kv.block_table(rid)}
    for b in {b for r in sched.running for b in kv.block_table(r.request_id)}:
        assert kv.pool.ref_count(b) >= 1
    assert KVCacheManager.NULL_BLOCK not in {d for _, d in out.swap_in} | {
        d for d, _ in out.swap_out}


@settings(max_examples=150, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 4]), extra_blocks=st.integers(0, 4),
       max_num_seqs=st.integers(1, 4), budget=st.integers(1, 30),
       host_blocks=st.integers(0, 30), caching=st.booleans(),
       window=st.sampled_from([0, 0, 2, 5, 8]), data=st.data())
def test_random_swap_workloads(reqs, block_size, extra_blocks, max_num_seqs, budget,
                               host_blocks, caching, window, data) -> None:
    """(window > 0: the KV manager releases the blocks out of a sliding window; a victim
    swaps out only the blocks inside it and resumes with those.)"""
    needed = max(-(-(p + m) // block_size) for p, m, _, _ in reqs)
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget, levels=3,
                           aging=2, caching=caching, swap_blocks=host_blocks, window=window)
    t = Tracker(sched)
    requests = [make_request(str(i), p, m, priority=prio, tokens=[i % 2 + 1] * p)
                for i, (p, m, _, prio) in enumerate(reqs)]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    aborted: set[str] = set()
    while order or sched.has_unfinished:
        while order and reqs[order[0]][2] <= t.steps:
            t.add(requests[order.pop(0)])
        levels = {r.request_id: sched.effective_priority(r.request_id)
                  for r in sched.running + sched.waiting}
        was_running = {r.request_id for r in sched.running}
        tables = {rid: sched.kv.block_table(rid) for rid in was_running}
        out = sched.schedule()
        check_step(sched, out, levels, was_running, t.arrival)
        check_swap(sched, out, tables)
        if data.draw(st.integers(0, 15)) == 0:
            victim = data.draw(st.sampled_from(requests))
            if sched.abort(victim.request_id) is not None:
                aborted.add(victim.request_id)
        sched.update_from_output(out, t.model.run(out))
        t.steps += 1
        assert t.steps < 5000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.swap_space.pool.num_free_blocks == host_blocks
    assert sched.swap_space.num_swapped == 0
    stats = sched.swap_stats
    assert stats.blocks_in <= stats.blocks_out
    for r, (p, m, _, _) in zip(requests, reqs):
        if r.request_id in aborted:
            continue
        assert_finished_as_alone(r, m)
    event(f"swap-outs: {min(stats.swap_outs, 3)}; fallbacks: {min(stats.fallbacks, 1)}")


def test_swap_keeps_computed_tokens_and_resumes_without_recompute() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, levels=2, swap_blocks=8)
    t = Tracker(sched)
    low = t.add(make_request("low", 8, 4, priority=1))
    t.step()
    high = t.add(make_request("high", 8, 2, priority=0))
    out = t.step()
    assert [r.request_id for r in out.preempted] == ["low"]
    assert low.num_computed_tokens == 8 and low.status is RequestStatus.WAITING
    assert len(out.swap_out) == 2 and sched.swap_space.host_table("low") == [0, 1]
    computed_before = t.model.tokens_computed
    t.run()
    assert high.finish_reason is FinishReason.LENGTH and low.finish_reason is FinishReason.LENGTH
    # low recomputed nothing: after high's prefill, 1 decode of high and 3 of low
    assert t.model.tokens_computed - computed_before == 1 + 3
    assert sched.swap_stats.blocks_in == sched.swap_stats.blocks_out == 2


def test_host_pool_refuses_bad_frees_and_short_allocations() -> None:
    pool = HostBlockPool(3)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.allocate(2) is None and pool.num_free_blocks == 1
    with pytest.raises(BlockPoolError):
        pool.free([0, 0])
    with pytest.raises(BlockPoolError):
        pool.free([2])
    pool.free(a)
    assert pool.num_free_blocks == 3 and pool.allocate(3) == [2, 0, 1]


def test_simulator_reports_swap_traffic(capsys) -> None:
    import json

    from tessellm.cli.main import main
    args = ["bench", "schedule", "--num-requests", "400", "--seed", "1", "--num-kv-blocks",
            "96", "--max-num-seqs", "16", "--request-rate", "400"]
    assert main(args + ["--preemption-mode", "swap"]) == 0
    swap = json.loads(capsys.readouterr().out)
    assert swap["finished"] == 400 and swap["preemptions"] > 0
    assert swap["swap"]["blocks_out"] > 0 and swap["swap"]["fallbacks"] == 0
    assert swap["swap"]["blocks_in"] == swap["swap"]["blocks_out"]
    assert swap["scheduler"]["num_host_kv_blocks"] == 96
    assert main(args + ["--preemption-mode", "swap", "--num-host-kv-blocks", "2"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["finished"] == 400 and short["swap"]["fallbacks"] > 0
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["swap"] == {"blocks_out": 0, "blocks_in": 0}
