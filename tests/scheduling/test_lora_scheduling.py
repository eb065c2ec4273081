"""LoRA in the scheduler: at most max_loras distinct adapters among running requests after
every step (the device slot table's size), whatever the arrivals, priorities and
preemptions; every request still finishes with the tokens it has alone and nothing leaks; a
request of a new adapter waits while the slots are taken and runs once one frees."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import event, given, settings, strategies as st

from scheduling_fixtures import (Tracker, assert_finished_as_alone, make_request,
                                 make_scheduler)
from tessellm.request import FinishReason


def _with_adapter(request, adapter_id: int):
    request.adapter = None if adapter_id == 0 else SimpleNamespace(int_id=adapter_id)
    return request


def _running_adapters(sched) -> set[int]:
    return {r.lora_int_id for r in sched.running} - {0}


workload = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 6),
                              st.integers(0, 2), st.integers(0, 4)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(reqs=workload, max_loras=st.integers(1, 3), extra_blocks=st.integers(0, 4),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 40), caching=st.booleans())
def test_random_workloads_never_run_more_adapters_than_slots(
        reqs: list[tuple[int, int, int, int, int]], max_loras: int, extra_blocks: int,
        max_num_seqs: int, budget: int, caching: bool) -> None:
    block_size = 2
    needed = max(-(-(p + m) // block_size) for p, m, _, _, _ in reqs)
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           levels=3, caching=caching, max_loras=max_loras)
    t = Tracker(sched)
    requests = [_with_adapter(make_request(str(i), p, m, priority=prio,
                                           tokens=list(range(1, p + 1))), a)
                for i, (p, m, _, prio, a) in enumerate(reqs)]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    most = 0
    while order or sched.has_unfinished:
        while order and reqs[order[0]][2] <= t.steps:
            t.add(requests[order.pop(0)])
        t.step()
        running = _running_adapters(sched)
        assert len(running) <= max_loras, running
        most = max(most, len(running))
        assert t.steps < 5000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    for r, (_, m, _, _, _) in zip(requests, reqs):
        assert_finished_as_alone(r, m)
    event(f"most adapters running at once: {most}")


def test_a_new_adapter_waits_for_a_free_slot() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, max_loras=1)
    t = Tracker(sched)
    first = t.add(_with_adapter(make_request("a", 4, 6), 1))
    t.step()
    second = t.add(_with_adapter(make_request("b", 4, 2), 2))
    base = t.add(_with_adapter(make_request("c", 4, 2), 0))
    t.step()
    # adapter 2 cannot run beside adapter 1: admission stops there (no skipping ahead)
    assert {r.request_id for r in sched.running} == {"a"}
    t.run()
    assert first.finish_reason is second.finish_reason is base.finish_reason \
        is FinishReason.LENGTH
    assert t.finished_at["a"] < t.finished_at["b"]
