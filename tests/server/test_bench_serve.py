"""`tessellm bench serve` (W2 client) against a real server process."""
from __future__ import annotations

import asyncio

from server_fixtures import running_server, wait_idle

from tessellm.cli.bench_serve import run_bench_serve


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
    # the shared-prefix workload: 2 prefixes of 64 tokens over 6 requests hit the cache
    assert shared["workload"] == "shared-prefix" and shared["failed"] == 0, shared["errors"]
    assert shared["prefix_hit_tokens"] >= 48 and "prefix_hit_tokens_by_replica" not in shared
