"""`tessellm bench throughput`: workload W1 of ../shared/bench/WORKLOAD.md.

N requests of exactly input_len prompt token ids drawn with
numpy.random.default_rng(seed).integers(100, 32000), output_len generated tokens each, greedy,
EOS ignored. Timed from the first submit to the last token; model load and a short warm-up run
(same batch shape, few tokens: it triggers kernel profiling) are excluded.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch


def w1_prompts(n: int, input_len: int, seed: int, vocab_size: int) -> list[list[int]]:
    high = min(32000, vocab_size)
    return np.random.default_rng(seed).integers(100, high, size=(n, input_len)).tolist()


def bench_throughput(a: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from tessellm import LLM, SamplingParams
    options = {"max_num_seqs": max(a.num_prompts, 1), "load_progress": False, **options}
    t0 = time.perf_counter()
    llm = LLM(a.model, **options)
    load_s = time.perf_counter() - t0
    prompts = w1_prompts(a.num_prompts, a.input_len, a.seed, llm.engine.parts.spec.vocab_size)
    if a.warmup_output_len > 0:
        llm.generate(prompts, SamplingParams(max_tokens=a.warmup_output_len, temperature=0.0,
                                             ignore_eos=True))
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    stats0 = llm.engine.stats.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    parts = llm.engine.parts
    return {
        "workload": "W1", "model": a.model or "demo", "device": parts.device.name,
        "dtype": str(parts.dtype).removeprefix("torch."), "num_prompts": a.num_prompts,
        "input_len": a.input_len, "output_len": a.output_len,
        "max_num_batched_tokens": parts.config.max_num_batched_tokens,
        "threads": torch.get_num_threads(), "load_s": round(load_s, 3), "wall_s": round(wall, 3),
        "steps": llm.engine.stats.num_steps - stats0,
        "gen_tokens": gen, "gen_tok_per_s": round(gen / wall, 2),
        "total_tok_per_s": round((gen + prompt_tokens) / wall, 2),
        "passes": parts.pass_report.applied,
    }
