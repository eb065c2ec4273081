"""Replay a trace through the real Scheduler and KVCacheManager on a virtual clock.

No model runs: a step's duration comes from the cost model

    step_s = base_s + per_token_s * tokens + per_context_token_s * context

where tokens is the step's num_batched_tokens and context sums, over its scheduled requests,
the positions attention reads (num_computed_tokens + granted tokens). Each request that
completes its sequence in a step "samples" a token of its own (never EOS: a request runs
exactly max_tokens), exactly as the model runner's contract with update_from_output() says.

The clock: requests whose arrival is <= now are added before a step; the step's duration
is added after it; an idle scheduler jumps to the next arrival. TTFT is the end of the step
that sampled a request's first token minus its arrival; latency the end of its last step.
With config.preemption_mode="swap", victims are swapped to config.num_host_blocks host blocks;
the report counts the blocks copied each way and the recompute fallbacks (host pool short).
Copies cost no virtual time in this cost model.

Requests are validated as where they enter an engine (RequestLimits; the trace's token ids
are taken as its vocabulary). Invariants: every request of the trace finishes (or is rejected
by that validation, counted); the simulation ends with every KV block free, which replay()
checks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.engine.request_limits import RequestLimits
from tessellm.errors import ConfigError, InvalidRequestError
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import Scheduler, SchedulerConfig, SchedulerError
from tessellm.sim.trace import TraceRequest


@dataclass(slots=True, frozen=True)
class CostModel:
    base_s: float = 0.004                  # a: per step (launch, sampling, host work)
    per_token_s: float = 2e-5              # b: per computed token (weights: 50k tokens/s)
    per_context_token_s: float = 1e-7      # c: per token of attention context

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_token_s, self.per_context_token_s) < 0:
            raise ConfigError(f"cost model coefficients must be >= 0: {self}")

    def step_time(self, num_tokens: int, context_tokens: int) -> float:
        return (self.base_s + self.per_token_s * num_tokens
                + self.per_context_token_s * context_tokens)


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50": None, "p99": None}
    arr = np.asarray(values)
    return {"count": len(values), "p50": round(float(np.percentile(arr, 50)), 6),
            "p99": round(float(np.percentile(arr, 99)), 6)}


def replay(trace: list[TraceRequest], config: SchedulerConfig, num_kv_blocks: int,
           block_size: int, enable_prefix_caching: bool = True,
           cost: CostModel | None = None, max_steps: int = 10_000_000) -> dict[str, Any]:
    """Run the trace to completion; returns the figures as a JSON-ready dict."""
    cost = cost or CostModel()
    kv = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching)
    sched = Scheduler(config, kv)
    vocab_size = 1 + max((max(t.prompt, default=0) for t in trace), default=0)
    limits = RequestLimits(config.priority_levels, vocab_size, config.max_model_len,
                           block_size, num_kv_blocks)
    wall0 = time.perf_counter()
    n = len(trace)
    index: dict[str, int] = {}
    first_token: list[float | None] = [None] * n
    done_at: list[float | None] = [None] * n
    params: dict[int, SamplingParams] = {}
    rejected = steps = generated = computed = 0
    now, nxt = 0.0, 0
    while nxt < n or sched.has_unfinished:
        if not sched.has_unfinished and trace[nxt].arrival_s > now:
            now = trace[nxt].arrival_s               # idle: jump to the next arrival
        while nxt < n and trace[nxt].arrival_s <= now:
            tr = trace[nxt]
            p = params.get(tr.max_tokens)
            if p is None:
                p = params[tr.max_tokens] = SamplingParams(max_tokens=tr.max_tokens,
                                                           ignore_eos=True)
            rid = str(nxt)
            try:
                limits.validate(tr.prompt, p, tr.priority)
            except InvalidRequestError:
                rejected += 1
            else:
                sched.add_request(Request(rid, tr.prompt, p, tr.arrival_s,
                                          priority=tr.priority))
                index[rid] = nxt
            nxt += 1
        if not sched.has_unfinished:
            continue
        out = sched.schedule()
        if out.is_empty:
            raise SchedulerError("the scheduler scheduled nothing with requests unfinished")
        context = 0
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            r = s.request
            end = r.num_computed_tokens + s.num_tokens
            context += end
            if end == r.num_tokens:
                sampled[r.request_id] = 1 + index[r.request_id] % 30_000
        dt = cost.step_time(out.num_batched_tokens, context)
        now += dt
        for rid in sampled:
            i = index[rid]
            if first_token[i] is None:
                first_token[i] = now
        for r in sched.update_from_output(out, sampled):
            done_at[index[r.request_id]] = now
        sched.observe_step(dt, out.num_decodes)
        steps += 1
        generated += len(sampled)
        computed += out.num_batched_tokens
        if steps >= max_steps:
            raise SchedulerError(f"the simulation did not finish in {max_steps} steps")
    if kv.num_free_blocks != kv.num_blocks:
        raise SchedulerError(f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked")
    wall = time.perf_counter() - wall0
    return _report(trace, index, first_token, done_at, sched, now, wall, steps, generated,
                   computed, rejected)


def _swap_report(sched: Scheduler) -> dict[str, int]:
    st = sched.swap_stats
    report = {"blocks_out": st.blocks_out, "blocks_in": st.blocks_in}
    if sched.swap_space is not None:
        report["fallbacks"] = st.fallbacks
    return report


def _report(trace: list[TraceRequest], index: dict[str, int], first_token: list[float | None],
            done_at: list[float | None], sched: Scheduler, now: float, wall: float, steps: int,
            generated: int, computed: int, rejected: int) -> dict[str, Any]:
    classes = sorted({t.priority for t in trace})
    ttft: dict[int, list[float]] = {c: [] for c in classes}
    latency: dict[int, list[float]] = {c: [] for c in classes}
    for i in index.values():
        tr, first, end = trace[i], first_token[i], done_at[i]
        if first is not None:
            ttft[tr.priority].append(first - tr.arrival_s)
        if end is not None:
            latency[tr.priority].append(end - tr.arrival_s)
    stats = sched.prefix_cache_stats
    return {
        "num_requests": len(trace),
        "finished": sum(1 for i in index.values() if done_at[i] is not None),
        "rejected": rejected,
        "ttft_s": {str(c): _percentiles(ttft[c]) for c in classes},
        "latency_s": {str(c): _percentiles(latency[c]) for c in classes},
        "prefix_cache": {"queries": stats.queries, "hits": stats.hits,
                         "hit_rate": round(stats.hit_rate, 6)},
        "prefix_hit_rate": round(stats.hit_rate, 6),
        "preemptions": sched.num_preemptions,
        "swap": _swap_report(sched),
        "num_steps": steps,
        "generated_tokens": generated,
        "computed_tokens": computed,
        "output_tokens_per_s": round(generated / now, 3) if now > 0 else 0.0,
        "final_max_num_seqs": sched.max_num_seqs_now,
        "total_virtual_time_s": round(now, 6),
        "wall_time_s": round(wall, 3),
    }
