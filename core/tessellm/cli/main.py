"""`tessellm` command: generate, plugins, kernels, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from tessellm.errors import TessellmError


def _engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", required=model_required,
                   help="HF model directory (default: the built-in untrained demo model)")
    p.add_argument("--device", default="auto", help="auto | cpu | <plugin device name>")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kernel-selection", default=None, choices=["profile", "first"])
    p.add_argument("--threads", dest="num_threads", type=int, default=None)


def engine_options(a: argparse.Namespace) -> dict:
    keys = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size",
            "num_kv_blocks", "kernel_selection", "num_threads")
    return {k: getattr(a, k) for k in keys if getattr(a, k, None) is not None}


def cmd_generate(a: argparse.Namespace) -> int:
    from tessellm import LLM, SamplingParams
    from tessellm.models.demo import DEMO_NOTICE
    llm = LLM(a.model, **engine_options(a))
    if llm.is_demo:
        print(f"[tessellm] {DEMO_NOTICE}", file=sys.stderr)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, min_p=a.min_p, seed=a.seed, ignore_eos=a.ignore_eos)
    out = llm.generate([a.prompt], params)[0]
    print(out.text)
    return 0


def cmd_plugins(a: argparse.Namespace) -> int:
    from tessellm.plugins import PluginManager
    rows = PluginManager().load().report()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['plugin']} {r['version']} [{r['status']}] {r['value']}")
        if r.get("error"):
            print(f"    error: {r['error']}")
        for d in r.get("devices", []):
            state = "available" if d["available"] else f"unavailable: {d['reason']}"
            print(f"    device {d['name']} (priority {d['priority']}): {state}")
    return 0


def cmd_kernels(a: argparse.Namespace) -> int:
    from tessellm.cli.kernels_table import print_kernel_rankings
    print_kernel_rankings(a.model, engine_options(a), [int(b) for b in a.buckets.split(",")],
                          as_json=a.json)
    return 0


def cmd_bench_throughput(a: argparse.Namespace) -> int:
    from tessellm.cli.bench import bench_throughput
    print(json.dumps(bench_throughput(a, engine_options(a))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tessellm", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("plugins", help="list every plugin found, its devices and status")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    k = sub.add_parser("kernels", help="print the profiler's kernel ranking per op")
    _engine_args(k)
    k.add_argument("--buckets", default="1,16,256", help="token buckets to rank, comma-separated")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kernels)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="offline throughput, workload W1")
    _engine_args(t)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--warmup-output-len", type=int, default=4)
    t.set_defaults(func=cmd_bench_throughput)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except TessellmError as e:
        print(f"tessellm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
