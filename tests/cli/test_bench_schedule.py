"""`tessellm bench schedule`: the scheduler simulator (tessellm.sim) through main(), and its
trace generator and replay directly."""
from __future__ import annotations

import json
import time

import pytest

from tessellm.cli.main import main
from tessellm.errors import ConfigError
from tessellm.scheduler import SchedulerConfig
from tessellm.sim.replay import CostModel, replay
from tessellm.sim.trace import TraceConfig, make_trace

FIELDS = {"ttft_s", "latency_s", "prefix_hit_rate", "prefix_cache", "preemptions", "swap",
          "total_virtual_time_s", "wall_time_s", "num_steps", "finished", "trace", "scheduler",
          "cost_model"}


def run_cli(capsys, *args: str) -> dict:
    assert main(["bench", "schedule", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_ten_thousand_requests_in_seconds(capsys) -> None:
    t0 = time.perf_counter()
    out = run_cli(capsys, "--num-requests", "10000", "--seed", "0", "--priorities", "3")
    assert time.perf_counter() - t0 < 15          # ~3 s on a 2-core laptop
    assert FIELDS <= out.keys()
    assert out["finished"] == out["num_requests"] == 10_000 and out["rejected"] == 0
    assert set(out["ttft_s"]) == {"0", "1", "2"}
    assert sum(c["count"] for c in out["ttft_s"].values()) == 10_000
    for c in out["ttft_s"].values():
        assert 0 < c["p50"] <= c["p99"]
    # Under load the most urgent class waits least, the least urgent most.
    assert out["ttft_s"]["0"]["p99"] < out["ttft_s"]["2"]["p99"]
    assert 0 < out["prefix_hit_rate"] < 1 and out["preemptions"] > 0
    assert out["swap"] == {"blocks_out": 0, "blocks_in": 0}
    assert out["total_virtual_time_s"] > 0 and out["wall_time_s"] < 15


def test_same_seed_same_figures_and_options_apply(capsys) -> None:
    args = ("--num-requests", "300", "--seed", "3", "--request-rate", "200", "--burst", "4",
            "--num-kv-blocks", "256", "--max-num-seqs", "16")
    a, b = run_cli(capsys, *args), run_cli(capsys, *args)
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a == b
    plain = run_cli(capsys, *args, "--no-prefix-caching", "--shared-prefix-frac", "0",
                    "--aging-interval-steps", "0")
    assert plain["prefix_hit_rate"] == 0 and plain["scheduler"]["prefix_caching"] is False
    sla = run_cli(capsys, *args, "--sla-itl-ms", "1", "--cost-a", "0.01")
    assert sla["final_max_num_seqs"] < 16 and sla["cost_model"]["a"] == 0.01
    assert sla["finished"] == 300


def test_bad_options_are_reported(capsys) -> None:
    assert main(["bench", "schedule", "--num-requests", "0"]) == 2
    assert "num_requests" in capsys.readouterr().err


def test_trace_shape() -> None:
    cfg = TraceConfig(num_requests=500, seed=1, priorities=4, burst=5, input_len=40,
                      output_len=10, shared_prefix_frac=0.5, num_prefixes=3, prefix_len=16)
    trace = make_trace(cfg)
    assert trace == make_trace(cfg) and trace != make_trace(TraceConfig(num_requests=500))
    arrivals = [t.arrival_s for t in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert all(arrivals[i] == arrivals[i - i % 5] for i in range(500))     # bursts of 5
    assert {t.priority for t in trace} == {0, 1, 2, 3}
    assert all(20 <= len(t.prompt) <= 60 and 5 <= t.max_tokens <= 15 for t in trace)
    groups: dict[int, list[int]] = {}
    for t in trace:
        assert all(0 <= x < cfg.vocab_size for x in t.prompt)
        if t.prefix_group >= 0:
            head = groups.setdefault(t.prefix_group, t.prompt[:16])
            assert t.prompt[:16] == head
    assert 150 < sum(t.prefix_group >= 0 for t in trace) < 350 and len(groups) == 3


@pytest.mark.parametrize("kwargs", [dict(priorities=0), dict(request_rate=0),
                                    dict(shared_prefix_frac=1.5), dict(burst=0)])
def test_trace_validation(kwargs) -> None:
    with pytest.raises(ConfigError):
        TraceConfig(**kwargs)


def test_replay_uses_the_cost_model_and_finishes_everyone_without_aging() -> None:
    trace = make_trace(TraceConfig(num_requests=200, request_rate=1e6, burst=200,
                                   input_len=30, output_len=8))
    cfg = SchedulerConfig(8, 64, 256, priority_levels=3, aging_interval_steps=0)
    free = replay(trace, cfg, 64, 4, cost=CostModel(0.0, 0.0, 0.0))
    assert free["finished"] == 200 and free["total_virtual_time_s"] == 0.0
    timed = replay(trace, cfg, 64, 4, cost=CostModel(0.01, 0.0, 0.0))
    assert timed["total_virtual_time_s"] == pytest.approx(0.01 * timed["num_steps"])
    assert timed["generated_tokens"] == sum(t.max_tokens for t in trace)
    with pytest.raises(ConfigError):
        CostModel(-1.0)
