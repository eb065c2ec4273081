"""`tessellm bench latency`: one stream, workloads W3/W4/W6 of ../shared/bench/WORKLOAD.md.

W3/W4 (`--workload random`): one prompt of input_len ids from
numpy.random.default_rng(seed + run).integers(100, high), output_len greedy tokens, EOS
ignored. W6 (`--workload copy`): run r's prompt is tessellm.cli.copy_workload's chat turn r
(a ~400-token file to give back with an edit), greedy up to output_len tokens or EOS.
`--temperature T` samples instead (seed + run), e.g. W4 as natural text for speculation.
`--speculative METHOD` (or --speculative-config JSON) speculates, and the result holds its
counters. Prefill tok/s = prompt tokens / time to the first token,
decode tok/s = tokens after the first / time after the first (as the llama.cpp peer script
measures). Run 0 warms up (its prompt differs from the timed ones, so nothing is a prefix-cache
hit); the figures are medians over the timed runs. Also: load seconds, weight bytes as held,
and the process's resident memory after load.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessellm.cli.bench_report import progress


def resident_bytes() -> int | None:
    """VmRSS of this process (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def one_stream(llm: Any, ids: list[int], output_len: int, ignore_eos: bool = True,
               temperature: float = 0.0, seed: int | None = None,
               lora: Any = None) -> dict[str, float]:
    from tessellm import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=temperature, seed=seed,
                            ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    req = engine.add_request(ids, params, lora_request=lora)
    while not req.output_token_ids:
        engine.step()
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    t2 = time.perf_counter()
    n = len(req.output_token_ids)
    return {"prefill_tok_per_s": len(ids) / (t1 - t0),
            "decode_tok_per_s": (n - 1) / (t2 - t1) if n > 1 else 0.0, "wall_s": t2 - t0,
            "output_tokens": n}


def speculation_options(a: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """--speculative METHOD [--num-speculative-tokens K] as a speculative_config (an explicit
    --speculative-config wins)."""
    method = getattr(a, "speculative", None)
    if method is None or "speculative_config" in options:
        return options
    return {**options, "speculative_config": {
        "method": method, "num_speculative_tokens": a.num_speculative_tokens}}


def speculation_report(llm: Any) -> dict[str, Any] | None:
    spec = llm.engine.speculator
    if spec is None:
        return None
    st = spec.stats
    return {**dataclasses.asdict(st),
            "num_speculative_tokens": spec.config.num_speculative_tokens,
            "acceptance_rate": round(st.acceptance_rate, 3),
            "mean_accepted_length": round(st.mean_accepted_length, 3)}


def bench_latency(a: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from tessellm import LLM
    from tessellm.cli.copy_workload import copy_prompt_ids
    from tessellm.cli.bench_lora import lora_options, random_adapters
    options = {"max_num_seqs": 1, "load_progress": False,
               **lora_options(a, speculation_options(a, options))}
    copy = getattr(a, "workload", "random") == "copy"
    t0 = time.perf_counter()
    llm = LLM(a.model, **options)
    load_s = time.perf_counter() - t0
    llm.engine.parts.device.allocator().wait_committed()   # no page faults in timed steps
    rss = resident_bytes()
    n_lora = getattr(a, "lora_adapters", 0) or 0
    lora = random_adapters(llm, 1, a.lora_rank)[0] if n_lora > 0 else None
    parts = llm.engine.parts
    high = min(32000, parts.spec.vocab_size)
    runs = []
    profiling = getattr(a, "profile", False)
    bar = progress(a.runs + 1 + profiling, "bench latency")
    def prompt(r: int) -> list[int]:
        if copy:
            return copy_prompt_ids(llm, r)
        return np.random.default_rng(a.seed + r).integers(100, high, size=a.input_len).tolist()

    for r in range(a.runs + 1):  # run 0 warms up (and profiles the buckets it meets)
        res = one_stream(llm, prompt(r), a.output_len, ignore_eos=not copy,
                         temperature=a.temperature, seed=a.seed + r, lora=lora)
        if r:
            runs.append(res)
        bar.update()
    med = {k: round(statistics.median(x[k] for x in runs), 2) for k in runs[0]}
    per_run = {f"{k}_runs": [round(x[k], 2) for x in runs]
               for k in ("prefill_tok_per_s", "decode_tok_per_s", "output_tokens")}
    profile = None
    if profiling:   # one more run, instrumented, not in the figures above
        from tessellm.engine.op_profile import OpProfile
        with OpProfile(llm.engine) as prof:
            one_stream(llm, prompt(2000), a.output_len, ignore_eos=not copy,
                       temperature=a.temperature, seed=a.seed + 2000, lora=lora)
        profile = prof.report()
        bar.update()
    bar.close()
    return {
        "workload": "W6 copy-heavy one stream" if copy else "W3/W4 one stream",
        "model": parts.source.name, "device": parts.device.name,
        "dtype": str(parts.dtype).removeprefix("torch."),
        "quantization": parts.config.quantization,
        "packed_activations": parts.packed_activations, "threads": torch.get_num_threads(),
        "in_len": a.input_len, "out_len": a.output_len, "runs": a.runs,
        "temperature": a.temperature,
        "load_s": round(load_s, 2), "weight_bytes": parts.weight_bytes,
        "kv_cache_bytes": sum(t.numel() * t.element_size() for t in parts.kv_caches),
        "rss_after_load_bytes": rss, **med, **per_run,
        "speculative": speculation_report(llm),
        "lora_rank": a.lora_rank if lora is not None else None,
        **({"profile": profile} if profile is not None else {}),
    }
