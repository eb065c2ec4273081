"""`tessellm bench schedule`: the scheduler simulator (tessellm.sim) from the command line.

Builds a synthetic trace (tessellm.sim.trace), replays it through the real scheduler and KV
manager with the cost model (tessellm.sim.replay) and prints one JSON object: the trace
settings, TTFT and latency p50/p99 per priority class (virtual seconds), prefix-cache hit
rate, preemptions, swap traffic, steps, total virtual time and the simulation's wall time.
"""
from __future__ import annotations

import argparse
from typing import Any

from tessellm.sim.trace import TraceConfig

_TRACE = TraceConfig()


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    """Add `schedule` to the `bench` subparsers; the caller sets its handler."""
    p = bsub.add_parser("schedule", help="scheduler simulator: a synthetic trace through the "
                        "real scheduler and KV manager with a cost model (no model runs)")
    add = p.add_argument
    add("--num-requests", type=int, default=_TRACE.num_requests)
    add("--seed", type=int, default=_TRACE.seed)
    add("--priorities", type=int, default=_TRACE.priorities,
        help="priority classes in the trace (uniform); also the scheduler's priority_levels")
    add("--request-rate", type=float, default=_TRACE.request_rate,
        help="mean arrivals per virtual second")
    add("--burst", type=int, default=_TRACE.burst, help="requests arriving at the same instant")
    add("--input-len", type=int, default=_TRACE.input_len, help="mean prompt tokens")
    add("--output-len", type=int, default=_TRACE.output_len, help="mean output tokens")
    add("--shared-prefix-frac", type=float, default=_TRACE.shared_prefix_frac,
        help="fraction of prompts starting with one of the shared prefixes")
    add("--num-prefixes", type=int, default=_TRACE.num_prefixes)
    add("--prefix-len", type=int, default=_TRACE.prefix_len)
    add("--num-kv-blocks", type=int, default=1024)
    add("--block-size", type=int, default=16)
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--max-model-len", type=int, default=4096)
    add("--aging-interval-steps", type=int, default=500, help="0: no aging")
    add("--no-prefix-caching", action="store_true")
    add("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    add("--num-host-kv-blocks", type=int, default=None,
        help="host pool of swap mode (default: as many as --num-kv-blocks)")
    add("--sla-itl-ms", type=float, default=None, help="turn the SLA batch-sizing policy on")
    add("--sla-target-tokens-per-s", type=float, default=None)
    add("--cost-a", type=float, default=None, help="seconds per step")
    add("--cost-b", type=float, default=None, help="seconds per computed token")
    add("--cost-c", type=float, default=None, help="seconds per token of attention context")
    return p


def run_bench_schedule(a: argparse.Namespace) -> dict[str, Any]:
    from tessellm.scheduler import SchedulerConfig, SLAConfig
    from tessellm.sim.replay import CostModel, replay
    from tessellm.sim.trace import make_trace

    trace_cfg = TraceConfig(a.num_requests, a.seed, a.priorities, a.request_rate, a.burst,
                            a.input_len, a.output_len, a.shared_prefix_frac, a.num_prefixes,
                            a.prefix_len)
    sla = None if a.sla_itl_ms is None else SLAConfig(a.sla_itl_ms / 1e3,
                                                       a.sla_target_tokens_per_s)
    sched_cfg = SchedulerConfig(a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len,
                                priority_levels=a.priorities,
                                aging_interval_steps=a.aging_interval_steps, sla=sla,
                                preemption_mode=a.preemption_mode,
                                num_host_blocks=(0 if a.preemption_mode != "swap" else
                                                 a.num_host_kv_blocks or a.num_kv_blocks))
    base = CostModel()
    cost = CostModel(base.base_s if a.cost_a is None else a.cost_a,
                     base.per_token_s if a.cost_b is None else a.cost_b,
                     base.per_context_token_s if a.cost_c is None else a.cost_c)
    result = replay(make_trace(trace_cfg), sched_cfg, a.num_kv_blocks, a.block_size,
                    not a.no_prefix_caching, cost)
    settings = {"trace": {k: getattr(trace_cfg, k) for k in TraceConfig.__dataclass_fields__},
                "scheduler": {"num_kv_blocks": a.num_kv_blocks, "block_size": a.block_size,
                              "max_num_seqs": a.max_num_seqs,
                              "max_num_batched_tokens": a.max_num_batched_tokens,
                              "aging_interval_steps": a.aging_interval_steps,
                              "prefix_caching": not a.no_prefix_caching,
                              "sla_itl_ms": a.sla_itl_ms,
                              "preemption_mode": a.preemption_mode,
                              "num_host_kv_blocks": sched_cfg.num_host_blocks},
                "cost_model": {"a": cost.base_s, "b": cost.per_token_s,
                               "c": cost.per_context_token_s}}
    return {**settings, **result}
