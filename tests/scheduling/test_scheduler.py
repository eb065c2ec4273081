"""Scheduler: continuous batching, chunked prefill, recompute preemption, prefix-cache hits at
admission, and random workloads (with and without prefix caching).

The fixed-shape tests run with prefix caching off (their prompts are all the same token, so
hits would change the shapes); the prefix-caching tests come after them."""
from __future__ import annotations

import pytest
from hypothesis import event, given, settings, strategies as st

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.errors import ConfigError, InvalidRequestError
from tessellm.request import FinishReason, Request, RequestStatus
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput
from scheduling_fixtures import check_limits_and_blocks

TOKEN = 5   # what the fake model always samples (never EOS)


def make_request(rid: str, n_prompt: int, max_tokens: int, eos: frozenset[int] = frozenset()
                 ) -> Request:
    return Request(rid, [7] * n_prompt, SamplingParams(max_tokens=max_tokens),
                   arrival_time=0.0, eos_token_ids=eos)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   prefix_caching: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size,
                                         enable_prefix_caching=prefix_caching))


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


def test_a_duplicate_id_is_refused_and_a_capped_request_ends_by_length() -> None:
    """The request limits themselves are RequestLimits' (tests/engine/test_request_limits.py);
    the scheduler refuses only what depends on its state: an id it holds already."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    sched.add_request(make_request("a", 4, 4))
    with pytest.raises(InvalidRequestError, match="already"):
        sched.add_request(make_request("a", 4, 4))
    sched.add_request(make_request("e", 10, 7))              # 16 KV tokens: fits exactly
    capped = make_scheduler(num_blocks=4, block_size=4, max_model_len=17)
    f = make_request("f", 15, 100)                           # stops at 17 tokens: 16 in KV
    capped.add_request(f)
    while capped.has_unfinished:
        step(capped)
    assert len(f.output_token_ids) == 2 and f.finish_reason is FinishReason.LENGTH


def test_no_progress_raises_naming_the_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.kv.allocate_slots(make_request("leak", 1, 1), 12)   # a bug holds 3 blocks
    sched.add_request(make_request("victim", 8, 1))
    with pytest.raises(SchedulerError, match="victim"):
        sched.schedule()


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(max_num_batched_tokens=-1),
                                    dict(max_model_len=0)])
def test_config_validation(kwargs: dict[str, int]) -> None:
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ConfigError):
        SchedulerConfig(**{**base, **kwargs})


workload = st.lists(st.tuples(st.integers(1, 100), st.integers(1, 30), st.integers(0, 6)),
                    min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 2, 4, 16]),
       extra_blocks=st.integers(0, 12), max_num_seqs=st.integers(1, 5),
       budget=st.integers(1, 48), caching=st.booleans())
def test_random_workloads_finish_within_limits(
        reqs: list[tuple[int, int, int]], block_size: int, extra_blocks: int,
        max_num_seqs: int, budget: int, caching: bool) -> None:
    """Requests arrive at random steps; a fake model samples TOKEN. Every step keeps the
    limits, and every request ends with exactly max_tokens outputs and no block held.
    (All prompts are the same token, so with caching on, later requests hit earlier ones.)"""
    needed = max(-(-(p + m) // block_size) for p, m, _ in reqs)   # the engine's admission rule
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           max_model_len=256, prefix_caching=caching)
    requests = [make_request(str(i), p, m) for i, (p, m, _) in enumerate(reqs)]
    arrivals = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    total_scheduled, busy_steps, t = 0, 0, 0
    while arrivals or sched.has_unfinished:
        while arrivals and reqs[arrivals[0]][2] <= t:
            sched.add_request(requests[arrivals.pop(0)])
        t += 1
        busy = sched.has_unfinished
        out = sched.schedule()
        check_limits_and_blocks(sched, out)
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
    # Each life of a request (first run, then once per preemption) computes < p + m tokens;
    # cache hits only lower that.
    bound = sum((p + m - 1) * (1 + r.num_preemptions) for r, (p, m, _) in zip(requests, reqs))
    assert busy_steps <= total_scheduled <= bound
    if caching:
        assert total_scheduled + sched.prefix_cache_hits <= bound
    else:
        assert sched.prefix_cache_queries == sched.prefix_cache_hits == 0


@settings(max_examples=60, deadline=None)
@given(reqs=workload, block_size=st.sampled_from([1, 4, 16]), extra_blocks=st.integers(0, 8),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 48),
       max_model_len=st.integers(101, 140), caching=st.booleans(), data=st.data())
def test_random_eos_aborts_and_length_caps_leave_nothing_behind(
        reqs: list[tuple[int, int, int]], block_size: int, extra_blocks: int,
        max_num_seqs: int, budget: int, max_model_len: int, caching: bool,
        data: st.DataObject) -> None:
    """The fake model sometimes samples EOS (token 0), and requests are aborted at random
    times, even between schedule() and update_from_output(). (Prompts of at most 100
    tokens: every one is shorter than max_model_len, as validation promises.)"""
    needed = max(-(-(p + m) // block_size) for p, m, _ in reqs)
    sched = make_scheduler(needed + extra_blocks, block_size, max_num_seqs, budget,
                           max_model_len=max_model_len, prefix_caching=caching)
    requests = [make_request(str(i), p, m, eos=frozenset({0})) for i, (p, m, _) in enumerate(reqs)]
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        check_limits_and_blocks(sched, out)
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


# ---- prefix caching -------------------------------------------------------------------------

def seq_request(rid: str, tokens: list[int], max_tokens: int, salt: str | None = None
                ) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=0.0,
                   cache_salt=salt)


def run_all(sched: Scheduler) -> None:
    steps = 0
    while sched.has_unfinished:
        step(sched)
        steps += 1
        assert steps < 1000


def test_admission_starts_at_the_cached_prefix() -> None:
    sched = make_scheduler(prefix_caching=True)
    a = seq_request("a", list(range(10)), 2)
    sched.add_request(a)
    run_all(sched)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10, 0)
    b = seq_request("b", list(range(9)) + [50, 51, 52], 2)
    sched.add_request(b)
    out = sched.schedule()
    assert shape(out) == [("b", 4)] and b.num_computed_tokens == 8   # 2 of 3 blocks hit
    assert out.num_batched_tokens == 4
    sched.update_from_output(out, sample_all(out))
    run_all(sched)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (22, 8)
    assert sched.prefix_cache_hit_rate == pytest.approx(8 / 22)
    st_ = sched.prefix_cache_stats
    assert (st_.num_requests, st_.num_hit_requests) == (2, 1)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_later_request_shares_the_blocks_of_a_running_one() -> None:
    sched = make_scheduler(prefix_caching=True, max_num_batched_tokens=8)
    a = seq_request("a", list(range(12)), 3)
    sched.add_request(a)
    out, _ = step(sched)                               # a: tokens 0..7 computed, 2 blocks cached
    assert shape(out) == [("a", 8)]
    b = seq_request("b", list(range(12)) + [99], 3)
    sched.add_request(b)
    out, _ = step(sched)
    assert shape(out) == [("a", 4), ("b", 4)]           # b hit 8 tokens; 4 of 5 left fit
    ta, tb = sched.kv.block_table("a"), sched.kv.block_table("b")
    assert ta[:2] == tb[:2] and len(set(ta[2:]) & set(tb[2:])) == 0
    assert [sched.kv.pool.ref_count(x) for x in ta[:2]] == [2, 2]
    run_all(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_same_step_admissions_do_not_hit_each_other() -> None:
    """Blocks are cached after the step that computes them, never while being written."""
    sched = make_scheduler(prefix_caching=True)
    for rid in "ab":
        sched.add_request(seq_request(rid, list(range(9)), 1))
    out, _ = step(sched)
    assert shape(out) == [("a", 9), ("b", 9)] and sched.prefix_cache_hits == 0
    assert sched.kv.pool.num_cached_blocks == 2        # a's two full blocks; b's duplicates not
    c = seq_request("c", list(range(9)), 1)
    sched.add_request(c)
    out, _ = step(sched)
    assert shape(out) == [("c", 1)] and sched.prefix_cache_hits == 8


def test_salted_requests_do_not_share() -> None:
    sched = make_scheduler(prefix_caching=True)
    sched.add_request(seq_request("a", list(range(9)), 1, salt="x"))
    run_all(sched)
    for rid, salt, hit in (("b", "y", 0), ("c", None, 0), ("d", "x", 8)):
        sched.add_request(seq_request(rid, list(range(9)), 1, salt=salt))
        before = sched.prefix_cache_hits
        run_all(sched)
        assert sched.prefix_cache_hits - before == hit


def test_a_preempted_request_resumes_from_its_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, prefix_caching=True)
    a, b = seq_request("a", list(range(6)), 8), seq_request("b", list(range(20, 26)), 8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched)
    out = sched.schedule()                   # both need a 3rd block, one is free: b goes
    assert out.preempted == [b] and b.num_tokens == 9
    sched.update_from_output(out, sample_all(out))
    while b.status is RequestStatus.WAITING:
        out, _ = step(sched)
    # a's 4th block evicted b's last block (freed first); b's first block was still cached.
    resumed = next(s for s in out.scheduled if s.request is b)
    assert (b.num_computed_tokens - resumed.num_tokens, resumed.num_tokens) == (4, 5)
    assert sched.prefix_cache_hits == 4
    run_all(sched)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 8


def test_caching_off_counts_nothing() -> None:
    sched = make_scheduler(prefix_caching=False)
    for rid in "ab":
        sched.add_request(seq_request(rid, list(range(9)), 1))
        run_all(sched)
    assert sched.prefix_cache_queries == sched.prefix_cache_hits == 0
    assert sched.prefix_cache_hit_rate == 0.0


class FakeModel:
    """Stands in for the model runner over a fake KV cache: zeroes fresh blocks, writes the KV
    of each scheduled position (named by the sequence's tokens 0..p), reads every computed
    position through the block table (as attention does) and samples a token that depends on
    all of it. A wrong hit or a zeroed shared block changes the tokens or fails the read."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv, self.slots = kv, {}
        self.tokens_computed = 0

    def slot(self, table: list[int], p: int) -> int:
        bs = self.kv.block_size
        return table[p // bs] * bs + p % bs

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        for block in self.kv.take_fresh_blocks():
            for row in range(self.kv.block_size):
                self.slots[block * self.kv.block_size + row] = None
        sampled = {}
        for s in out.scheduled:
            r, table = s.request, self.kv.block_table(s.request.request_id)
            start, stop = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            ids = r.all_token_ids
            for p in range(start, stop):
                self.slots[self.slot(table, p)] = tuple(ids[:p + 1])
            self.tokens_computed += s.num_tokens
            seen = [self.slots.get(self.slot(table, p)) for p in range(stop)]
            assert seen == [tuple(ids[:p + 1]) for p in range(stop)]
            if stop == r.num_tokens:
                sampled[r.request_id] = 1 + sum(len(set(x)) * (i + 1)
                                                for i, x in enumerate(seen)) % 3
        return sampled


def run_workload(prompts: list[list[int]], max_tokens: list[int], arrivals: list[int],
                 caching: bool, num_blocks: int, block_size: int, max_num_seqs: int,
                 budget: int) -> tuple[list[list[int]], int, Scheduler]:
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len=256,
                           prefix_caching=caching)
    model = FakeModel(sched.kv)
    requests = [seq_request(str(i), p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    t = 0
    while order or sched.has_unfinished:
        while order and arrivals[order[0]] <= t:
            sched.add_request(requests[order.pop(0)])
        t += 1
        out = sched.schedule()
        check_limits_and_blocks(sched, out)
        sched.update_from_output(out, model.run(out))
        assert t < 5000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return [r.output_token_ids for r in requests], model.tokens_computed, sched


BASES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]


@settings(max_examples=80, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 16),
                               st.lists(st.integers(0, 3), max_size=4),
                               st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 10),
       max_num_seqs=st.integers(1, 4), budget=st.integers(1, 32))
def test_random_shared_prefix_workloads_give_the_outputs_of_no_caching(
        reqs: list[tuple[int, int, list[int], int, int]], block_size: int, extra_blocks: int,
        max_num_seqs: int, budget: int) -> None:
    """Prompts are cuts of two base sequences plus a random tail, arriving at random steps,
    in a pool that may force preemption and eviction. With caching the fake KV each request
    reads is its own, its tokens are those of the run without caching, and it computes no
    more tokens."""
    prompts = [(BASES[b][:cut] + tail) or [0] for b, cut, tail, _, _ in reqs]
    max_tokens = [m for *_, m, _ in reqs]
    arrivals = [a for *_, a in reqs]
    needed = max(-(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens))
    args = (needed + extra_blocks, block_size, max_num_seqs, budget)
    plain, plain_tokens, _ = run_workload(prompts, max_tokens, arrivals, False, *args)
    cached, cached_tokens, sched = run_workload(prompts, max_tokens, arrivals, True, *args)
    assert cached == plain
    if sched.prefix_cache_hits == 0:                   # then nothing differs at all
        assert cached_tokens == plain_tokens
    event("hit" if sched.prefix_cache_hits else "no hit")
