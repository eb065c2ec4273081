"""Request scheduler: configuration, the waiting order (effective priority, arrival),
aging by steps since arrival, and preempted requests keeping their place."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from scheduling_fixtures import make_request, make_scheduler
from tessellm.cache.kv_manager import KVCacheManager
from tessellm.errors import ConfigError
from tessellm.scheduler import SchedulerConfig
from tessellm.scheduling import RequestScheduler


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


@pytest.mark.parametrize("kwargs", [dict(priority_levels=0), dict(priority_levels=65),
                                    dict(aging_interval_steps=-1)])
def test_config_validation(kwargs) -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(4, 32, 64, **kwargs)
    with pytest.raises(ConfigError):
        RequestScheduler(kwargs.get("priority_levels", 3), kwargs.get("aging_interval_steps", 0),
                         64, KVCacheManager(8, 4))


def test_waiting_order_is_priority_then_arrival() -> None:
    sched = make_scheduler(levels=3, max_num_seqs=1)
    for rid, prio in (("a", 2), ("b", 1), ("c", 2), ("d", 0), ("e", 1)):
        sched.add_request(make_request(rid, 4, 2, priority=prio))
    assert ids(sched.waiting) == ["d", "b", "e", "a", "c"]
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["d"]


def test_aging_one_level_per_interval_since_arrival() -> None:
    sched = make_scheduler(levels=3, aging=3, max_num_seqs=1)
    sched.add_request(make_request("hog", 4, 100, priority=0))
    sched.add_request(make_request("low", 4, 2, priority=2))
    seen = []
    for _ in range(8):
        seen.append(sched.effective_priority("low"))
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 5 for s in out.scheduled})
    assert seen == [2, 2, 2, 1, 1, 1, 0, 0]
    late = make_request("late", 4, 2, priority=2)
    sched.add_request(late)
    assert sched.effective_priority("late") == 2
    assert ids(sched.waiting) == ["low", "late"]
    assert sched.num_steps == 8


@settings(max_examples=50, deadline=None)
@given(prios=st.lists(st.integers(0, 3), min_size=1, max_size=12),
       gaps=st.lists(st.integers(0, 4), min_size=12, max_size=12), interval=st.integers(0, 5))
def test_queue_order_matches_a_sort(prios: list[int], gaps: list[int], interval: int) -> None:
    """Requests arrive between steps of a scheduler that never admits anyone (one seq slot,
    held by a long request); the queue always equals the sort by (aged priority, arrival)."""
    sched = make_scheduler(levels=4, aging=interval, max_num_seqs=1)
    sched.add_request(make_request("hog", 4, 200, priority=0))
    out = sched.schedule()
    sched.update_from_output(out, {"hog": 5})
    arrived: list[tuple[str, int, int]] = []     # id, priority, arrival step
    for i, (p, gap) in enumerate(zip(prios, gaps)):
        sched.add_request(make_request(str(i), 4, 2, priority=p))
        arrived.append((str(i), p, sched.num_steps))
        for _ in range(gap):
            out = sched.schedule()
            sched.update_from_output(out, {"hog": 5})
        now = sched.num_steps

        def eff(p: int, t: int, now: int = now) -> int:
            return p if interval == 0 else max(0, p - (now - t) // interval)

        expected = [rid for rid, p, t in sorted(arrived, key=lambda a: (eff(a[1], a[2]),
                                                                        int(a[0])))]
        assert ids(sched.waiting) == expected
        assert [sched.effective_priority(rid) for rid in expected] == \
            sorted(eff(p, t) for _, p, t in arrived)
    for rid, *_ in arrived:
        sched.abort(rid)
    sched.abort("hog")
    assert sched.num_waiting == 0 and not sched.has_unfinished


def test_a_preempted_request_goes_back_ahead_of_later_arrivals_of_its_class() -> None:
    """a, b (priority 1) run and fill the pool; c (priority 1) waits; h (priority 0) evicts b.
    b returns ahead of c, and is admitted before it once h is done."""
    sched = make_scheduler(num_blocks=4, block_size=4, levels=2, max_num_seqs=4)
    a, b = make_request("a", 8, 4, priority=1), make_request("b", 8, 4, priority=1)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {"a": 5, "b": 5})
    c = make_request("c", 4, 2, priority=1)
    h = make_request("h", 3, 1, priority=0)                 # one block
    sched.add_request(c)
    sched.add_request(h)
    out = sched.schedule()
    assert out.preempted == [b]
    assert [s.request.request_id for s in out.scheduled] == ["a", "h"]   # decode first
    assert ids(sched.waiting) == ["b", "c"]
    sched.update_from_output(out, {"a": 5, "h": 5})         # h finishes (max_tokens=1)
    admitted = []
    while sched.has_unfinished:
        out = sched.schedule()
        admitted += [s.request.request_id for s in out.scheduled
                     if s.request.request_id not in admitted]
        sched.update_from_output(out, {s.request.request_id: 5 for s in out.scheduled
                                       if s.request.num_computed_tokens + s.num_tokens
                                       == s.request.num_tokens})
    assert admitted == ["a", "b", "c"]          # c (one block) never skipped ahead of b
