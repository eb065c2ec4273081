"""SLA batch sizing with synthetic step observations: shrink on p99 ITL over the SLA (from the
batch in use), grow while throughput is under target, hold otherwise; the scheduler admits
up to the moving cap."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from scheduling_fixtures import Tracker, make_request, make_scheduler
from tessellm.errors import ConfigError
from tessellm.scheduler import SchedulerConfig
from tessellm.scheduling import SLABatchSizer, SLAConfig
from tessellm.scheduling.sla import p99


def feed(sizer: SLABatchSizer, n: int, duration: float, batch: int) -> None:
    for _ in range(n):
        sizer.observe(duration, batch)


def test_shrinks_from_the_batch_in_use_and_grows_back() -> None:
    sizer = SLABatchSizer(SLAConfig(itl_p99_s=0.05, window_steps=4, grow_step=2), 32)
    assert sizer.cap == 32
    feed(sizer, 3, 0.1, 16)
    assert sizer.cap == 32                                 # no decision before a full window
    feed(sizer, 1, 0.1, 16)
    assert sizer.cap == 12 and sizer.num_shrinks == 1      # floor(16 * 0.75): not from 32
    assert sizer.last_p99_itl_s == pytest.approx(0.1)
    feed(sizer, 4, 0.1, 12)
    assert sizer.cap == 9
    feed(sizer, 4, 0.01, 9)                                # within the SLA, no target: grow
    assert sizer.cap == 11 and sizer.num_grows == 1
    feed(sizer, 60, 0.01, 11)
    assert sizer.cap == 32                                 # never above max_num_seqs


def test_one_slow_step_in_a_hundred_is_within_p99() -> None:
    sizer = SLABatchSizer(SLAConfig(itl_p99_s=0.05, window_steps=100), 8)
    feed(sizer, 99, 0.01, 8)
    feed(sizer, 1, 1.0, 8)
    assert sizer.cap == 8 and sizer.num_shrinks == 0 and sizer.last_p99_itl_s == 0.01
    feed(sizer, 98, 0.01, 8)
    feed(sizer, 2, 1.0, 8)
    assert sizer.cap == 6


def test_throughput_target_holds_the_cap_once_met() -> None:
    cfg = SLAConfig(itl_p99_s=0.05, target_tokens_per_s=500, window_steps=2, grow_step=1)
    sizer = SLABatchSizer(cfg, 16)
    feed(sizer, 2, 0.2, 16)                                # over the SLA
    assert sizer.cap == 12
    feed(sizer, 2, 0.02, 4)                                # 200 tok/s < 500: grow
    assert sizer.cap == 13 and sizer.last_tokens_per_s == pytest.approx(200)
    feed(sizer, 2, 0.02, 12)                               # 600 tok/s >= 500: hold
    assert sizer.cap == 13


def test_prefill_only_steps_are_not_itl_samples_and_min_is_kept() -> None:
    sizer = SLABatchSizer(SLAConfig(itl_p99_s=0.01, window_steps=2, min_num_seqs=3), 8)
    feed(sizer, 10, 5.0, 0)
    assert sizer.cap == 8 and sizer.last_p99_itl_s is None
    for _ in range(10):
        feed(sizer, 2, 1.0, 8)
    assert sizer.cap == 3


@given(obs=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 64)), max_size=300),
       window=st.integers(1, 16), min_seqs=st.integers(1, 8))
def test_cap_stays_in_bounds(obs, window, min_seqs) -> None:
    sizer = SLABatchSizer(SLAConfig(0.1, None, window, min_seqs), 16)
    for duration, batch in obs:
        sizer.observe(duration, batch)
        assert min_seqs <= sizer.cap <= 16


@pytest.mark.parametrize("kwargs", [dict(itl_p99_s=0), dict(itl_p99_s=0.1, window_steps=0),
                                    dict(itl_p99_s=0.1, shrink_factor=1.0),
                                    dict(itl_p99_s=0.1, target_tokens_per_s=-1),
                                    dict(itl_p99_s=0.1, grow_step=0)])
def test_config_validation(kwargs) -> None:
    with pytest.raises(ConfigError):
        SLAConfig(**kwargs)


def test_scheduler_validation() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(4, 32, 64, sla=SLAConfig(0.1, min_num_seqs=5))
    with pytest.raises(ConfigError):
        SLABatchSizer(SLAConfig(0.1, min_num_seqs=5), 4)
    with pytest.raises(ConfigError):
        SLABatchSizer(SLAConfig(0.1), 4).observe(-1.0, 2)


def test_p99_nearest_rank() -> None:
    assert p99([3.0]) == 3.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_the_scheduler_admits_up_to_the_sla_cap() -> None:
    sched = make_scheduler(max_num_seqs=8, sla=SLAConfig(itl_p99_s=0.05, window_steps=2))
    assert sched.max_num_seqs_now == 8
    t = Tracker(sched)
    for i in range(8):
        t.add(make_request(str(i), 4, 30))
    t.step()
    assert sched.num_running == 8
    sched.observe_step(0.2, 8)
    sched.observe_step(0.2, 8)
    assert sched.max_num_seqs_now == 6 and sched.sla.num_shrinks == 1
    for i in range(8, 12):
        t.add(make_request(str(i), 4, 2))
    for _ in range(5):
        out = t.step()
        assert out.preempted == [] and sched.num_running == 8   # running ones are kept
    while sched.num_running > 0:
        t.step()
        assert sched.num_running <= 8
        if any(int(r.request_id) >= 8 for r in sched.running):
            assert sched.num_running <= 6                      # admitted under the new cap
    t.run()
    assert sched.max_num_seqs_now == 6


def test_observations_are_ignored_without_a_policy() -> None:
    sched = make_scheduler(max_num_seqs=4)
    sched.observe_step(10.0, 4)
    assert sched.sla is None and sched.max_num_seqs_now == 4
