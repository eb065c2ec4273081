"""`tessellm bench throughput`: workload W1 of ../shared/bench/WORKLOAD.md.

N requests of exactly input_len prompt token ids drawn with
numpy.random.default_rng(seed + run).integers(100, 32000), output_len generated tokens each,
greedy, EOS ignored. Run 0 warms up (it triggers kernel profiling) on prompts of its own seed,
so no timed prompt is a prefix-cache hit; each timed run has its own prompts too. Timed from
the first submit to the last token; model load excluded. Reports the median over the timed
runs, each run's figure, and the prefix-cache hit tokens during the timed runs (0 expected).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from tessellm.cli.bench_report import progress


def w1_prompts(n: int, input_len: int, seed: int, vocab_size: int) -> list[list[int]]:
    high = min(32000, vocab_size)
    return np.random.default_rng(seed).integers(100, high, size=(n, input_len)).tolist()


def bench_throughput(a: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from tessellm import LLM, SamplingParams
    options = {"max_num_seqs": max(a.num_prompts, 1), "load_progress": False, **options}
    t0 = time.perf_counter()
    llm = LLM(a.model, **options)
    load_s = time.perf_counter() - t0
    vocab = llm.engine.parts.spec.vocab_size
    profiling = getattr(a, "profile", False)
    bar = progress((a.warmup_output_len > 0) + max(1, a.runs) + profiling, "bench throughput")
    if a.warmup_output_len > 0:  # other prompts than the timed ones (seed + 1000)
        llm.generate(w1_prompts(a.num_prompts, a.input_len, a.seed + 1000, vocab),
                     SamplingParams(max_tokens=a.warmup_output_len, temperature=0.0,
                                    ignore_eos=True))
        bar.update()
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    prefix = llm.engine.scheduler.prefix_cache_stats
    hits0, steps0 = prefix.hits, llm.engine.stats.num_steps
    group = llm.engine.parts.parallel
    coll0 = (group.stats.calls, group.stats.seconds) if group is not None else (0, 0.0)
    runs, gen, prompt_tokens = [], 0, 0
    for r in range(max(1, a.runs)):
        prompts = w1_prompts(a.num_prompts, a.input_len, a.seed + r, vocab)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        gen = sum(len(o.token_ids) for o in outs)
        prompt_tokens = sum(len(p) for p in prompts)
        runs.append((wall, gen / wall, (gen + prompt_tokens) / wall))
        bar.update()
    parts = llm.engine.parts
    steps = (llm.engine.stats.num_steps - steps0) // len(runs)
    collectives = None
    if group is not None:   # rank 0's host time in all_reduce / all_gather, per timed run
        calls, seconds = group.stats.calls - coll0[0], group.stats.seconds - coll0[1]
        collectives = {"tensor_parallel_size": group.world_size,
                       "calls_per_step": round(calls / len(runs) / max(steps, 1), 1),
                       "seconds_per_run": round(seconds / len(runs), 3),
                       "ms_per_step": round(1e3 * seconds / len(runs) / max(steps, 1), 3)}
    profile = None
    if profiling:   # one more run, instrumented, not in the figures above
        from tessellm.engine.op_profile import OpProfile
        with OpProfile(llm.engine) as prof:
            llm.generate(w1_prompts(a.num_prompts, a.input_len, a.seed + 2000, vocab), params)
        profile = prof.report()
        bar.update()
    bar.close()
    llm.close()
    return {
        "workload": "W1", "model": parts.source.name, "device": parts.device.name,
        "dtype": str(parts.dtype).removeprefix("torch."), "num_prompts": a.num_prompts,
        "input_len": a.input_len, "output_len": a.output_len, "runs": len(runs),
        "max_num_batched_tokens": parts.config.max_num_batched_tokens,
        "threads": torch.get_num_threads(), "load_s": round(load_s, 3),
        "wall_s": round(statistics.median(w for w, _, _ in runs), 3),
        "steps": steps,
        "gen_tokens": gen, "gen_tok_per_s": round(statistics.median(g for _, g, _ in runs), 2),
        "gen_tok_per_s_runs": [round(g, 2) for _, g, _ in runs],
        "total_tok_per_s": round(statistics.median(t for _, _, t in runs), 2),
        "prefix_hit_tokens": prefix.hits - hits0,
        "passes": parts.pass_report.applied,
        **({"collectives": collectives} if collectives is not None else {}),
        **({"profile": profile} if profile is not None else {}),
    }
