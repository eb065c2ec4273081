"""One-stream decode (W3) with torch.compile over the whole decoder step: the issue's
"torch.compile (Inductor's C++ backend)" alternative to tessellm's native decode programs,
measured on the same weights.

HF transformers' Llama with a static KV cache and its forward compiled by Inductor
(`mode="max-autotune-no-cudagraphs"`: C++ kernels for the pointwise work, oneDNN/ATen for the
GEMMs), one prompt of IN_LEN ids from numpy.random.default_rng(SEED + run), OUT_LEN greedy
tokens. Prints one JSON line: compile_s (the first run, compiling), prefill_tok_per_s and
decode_tok_per_s (medians of --runs after it), the same fields as `tessellm bench latency`.

Usage: python peer_torch_compile.py MODEL_DIR [--dtype bfloat16] [--runs 3] [--threads 2]
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


class _TokenClock:
    """A generate() streamer that notes when each put() (prompt, then each token) arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode=a.mode, fullgraph=True)
    high = min(32000, model.config.vocab_size)
    runs = []
    compile_s = None
    for r in range(a.runs + 1):   # run 0 compiles (prefill and decode shapes)
        ids = torch.from_numpy(np.random.default_rng(a.seed + r).integers(100, high, (1, a.in_len)))
        clock = _TokenClock()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=a.out_len, min_new_tokens=a.out_len,
                                 do_sample=False, streamer=clock)
        t2 = time.perf_counter()
        assert out.shape[1] == a.in_len + a.out_len
        if r == 0:
            compile_s = t2 - t0
            continue
        t1 = clock.times[1]   # times[0]: the prompt handed over; [1]: the first new token
        runs.append({"prefill_tok_per_s": a.in_len / (t1 - t0),
                     "decode_tok_per_s": (a.out_len - 1) / (t2 - t1)})
    med = {k: round(statistics.median(x[k] for x in runs), 2) for k in runs[0]}
    print(json.dumps({"engine": f"transformers + torch.compile ({a.mode})", "model": a.model,
                      "dtype": a.dtype, "threads": a.threads, "in_len": a.in_len,
                      "out_len": a.out_len, "runs": a.runs, "compile_s": round(compile_s, 1),
                      **med}))


if __name__ == "__main__":
    main()
