"""Shared helpers of the scheduling tests: request and scheduler factories, a fake model whose
tokens depend only on each request's own sequence (so any schedule must give the same tokens),
and the per-step invariant check (limits, block accounting, who may evict whom)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.request import FinishReason, Request, RequestStatus
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SLAConfig


def make_request(rid: str, n_prompt: int, max_tokens: int, priority: int = 0,
                 tokens: list[int] | None = None) -> Request:
    ids = list(tokens) if tokens is not None else [7] * n_prompt
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens), arrival_time=0.0,
                   priority=priority)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, max_model_len: int = 256,
                   levels: int = 3, aging: int = 0, caching: bool = False,
                   sla: SLAConfig | None = None, swap_blocks: int | None = None,
                   window: int = 0, max_loras: int = 0) -> Scheduler:
    """swap_blocks: None for recompute preemption, else swap mode with that many host blocks.
    window: the KV manager's sliding window (blocks out of it are released). max_loras: LoRA
    adapters running at most (0: off)."""
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, levels, aging, sla,
                          "recompute" if swap_blocks is None else "swap", swap_blocks or 0,
                          max_loras)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                                         sliding_window=window))


def window_block_bound(kv: KVCacheManager, num_tokens: int) -> int:
    """The most blocks a windowed sequence holds while it computes `num_tokens` tokens: those
    overlapping the window before the first and the tokens themselves."""
    return -(-(kv.sliding_window + num_tokens - 2) // kv.block_size) + 1


def check_window_table(kv: KVCacheManager, request: Request, num_tokens: int | None) -> None:
    """A table's null entries are a leading run, no more than the blocks out of the window;
    for a request scheduled with `num_tokens` (synchronous steps: each complete() before the
    next schedule()), exactly those, and within window_block_bound."""
    table = kv.block_table(request.request_id)
    lead = next((i for i, b in enumerate(table) if b != KVCacheManager.NULL_BLOCK), len(table))
    assert KVCacheManager.NULL_BLOCK not in table[lead:]
    assert kv.num_held_blocks(request.request_id) == len(table) - lead
    dead = kv.num_dead_blocks(request.num_computed_tokens)
    assert lead <= dead
    if num_tokens is not None and kv.sliding_window:
        assert lead == dead
        assert len(table) - lead <= window_block_bound(kv, num_tokens)


class FakeModel:
    """Samples a token that is a function of the request's whole sequence (prompt and outputs
    so far), never EOS; counts computed tokens."""

    def __init__(self) -> None:
        self.tokens_computed = 0

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for s in out.scheduled:
            r = s.request
            self.tokens_computed += s.num_tokens
            if r.num_computed_tokens + s.num_tokens == r.num_tokens:
                sampled[r.request_id] = 1 + (sum(r.all_token_ids) * 31 + r.num_tokens) % 97
        return sampled


@dataclass
class Tracker:
    """Arrival order and finish step of every request it added."""

    sched: Scheduler
    model: FakeModel = field(default_factory=FakeModel)
    arrival: dict[str, int] = field(default_factory=dict)
    finished_at: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    evictions_for_waiting: int = 0   # victims of a worse level than a request admitted with them

    def add(self, request: Request) -> Request:
        self.sched.add_request(request)
        self.arrival[request.request_id] = len(self.arrival)
        return request

    def step(self) -> SchedulerOutput:
        levels = {r.request_id: self.sched.effective_priority(r.request_id)
                  for r in self.sched.running + self.sched.waiting}
        was_running = {r.request_id for r in self.sched.running}
        out = self.sched.schedule()
        check_step(self.sched, out, levels, was_running, self.arrival)
        admitted = [self.sched.effective_priority(s.request.request_id) for s in out.scheduled
                    if s.request.request_id not in was_running]
        self.evictions_for_waiting += sum(
            1 for v in out.preempted if admitted and levels[v.request_id] > min(admitted))
        for r in self.sched.update_from_output(out, self.model.run(out)):
            self.finished_at[r.request_id] = self.steps
        self.steps += 1
        return out

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished:
            self.step()
            assert self.steps < max_steps


def assert_finished_as_alone(request: Request, max_tokens: int) -> None:
    """`request` finished by length with the tokens its prompt gets alone in a large pool."""
    alone = Tracker(make_scheduler(num_blocks=256))
    ref = alone.add(make_request("x", len(request.prompt_token_ids), max_tokens,
                                 tokens=request.prompt_token_ids))
    alone.run()
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == ref.output_token_ids


def check_limits_and_blocks(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of every step: token budget, sequence cap, decodes first, each scheduled
    request's table covers its tokens, ref counts equal table occurrences (a block in two
    tables only via a prefix-cache hit), no leak, waiting requests hold no blocks."""
    cfg, kv = sched.config, sched.kv
    sizes = [s.num_tokens for s in out.scheduled]
    assert out.num_batched_tokens == sum(sizes) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= sched.num_running <= cfg.max_num_seqs
    assert all(n >= 1 for n in sizes)
    assert sizes == sorted(sizes, key=lambda n: n != 1)          # one-token entries first
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    assert not set(ids) & {r.request_id for r in out.preempted}
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING
        assert r.num_computed_tokens + s.num_tokens <= r.num_tokens
        assert len(kv.block_table(r.request_id)) == kv.num_blocks_needed(
            r.num_computed_tokens + s.num_tokens)
        check_window_table(kv, r, s.num_tokens)
    for r in sched.running:
        check_window_table(kv, r, None)
    tables = [kv.block_table(r.request_id) for r in sched.running]
    flat = [b for t in tables for b in t if b != KVCacheManager.NULL_BLOCK]
    for b in set(flat):                                          # shared only via a cache hit
        assert kv.pool.ref_count(b) == flat.count(b)
        assert flat.count(b) == 1 or kv.pool.block_hash(b) is not None
    if not kv.enable_prefix_caching:
        assert len(flat) == len(set(flat)) and kv.pool.num_cached_blocks == 0
    assert len(set(flat)) + kv.num_free_blocks == kv.num_blocks  # no leak
    assert all(kv.block_table(r.request_id) == [] for r in sched.waiting)


def check_step(sched: Scheduler, out: SchedulerOutput, levels: dict[str, int | None],
               was_running: set[str], arrival: dict[str, int]) -> None:
    """check_limits_and_blocks, plus the eviction rule: every victim sorts after every request
    that got tokens, by (level, arrival); after a newly admitted one by level alone."""
    check_limits_and_blocks(sched, out)
    kv = sched.kv
    for v in out.preempted:
        assert v.request_id in was_running and v.status is RequestStatus.WAITING
        swapped = sched.swap_space is not None and sched.swap_space.is_swapped(v.request_id)
        assert kv.block_table(v.request_id) == [] and (v.num_computed_tokens == 0 or swapped)
        v_key = (levels[v.request_id], arrival[v.request_id])
        for s in out.scheduled:
            rid = s.request.request_id
            level = sched.effective_priority(rid)
            if rid in was_running:
                assert (level, arrival[rid]) < v_key, "evicted a request served before it"
            else:
                assert level < v_key[0], "a waiting request evicted an equal or better one"
    assert sched.waiting == tuple(sorted(
        sched.waiting, key=lambda r: (sched.effective_priority(r.request_id),
                                      arrival[r.request_id])))
