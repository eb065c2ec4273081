"""`tessellm bench serve` (W2 client) against a real server process."""
from __future__ import annotations

import asyncio

from server_fixtures import running_server, wait_idle

from tessellm.cli.bench_serve import engine_step_totals, run_bench_serve, server_steps


def test_bench_serve_reports_latency_percentiles(tmp_path, stories_dir):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {stories_dir}\ndtype: float32\nkernel_selection: first\n"
                      f"num_threads: 1\n")
    with running_server(tmp_path, ["--config", str(config), "--api-key", "k"]) as server:
        result = asyncio.run(run_bench_serve(server.url, num_prompts=6, request_rate=20.0,
                                             input_len=16, output_len=8, api_key="k",
                                             vocab_size=512))
        shared = asyncio.run(run_bench_serve(server.url, num_prompts=6, request_rate=20.0,
                                             input_len=8, output_len=4, api_key="k",
                                             vocab_size=512, shared_prefixes=2,
                                             prefix_len=64))
        wait_idle(server)
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_tok_per_s"] > 0 and result["req_per_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        p = result[key]
        assert p["p50"] is not None and p["p50"] <= p["p90"] <= p["p99"]
    assert result["e2e_ms"]["p50"] >= result["ttft_ms"]["p50"]
    # the server's own cost per step: 6 requests of 8 tokens took at least 8 steps
    steps = result["server_steps"]
    assert steps["steps"] >= 8 and steps["stage_ms_per_step"]["execute"] > 0
    assert 0 < steps["host_ms_per_step"] < sum(steps["stage_ms_per_step"].values())
    # the shared-prefix workload: 2 prefixes of 64 tokens over 6 requests hit the cache
    assert shared["workload"] == "shared-prefix" and shared["failed"] == 0, shared["errors"]
    assert shared["prefix_hit_tokens"] >= 48 and "prefix_hit_tokens_by_replica" not in shared


BEFORE = """# HELP tessellm:engine_steps_total Engine steps run
tessellm:engine_steps_total{replica="0"} 10.0
tessellm:engine_steps_total{replica="1"} 10.0
tessellm:engine_steps_totally_other 99.0
tessellm:engine_stage_seconds_total{replica="0",stage="execute"} 1.0
tessellm:engine_stage_seconds_total{replica="1",stage="execute"} 1.0
tessellm:engine_stage_seconds_total{replica="0",stage="schedule"} 0.1
tessellm:engine_stage_seconds_total{replica="0",stage="detokenize"} 0.5
"""
AFTER = """tessellm:engine_steps_total{replica="0"} 30.0
tessellm:engine_steps_total{replica="1"} 30.0
tessellm:engine_stage_seconds_total{replica="0",stage="execute"} 2.0
tessellm:engine_stage_seconds_total{replica="1",stage="execute"} 2.0
tessellm:engine_stage_seconds_total{replica="0",stage="schedule"} 0.14
tessellm:engine_stage_seconds_total{replica="1",stage="sample"} 0.02
tessellm:engine_stage_seconds_total{replica="0",stage="detokenize"} 0.9
"""


def test_server_steps_sums_replicas_and_leaves_the_forward_pass_and_front_end_out():
    before, after = engine_step_totals(BEFORE), engine_step_totals(AFTER)
    assert before == (20.0, {"execute": 2.0, "schedule": 0.1, "detokenize": 0.5})
    steps = server_steps(before, after)
    assert steps["steps"] == 40
    assert steps["stage_ms_per_step"] == {"detokenize": 10.0, "execute": 50.0, "sample": 0.5,
                                          "schedule": 1.0}
    assert steps["host_ms_per_step"] == 1.5   # schedule + sample; not execute, not detokenize


def test_server_steps_is_absent_without_tessellm_series_or_steps():
    vllm = "vllm:num_requests_running 0.0\nvllm:iteration_tokens_total_count 5.0\n"
    assert engine_step_totals(vllm) is None
    assert server_steps(None, engine_step_totals(AFTER)) is None
    assert server_steps(engine_step_totals(AFTER), engine_step_totals(AFTER)) is None
