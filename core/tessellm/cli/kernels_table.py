"""`tessellm kernels`: the profiler's ranking per op for a model's graph on a device (and
for the sampler's `sample_tokens` and `greedy_tokens` ops, with the buckets as rows, where
the device has them)."""
from __future__ import annotations

import json
from typing import Any

from tessellm.config import EngineConfig
from tessellm.engine.builder import build_engine_parts
from tessellm.engine.sampler import (GREEDY_OP, SAMPLE_OP, greedy_kernel_query,
                                     sample_kernel_query)
from tessellm.graph.lowering import AttentionSite, KernelSite
from tessellm.kernels.registry import KernelQuery


def plan_queries(plan, buckets: list[int]) -> list[KernelQuery]:
    """Distinct KernelQueries the plan's kernel sites would issue at the given buckets."""
    sites: list[KernelSite] = []
    for ins in plan.instructions:
        if isinstance(ins.fn, KernelSite):
            sites.append(ins.fn)
        elif isinstance(ins.fn, AttentionSite):
            sites += [ins.fn.write, ins.fn.decode, ins.fn.prefill]
    seen: dict[KernelQuery, None] = {}
    for site in sites:
        for b in buckets:
            seen.setdefault(KernelQuery(site.op, site.dtype, b, site.dims), None)
    return list(seen)


def print_kernel_rankings(model: str | None, options: dict[str, Any], buckets: list[int],
                          as_json: bool = False) -> None:
    parts = build_engine_parts(EngineConfig(model=model, load_progress=False, **options))
    queries = plan_queries(parts.plan, buckets)
    has_op = parts.selector.registry.has_op
    if has_op(parts.selector.device_name, SAMPLE_OP):   # the sampler's ops
        queries += [sample_kernel_query(b, parts.spec.vocab_size) for b in buckets]
    if has_op(parts.selector.device_name, GREEDY_OP):
        queries += [greedy_kernel_query(b, parts.spec.vocab_size, parts.dtype) for b in buckets]
    rows = []
    for q in queries:
        d = parts.selector.decide(q)
        rows.append({"query": q.bucket_key, "choice": d.choice,
                     "ranking": [{"kernel": c.name, "best_us": c.best_us,
                                  "correct": c.correct, "error": c.error} for c in d.ranking]})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(f"device {parts.device.name}, dtype {str(parts.dtype).removeprefix('torch.')}, "
          f"passes applied: {', '.join(parts.pass_report.applied) or 'none'}")
    for r in rows:
        print(r["query"])
        for c in r["ranking"]:
            mark = "*" if c["kernel"] == r["choice"] else " "
            t = f"{c['best_us']:10.1f} us" if c["best_us"] is not None else "     -      "
            why = "" if c["correct"] else f"  REJECTED: {c['error']}"
            print(f"  {mark} {c['kernel']:<28} {t}{why}")
