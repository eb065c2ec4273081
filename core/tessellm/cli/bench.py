"""`tessellm bench throughput`: workload W1 of ../shared/bench/WORKLOAD.md.

N requests of exactly input_len prompt token ids drawn with
numpy.random.default_rng(seed + run).integers(100, 32000), output_len generated tokens each,
greedy, EOS ignored. Run 0 warms up (it triggers kernel profiling) on prompts of its own seed,
so no timed prompt is a prefix-cache hit; each timed run has its own prompts too. Timed from
the first submit to the last token; model load excluded. Reports the median over the timed
runs, each run's figure, and the prefix-cache hit tokens during the timed runs (0 expected).

`--json-schema FILE` constrains every request (warm-up and timed) by that JSON schema
(e.g. docs/examples/bench/w1_schema.json: ten fields, long enough that output_len tokens do
not finish it, so every request still generates output_len tokens). The report then adds
`constraint`: the token masks' compute time per step (on the worker thread, overlapped with
the forward pass) and the part the sampler waited for (on the critical path), and the time to
compile the schema cold and again from the cache (front end: validation; engine: a matcher).
Compare with the same command without the option, in the same sitting.

`--lora-adapters N --lora-rank R` (tessellm.cli.bench_lora): LoRA on, N random adapters of
rank R, request i runs adapter i mod N; compare with the same command without them.
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


def _compile_times(llm: Any, spec: Any) -> dict[str, float]:
    """Milliseconds to compile `spec` cold and from the cache, in the front end's
    validate-only compiler and in the engine's (a matcher for one request)."""
    from tessellm.constraints.compiler import GrammarCompiler
    out = {}
    front = GrammarCompiler()
    for name, fn in (("front_end", front.compile), ("engine", llm.engine.grammars.matcher)):
        for state in ("cold", "cached"):
            t0 = time.perf_counter()
            fn(spec)
            out[f"{name}_{state}_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
    return out


def bench_throughput(a: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from tessellm import LLM, SamplingParams
    from tessellm.cli.bench_lora import lora_options, random_adapters
    from tessellm.constraints.structured_outputs import StructuredOutputs
    options = {"max_num_seqs": max(a.num_prompts, 1), "load_progress": False,
               **lora_options(a, options)}
    t0 = time.perf_counter()
    llm = LLM(a.model, **options)
    load_s = time.perf_counter() - t0
    n_lora = getattr(a, "lora_adapters", 0) or 0
    adapters = random_adapters(llm, n_lora, a.lora_rank) if n_lora > 0 else [None]
    loras = [adapters[i % len(adapters)] for i in range(a.num_prompts)]
    llm.engine.parts.device.allocator().wait_committed()   # no page faults in timed steps
    vocab = llm.engine.parts.spec.vocab_size
    schema_path = getattr(a, "json_schema", None)
    spec = None
    compile_ms: dict[str, float] = {}
    if schema_path is not None:
        with open(schema_path, encoding="utf-8") as f:
            spec = StructuredOutputs(json=f.read())
        compile_ms = _compile_times(llm, spec)
    profiling = getattr(a, "profile", False)
    bar = progress((a.warmup_output_len > 0) + max(1, a.runs) + profiling, "bench throughput")
    if a.warmup_output_len > 0:  # other prompts than the timed ones (seed + 1000)
        llm.generate(w1_prompts(a.num_prompts, a.input_len, a.seed + 1000, vocab),
                     SamplingParams(max_tokens=a.warmup_output_len, temperature=0.0,
                                    ignore_eos=True, structured_outputs=spec),
                     lora_request=loras)
        bar.update()
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                            structured_outputs=spec)
    masks = llm.engine.runner.token_masks
    masks0 = (masks.compute_seconds, masks.wait_seconds) if masks is not None else (0.0, 0.0)
    prefix = llm.engine.scheduler.prefix_cache_stats
    hits0, steps0 = prefix.hits, llm.engine.stats.num_steps
    group = llm.engine.parts.parallel
    coll0 = (group.stats.calls, group.stats.seconds) if group is not None else (0, 0.0)
    runs, gen, prompt_tokens = [], 0, 0
    for r in range(max(1, a.runs)):
        prompts = w1_prompts(a.num_prompts, a.input_len, a.seed + r, vocab)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras)
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
        collectives = {"tensor_parallel_size": group.layout.tp,
                       "pipeline_parallel_size": group.layout.pp,
                       "calls_per_step": round(calls / len(runs) / max(steps, 1), 1),
                       "seconds_per_run": round(seconds / len(runs), 3),
                       "ms_per_step": round(1e3 * seconds / len(runs) / max(steps, 1), 3)}
    constraint = None
    if spec is not None and masks is not None:
        per_step = 1e3 / len(runs) / max(steps, 1)
        constraint = {"json_schema": str(schema_path),
                      "mask_compute_ms_per_step": round(
                          (masks.compute_seconds - masks0[0]) * per_step, 3),
                      "mask_wait_ms_per_step": round(
                          (masks.wait_seconds - masks0[1]) * per_step, 3),
                      "compile": compile_ms,
                      "finished_within_output_len": sum(
                          o.outputs[0].finish_reason == "stop" for o in outs)}
    profile = None
    if profiling:   # one more run, instrumented, not in the figures above
        from tessellm.engine.op_profile import OpProfile
        with OpProfile(llm.engine) as prof:
            llm.generate(w1_prompts(a.num_prompts, a.input_len, a.seed + 2000, vocab), params,
                         lora_request=loras)
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
        "lora": {"adapters": n_lora, "rank": a.lora_rank,
                 "slot_loads": llm.engine.lora.slots.num_loads} if n_lora > 0 else None,
        **({"collectives": collectives} if collectives is not None else {}),
        **({"constraint": constraint} if constraint is not None else {}),
        **({"profile": profile} if profile is not None else {}),
    }
