"""The `tessellm` subcommands (generate, serve, plugins, kernels, conformance, bench ...): each
`cmd_*` takes the parsed command line (cli/main.py's parser) and returns the exit code; the
engine options a command line gives (`engine_options`) and a server's configs
(`serve_configs`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tessellm.errors import ConfigError

if TYPE_CHECKING:
    from tessellm.config import EngineConfig
    from tessellm.server.server_config import ServerConfig


def engine_options(a: argparse.Namespace) -> dict:
    keys = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size",
            "num_kv_blocks", "kernel_selection", "num_threads", "revision", "gguf_file",
            "quantization", "gpu_memory_utilization", "enforce_eager", "max_model_len",
            "tensor_parallel_size", "pipeline_parallel_size", "pipeline_micro_batches",
            "pipeline_micro_batch_tokens", "distributed_executor_backend", "ray_address", "ray_placement_strategy",
            "packed_activations", "async_scheduling", "enable_lora",
            "max_loras", "max_lora_rank", "max_cpu_loras")
    options = {k: getattr(a, k) for k in keys if getattr(a, k, None) is not None}
    if getattr(a, "speculative_config", None) is not None:
        options["speculative_config"] = _json_object("--speculative-config",
                                                     a.speculative_config)
    return options


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _structured_outputs(a: argparse.Namespace):
    """--json-schema FILE or --regex as a StructuredOutputs (None without either)."""
    from tessellm.constraints.structured_outputs import StructuredOutputs
    if a.json_schema is not None and a.regex is not None:
        raise ConfigError("give --json-schema or --regex, not both")
    if a.regex is not None:
        return StructuredOutputs(regex=a.regex)
    if a.json_schema is None:
        return None
    try:
        text = Path(a.json_schema).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read the JSON schema {a.json_schema!r}: {e}") from None
    return StructuredOutputs(json=text)


def cmd_generate(a: argparse.Namespace) -> int:
    from tessellm import LLM, SamplingParams
    from tessellm.models.demo import DEMO_NOTICE
    llm = LLM(a.model, **engine_options(a))
    if llm.is_demo:
        print(f"[tessellm] {DEMO_NOTICE}", file=sys.stderr)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, min_p=a.min_p, seed=a.seed, ignore_eos=a.ignore_eos,
                            structured_outputs=_structured_outputs(a))
    if a.chat:   # the prompt as the user's message, through the model's chat template
        messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}]
        out = llm.chat(messages, params)[0]
    else:
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
        for what in r.get("overrides", []):
            print(f"    overrides built-in {what} (declared)")
        for d in r.get("devices", []):
            state = "available" if d["available"] else f"unavailable: {d['reason']}"
            print(f"    device {d['name']} (priority {d['priority']}, distributed backend "
                  f"{d['distributed_backend']}): {state}")
            for kernel, why in d.get("kernels_not_offered", {}).items():
                why = why.replace("\n", "\n            ")   # a compiler's output, indented
                print(f"        kernel {kernel} not offered: {why}")
    return 0


def cmd_kernels(a: argparse.Namespace) -> int:
    from tessellm.cli.kernels_table import print_kernel_rankings
    print_kernel_rankings(a.model, engine_options(a), [int(b) for b in a.buckets.split(",")],
                          as_json=a.json)
    return 0


def cmd_conformance(a: argparse.Namespace) -> int:
    from tessellm.testing import run_conformance
    groups = a.checks.split(",") if a.checks else None
    skip = a.skip.split(",") if a.skip else ()
    report = run_conformance(a.device, model_dir=a.model, groups=groups, skip=skip)
    print(report.to_json() if a.json else report.table())
    return 0 if report.passed else 1


def _report(result: dict, target) -> None:
    """Print the bench result's JSON line; draw it into `target` (a checked PNG path) if set."""
    print(json.dumps(result))
    if target is not None:
        from tessellm.cli.bench_report import plot_result
        print(f"tessellm: figures in {plot_result(result, target)}", file=sys.stderr)


def cmd_bench_throughput(a: argparse.Namespace) -> int:
    from tessellm.cli.bench import bench_throughput
    from tessellm.cli.bench_report import check_plot_target
    target = check_plot_target(a.plot)
    _report(bench_throughput(a, engine_options(a)), target)
    return 0


def cmd_bench_latency(a: argparse.Namespace) -> int:
    from tessellm.cli.bench_latency import bench_latency
    from tessellm.cli.bench_report import check_plot_target
    target = check_plot_target(a.plot)
    _report(bench_latency(a, engine_options(a)), target)
    return 0


def cmd_bench_serve(a: argparse.Namespace) -> int:
    import asyncio

    from tessellm.cli.bench_report import check_plot_target
    from tessellm.cli.bench_serve import run_bench_serve
    target = check_plot_target(a.plot)
    result = asyncio.run(run_bench_serve(a.url, a.num_prompts, a.request_rate, a.input_len,
                                         a.output_len, seed=a.seed, model=a.model,
                                         api_key=a.api_key, vocab_size=a.vocab_size,
                                         shared_prefixes=a.shared_prefixes,
                                         prefix_len=a.prefix_len))
    _report(result, target)
    return 0 if result["failed"] == 0 else 1


def cmd_bench_schedule(a: argparse.Namespace) -> int:
    from tessellm.cli.bench_schedule import run_bench_schedule
    print(json.dumps(run_bench_schedule(a)))
    return 0


def cmd_bench_startup(a: argparse.Namespace) -> int:
    from tessellm.cli.bench_startup import print_report, run_bench_startup
    print_report(run_bench_startup(a))
    return 0


def serve_configs(a: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs of a parsed `serve` command line (file, then flags)."""
    from tessellm.server.server_config import load_configs
    server_flags = ("host", "port", "api_key", "max_queue", "max_body_bytes", "max_n",
                    "chat_template", "drain_timeout_s", "request_timeout_s",
                    "engine_heartbeat_timeout_s", "engine_stall_timeout_s", "header_timeout_s",
                    "body_timeout_s", "keepalive_timeout_s", "max_connections",
                    "tool_call_parser", "grpc_port", "otlp_traces_endpoint", "lora_modules",
                    "allow_runtime_lora", "data_parallel_size", "dp_routing",
                    "replica_max_restarts")
    overrides = {**engine_options(a), "model": a.model,
                 **{k: getattr(a, k) for k in server_flags}}
    return load_configs(a.config, overrides)


def cmd_serve(a: argparse.Namespace) -> int:
    from tessellm.server.serve import run_server
    return run_server(*serve_configs(a))
