"""W6 on llama.cpp (llama-cpp-python): one stream over the copy-heavy prompts of
`tessellm bench latency --workload copy`, with and without its prompt-lookup speculation
(LlamaPromptLookupDecoding, the only speculative mode llama-cpp-python exposes).

The prompt ids come from tessellm (the same chat template and tokenizer), written by
    .venv/bin/python -c "from tessellm import LLM; from tessellm.cli.copy_workload import \
copy_prompt_ids; import json; llm = LLM(None, load_progress=False); \
print(json.dumps([copy_prompt_ids(llm, r) for r in range(4)]))" > /tmp/w6_ids.json
Usage: /tmp/lcpp/bin/python peer_llamacpp_copy.py MODEL.gguf /tmp/w6_ids.json
           [--out-len 600] [--num-pred-tokens 10] [--max-ngram-size 2] [--no-draft]
Greedy up to out-len tokens or EOS; decode tok/s = tokens after the first / time after the
first; run 0 warms up; medians over the rest. One JSON line.
"""
import argparse
import json
import os
import time

import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("ids")
    ap.add_argument("--out-len", type=int, default=600)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--num-pred-tokens", type=int, default=10)
    ap.add_argument("--max-ngram-size", type=int, default=2)
    ap.add_argument("--no-draft", action="store_true")
    a = ap.parse_args()
    prompts = json.load(open(a.ids))
    draft = None if a.no_draft else LlamaPromptLookupDecoding(
        max_ngram_size=a.max_ngram_size, num_pred_tokens=a.num_pred_tokens)
    llm = Llama(model_path=a.gguf, n_ctx=max(map(len, prompts)) + a.out_len + 16,
                n_threads=a.threads, n_threads_batch=a.threads, n_batch=512, verbose=False,
                draft_model=draft, logits_all=draft is not None)
    runs = []
    for r, ids in enumerate(prompts):          # prompt 0 warms up
        llm.reset()
        t0 = time.perf_counter()
        t1, n = None, 0
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if t1 is None:
                t1 = time.perf_counter()
            n += 1
            if tok == llm.token_eos() or n >= a.out_len:
                break
        t2 = time.perf_counter()
        if r:
            runs.append({"decode_tok_per_s": (n - 1) / (t2 - t1), "output_tokens": n,
                         "prefill_s": t1 - t0})
    print(json.dumps({"engine": "llama.cpp (llama-cpp-python)", "model": a.gguf,
                      "draft": None if draft is None else
                      f"prompt lookup (max_ngram_size={a.max_ngram_size}, "
                      f"num_pred_tokens={a.num_pred_tokens})",
                      "decode_tok_per_s": round(float(np.median(
                          [x["decode_tok_per_s"] for x in runs])), 2),
                      "decode_tok_per_s_runs": [round(x["decode_tok_per_s"], 2) for x in runs],
                      "output_tokens_runs": [x["output_tokens"] for x in runs]}))


if __name__ == "__main__":
    main()
