"""Scheduler: continuous batching, chunked prefill, recompute preemption, and random workloads."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.errors import ConfigError, InvalidRequestError
from tessellm.request import FinishReason, Request, RequestStatus
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput

TOKEN = 5   # what the fake model always samples (never EOS)


def make_request(rid: str, n_prompt: int, max_tokens: int, eos: frozenset[int] = frozenset()
                 ) -> Request:
    return Request(rid, [7] * n_prompt, SamplingParams(max_tokens=max_tokens),
                   arrival_time=0.0, eos_token_ids=eos)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   threshold: int = 0) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, threshold)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def sample_all(out: SchedulerOutput, token: int = TOKEN) -> dict[str, int]:
    """The fake model: one token for every request this step computes to the end."""
    return {s.request.request_id: token for s in out.scheduled
            if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens}


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, sample_all(out))


def shape(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler()
    r = make_request("a", 10, 3)
    sched.add_request(r)
    out, done = step(sched)
    assert shape(out) == [("a", 10)] and out.num_batched_tokens == 10 and done == []
    assert r.status is RequestStatus.RUNNING and r.output_token_ids == [TOKEN]
    out, done = step(sched)
    assert shape(out) == [("a", 1)] and out.num_decodes == 1 and done == []
    out, done = step(sched)
    assert done == [r] and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids == [TOKEN] * 3 and r.num_tokens == 13
    assert not sched.has_unfinished and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    r = make_request("a", 50, 2)
    sched.add_request(r)
    chunks = []
    for _ in range(4):
        out, _ = step(sched)
        chunks.append(out.scheduled[0].num_tokens)
        assert sched.kv.block_table("a") == list(range(1, 1 + sched.kv.num_blocks_needed(
            r.num_computed_tokens)))                         # block 0 is the null block
    assert chunks == [16, 16, 16, 2]
    assert r.output_token_ids == [TOKEN]                    # sampled only after the last chunk
    out, done = step(sched)
    assert shape(out) == [("a", 1)] and done == [r]


def test_long_prefill_threshold_caps_each_request() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, threshold=8)
    sched.add_request(make_request("a", 20, 2))
    sched.add_request(make_request("b", 5, 2))
    out, _ = step(sched)
    assert shape(out) == [("a", 8), ("b", 5)]
    out, _ = step(sched)
    assert shape(out) == [("b", 1), ("a", 8)]               # b decodes, first


def test_decodes_come_first() -> None:
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("a", 20, 3))
    sched.add_request(make_request("b", 3, 3))
    out, _ = step(sched)
    assert shape(out) == [("a", 12)]
    out, _ = step(sched)
    assert shape(out) == [("a", 8), ("b", 3)]
    out, _ = step(sched)
    assert shape(out) == [("a", 1), ("b", 1)] and out.num_decodes == 2
    sched.add_request(make_request("c", 6, 1))
    out, _ = step(sched)
    assert shape(out) == [("a", 1), ("b", 1), ("c", 6)] and out.num_decodes == 2


def test_seq_cap_and_fifo_without_skipping() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), 3, 2))
    out, _ = step(sched)
    assert shape(out) == [("0", 3), ("1", 3)] and sched.num_waiting == 2
    # A big request at the head of the queue blocks the small ones behind it.
    sched2 = make_scheduler(num_blocks=6, block_size=4)
    sched2.add_request(make_request("small", 4, 2))
    sched2.add_request(make_request("big", 20, 2))
    sched2.add_request(make_request("tiny", 1, 1))
    sched2.kv.allocate_slots(make_request("other", 1, 1), 1)  # an outside holder of one block
    out = sched2.schedule()
    assert shape(out) == [("small", 4)] and sched2.num_waiting == 2


def test_preemption_recomputes_the_latest_arrival_and_all_finish() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 6, 8), make_request("b", 6, 8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        out, _ = step(sched)
        assert out.preempted == []
    # a now needs a third block: the pool is empty, so b (the later arrival) is preempted.
    out = sched.schedule()
    assert out.preempted == [b] and shape(out) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [TOKEN] * 3
    assert sched.kv.block_table("b") == [] and sched.waiting == (b,)
    sched.update_from_output(out, sample_all(out))
    steps = 0
    while sched.has_unfinished:
        step(sched)
        steps += 1
        assert steps < 100
    for r in (a, b):
        assert r.output_token_ids == [TOKEN] * 8 and r.finish_reason is FinishReason.LENGTH
    assert sched.kv.num_free_blocks == 4


def test_a_request_that_is_the_latest_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_request("a", 2, 5), make_request("b", 4, 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)                                              # one block each
    out = sched.schedule()                                   # b's 5th token needs a block
    assert shape(out) == [("a", 1)] and out.preempted == [b]
    assert sched.running == (a,) and sched.waiting == (b,)
    sched.update_from_output(out, sample_all(out))
    while sched.has_unfinished:
        step(sched)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 5


def test_preempted_requests_return_in_arrival_order_before_new_ones() -> None:
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=64)
    reqs = [make_request(str(i), 2, 3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)                                              # one block each, pool empty
    late = make_request("late", 1, 1)
    sched.add_request(late)
    out = sched.schedule()                                   # "0" needs a block: "2" then "1" go
    assert out.preempted == [reqs[2], reqs[1]]
    assert sched.waiting == (reqs[1], reqs[2], late)


def test_eos_and_max_model_len_finish() -> None:
    sched = make_scheduler(max_model_len=12)
    r = make_request("eos", 3, 10, eos=frozenset({TOKEN}))
    long = make_request("long", 9, 10)
    sched.add_request(r)
    sched.add_request(long)
    _, done = step(sched)
    assert done == [r] and r.finish_reason is FinishReason.STOP
    while sched.has_unfinished:
        step(sched)
    assert long.finish_reason is FinishReason.LENGTH and long.num_tokens == 12
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_abort_waiting_running_and_in_flight() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b, c = make_request("a", 4, 5), make_request("b", 4, 5), make_request("c", 4, 5)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    assert sched.abort("b") is b and b.finish_reason is FinishReason.ABORT
    assert sched.abort("b") is None and sched.abort("zzz") is None
    out = sched.schedule()
    assert sched.abort("a") is a                             # between schedule and update
    assert sched.kv.block_table("a") == []
    assert sched.update_from_output(out, sample_all(out)) == []
    assert a.output_token_ids == [TOKEN] and sched.running == ()
    out, _ = step(sched)
    assert shape(out) == [("c", 4)]
    assert sched.abort("c") is c and not sched.has_unfinished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule().is_empty


def test_update_rejects_mismatched_samples_and_changes_nothing() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 4, 3), make_request("b", 10, 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert shape(out) == [("a", 4), ("b", 4)]
    for bad in ({}, {"a": 1, "b": 1}, {"a": 1, "zzz": 1}):
        with pytest.raises(SchedulerError):
            sched.update_from_output(out, bad)
        assert a.num_computed_tokens == 0 and b.num_computed_tokens == 0
    sched.update_from_output(out, {"a": 1})
    with pytest.raises(SchedulerError):
        sched.update_from_output(out, {"a": 1})              # applied twice


def test_add_request_validation() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    sched.add_request(make_request("a", 4, 4))
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("a", 4, 4))           # duplicate id
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("b", 0, 4))
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("c", 21, 4))          # > max_model_len
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("d", 10, 8))          # 17 KV tokens > 16 slots
    sched.add_request(make_request("e", 10, 7))              # 16 KV tokens: fits exactly
    capped = make_scheduler(num_blocks=4, block_size=4, max_model_len=17)
    f = make_request("f", 15, 100)                           # stops at 17 tokens: 16 in KV
    capped.add_request(f)
    with pytest.raises(InvalidRequestError):
        capped.add_request(make_request("g", 17, 100))       # 17 prompt tokens in KV
    while capped.has_unfinished:
        step(capped)
    assert len(f.output_token_ids) == 2 and f.finish_reason is FinishReason.LENGTH
    done = make_request("g", 3, 1)
    done.status = RequestStatus.FINISHED
    with pytest.raises(InvalidRequestError):
        sched.add_request(done)


def test_no_progress_raises_naming_the_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.kv.allocate_slots(make_request("leak", 1, 1), 12)   # a bug holds 3 blocks
    sched.add_request(make_request("victim", 8, 1))
    with pytest.raises(SchedulerError, match="victim"):
        sched.schedule()


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(max_num_batched_tokens=-1),
                                    dict(max_model_len=0), dict(long_prefill_token_threshold=-1)])
def test_config_validation(kwargs: dict[str, int]) -> None:
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ConfigError):
        SchedulerConfig(**{**base, **kwargs})


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg, kv = sched.config, sched.kv
    sizes = [s.num_tokens for s in out.scheduled]
    assert out.num_batched_tokens == sum(sizes) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= sched.num_running <= cfg.max_num_seqs
    assert all(n >= 1 for n in sizes)
    if cfg.long_prefill_token_threshold:
        assert max(sizes, default=0) <= cfg.long_prefill_token_threshold
    assert sizes == sorted(sizes, key=lambda n: n != 1)      # one-token entries first
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    assert not set(ids) & {r.request_id for r in out.preempted}
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING
        assert r.num_computed_tokens + s.num_tokens <= r.num_tokens
        assert len(kv.block_table(r.request_id)) == kv.num_blocks_needed(
            r.num_computed_tokens + s.num_tokens)
    tables = [kv.block_table(r.request_id) for r in sched.running]
    flat = [b for t in tables for b in t]
    assert len(flat) == len(set(flat))                        # no block in two tables
    assert len(flat) + kv.num_free_blocks == kv.num_blocks    # no leak
    assert all(kv.block_table(r.request_id) == [] for r in sched.waiting)


workload = st.lists(st.tuples(st.integers(1, 100), st.integers(1, 30), st.integers(0, 6)),
                    min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 2, 4, 16]),
       extra_blocks=st.integers(0, 12), max_num_seqs=st.integers(1, 5),
       budget=st.integers(1, 48), threshold=st.sampled_from([0, 0, 3, 16]))
def test_random_workloads_finish_within_limits(
        reqs: list[tuple[int, int, int]], block_size: int, extra_blocks: int,
        max_num_seqs: int, budget: int, threshold: int) -> None:
    """Requests arrive at random steps; a fake model samples TOKEN. Every step keeps the
    limits, and every request ends with exactly max_tokens outputs and no block held."""
    needed = max(-(-(p + m) // block_size) for p, m, _ in reqs)   # the engine's admission rule
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           max_model_len=256, threshold=threshold)
    requests = [make_request(str(i), p, m) for i, (p, m, _) in enumerate(reqs)]
    arrivals = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    total_scheduled, busy_steps, t = 0, 0, 0
    while arrivals or sched.has_unfinished:
        while arrivals and reqs[arrivals[0]][2] <= t:
            sched.add_request(requests[arrivals.pop(0)])
        t += 1
        busy = sched.has_unfinished
        out = sched.schedule()
        check_step(sched, out)
        if busy:
            assert out.num_batched_tokens >= 1                 # progress every step
            busy_steps += 1
        total_scheduled += out.num_batched_tokens
        sched.update_from_output(out, sample_all(out))
        assert t < 20_000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.num_waiting == sched.num_running == 0
    for r, (p, m, _) in zip(requests, reqs):
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == [TOKEN] * m and r.num_computed_tokens == p + m - 1
    # Each life of a request (first run, then once per preemption) computes < p + m tokens.
    bound = sum((p + m - 1) * (1 + r.num_preemptions) for r, (p, m, _) in zip(requests, reqs))
    assert busy_steps <= total_scheduled <= bound


@settings(max_examples=60, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 4, 16]), extra_blocks=st.integers(0, 8),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 48),
       max_model_len=st.integers(100, 140), data=st.data())
def test_random_eos_aborts_and_length_caps_leave_nothing_behind(
        reqs: list[tuple[int, int, int]], block_size: int, extra_blocks: int,
        max_num_seqs: int, budget: int, max_model_len: int, data: st.DataObject) -> None:
    """The fake model sometimes samples EOS (token 0), and requests are aborted at random
    times, even between schedule() and update_from_output()."""
    needed = max(-(-(p + m) // block_size) for p, m, _ in reqs)
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           max_model_len=max_model_len)
    requests = [make_request(str(i), p, m, eos=frozenset({0})) for i, (p, m, _) in enumerate(reqs)]
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        check_step(sched, out)
        if data.draw(st.integers(0, 9)) == 0:
            victim = data.draw(st.sampled_from(requests))
            was_unfinished = not victim.is_finished
            aborted = sched.abort(victim.request_id)
            assert aborted is (victim if was_unfinished else None)
            assert victim.is_finished and (victim.finish_reason is FinishReason.ABORT
                                           or not was_unfinished)
        token = data.draw(st.sampled_from([0, TOKEN, TOKEN, TOKEN]))
        sched.update_from_output(out, sample_all(out, token))
        steps += 1
        assert steps < 20_000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    for r, (p, m, _) in zip(requests, reqs):
        assert r.is_finished and len(r.output_token_ids) <= m
        assert r.num_tokens <= max(max_model_len, p + 1)
        if r.finish_reason is FinishReason.STOP:
            assert r.output_token_ids[-1] == 0
        elif r.finish_reason is FinishReason.LENGTH:
            assert len(r.output_token_ids) == m or r.num_tokens >= max_model_len
