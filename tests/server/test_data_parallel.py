"""`tessellm serve --data-parallel-size 2` on a local Ray cluster (tessellm.ray): two CPU
replicas of one thread each behind one server. Greedy outputs equal one engine's; with
prefix-aware routing requests sharing a long prefix land on one replica (its prefix-hit
counter rises, the other's does not); a replica whose actor is SIGKILLed fails only its own
in-flight request (the error names it), new requests succeed, and Ray restarts it into
rotation. One server (and one Ray cluster) for the module. Hostile configs fail before
anything serves. Skipped, with the reason, where Ray is not installed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from server_fixtures import metrics, request, running_server, sse_events
from tessellm import SamplingParams
from tessellm.errors import ConfigError

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tessellm[ray]')")

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]
PIDS = re.compile(r"replica-(\d+) pid (\d+)")


@pytest.fixture(scope="module")
def dp_server(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--model", str(stories_dir), "--dtype", "float32", "--kernel-selection", "first",
            "--threads", "1", "--data-parallel-size", "2", "--dp-routing", "prefix-aware",
            "--replica-max-restarts", "2"]
    with running_server(tmp_path_factory.mktemp("dp"), args) as server:
        yield server


def _pids(server) -> dict[str, int]:
    return {f"replica-{i}": int(pid) for i, pid in PIDS.findall(server.log())}


def _per_replica(m: dict[str, float], name: str) -> dict[str, float]:
    return {r: m.get(f'{name}{{replica="{r}"}}', 0.0) for r in ("replica-0", "replica-1")}


def _complete(server, prompt: str, max_tokens: int = 12) -> dict:
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body


def test_greedy_outputs_equal_one_engine_and_both_replicas_serve(dp_server, offline):
    results: dict[str, str] = {}

    def run(prompt: str) -> None:
        results[prompt] = _complete(dp_server, prompt)["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    assert results == {p: o.outputs[0].text for p, o in zip(PROMPTS, expected)}
    prompt_tokens = _per_replica(metrics(dp_server), "tessellm:prompt_tokens_total")
    assert all(v > 0 for v in prompt_tokens.values()), prompt_tokens
    status, _, snap = request(dp_server, "GET", "/api/dashboard")   # one row per replica
    assert status == 200 and [r["name"] for r in snap["replicas"]] == ["replica-0", "replica-1"]
    assert snap["tokens"]["prompt"] == sum(prompt_tokens.values())


def test_prefix_aware_routing_keeps_a_shared_prefix_on_one_replica(dp_server):
    prefix = " ".join(["Once upon a time there was a little girl named Lily who loved to "
                       "play outside in the sun with her friends."] * 4)
    before = _per_replica(metrics(dp_server), "tessellm:prefix_cache_hits_total")
    for suffix in ("She", "One day", "Her mom", "They"):
        _complete(dp_server, f"{prefix} {suffix}", max_tokens=4)
    after = _per_replica(metrics(dp_server), "tessellm:prefix_cache_hits_total")
    gained = {r: after[r] - before[r] for r in after}
    assert sorted(gained.values())[0] == 0 and sorted(gained.values())[1] >= 3 * 64, gained


def test_bench_serve_shared_prefix_reports_hits_per_replica(dp_server):
    import asyncio

    from tessellm.cli.bench_serve import run_bench_serve
    result = asyncio.run(run_bench_serve(dp_server.url, num_prompts=6, request_rate=10,
                                         input_len=8, output_len=4, vocab_size=512,
                                         shared_prefixes=2, prefix_len=64))
    assert result["failed"] == 0, result["errors"]
    by_replica = result["prefix_hit_tokens_by_replica"]
    assert set(by_replica) == {"replica-0", "replica-1"}
    assert sum(by_replica.values()) == result["prefix_hit_tokens"] > 0


def _stream(server, prompt: str, out: dict, started: threading.Event) -> None:
    import http.client
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": prompt, "max_tokens": 480, "temperature": 0, "ignore_eos": True,
         "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    first = resp.readline()
    out["text"] = first.decode()
    started.set()
    out["text"] += resp.read().decode()
    conn.close()


def test_a_killed_replica_fails_only_its_requests_and_rejoins(dp_server):
    pids = _pids(dp_server)
    assert set(pids) == {"replica-0", "replica-1"}, dp_server.log()[-2000:]
    outs = [{}, {}]
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(dp_server, f"{p} and then", o, s))
               for p, o, s in zip(("A cat sat", "The sun was"), outs, started)]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(60)
    running = _per_replica(metrics(dp_server), "tessellm:num_requests_running")
    assert running == {"replica-0": 1, "replica-1": 1}, running
    os.kill(pids["replica-0"], signal.SIGKILL)
    for t in threads:
        t.join(60)
    failed = [o for o in outs if '"error"' in o["text"]]
    finished = [o for o in outs if '"finish_reason":"length"' in o["text"]]
    assert len(failed) == 1 and len(finished) == 1, outs
    error = json.loads([e for e in sse_events(failed[0]["text"]) if '"error"' in e][0])
    assert "replica-0" in error["error"]["message"], error
    # the other replica takes new requests at once
    for p in PROMPTS[:2]:
        _complete(dp_server, p, max_tokens=4)
    m = metrics(dp_server)
    assert _per_replica(m, "tessellm:engine_core_alive")["replica-1"] == 1
    # Ray restarts the actor; its core reports Ready and it rejoins rotation
    deadline = time.monotonic() + 120
    while _per_replica(metrics(dp_server), "tessellm:engine_core_alive")["replica-0"] != 1:
        assert time.monotonic() < deadline, dp_server.log()[-3000:]
        time.sleep(0.5)
    for p in PROMPTS:
        _complete(dp_server, p, max_tokens=4)
    served = _per_replica(metrics(dp_server), "tessellm:prompt_tokens_total")
    assert served["replica-0"] > 0, served   # counted since the restart
    assert request(dp_server, "GET", "/health")[0] == 200


# ---- hostile configuration: errors before anything serves --------------------------------

def _configs(*flags: str):
    from tessellm.cli.commands import serve_configs
    from tessellm.cli.main import build_parser
    return serve_configs(build_parser().parse_args(["serve", *flags]))


@pytest.mark.parametrize("size", ["0", "-2"])
def test_data_parallel_size_below_one_is_refused(size):
    with pytest.raises(ConfigError, match="data_parallel_size"):
        _configs("--data-parallel-size", size)


def test_replica_options_without_replicas_are_refused():
    with pytest.raises(ConfigError, match="ray_address applies to replicas .* or to "
                       "distributed_executor_backend 'ray'"):
        _configs("--ray-address", "auto")
    with pytest.raises(ConfigError, match="needs data_parallel_size > 1"):
        _configs("--dp-routing", "prefix-aware")


def test_tensor_parallel_replicas_are_refused_before_ray_starts(stories_dir, monkeypatch):
    from tessellm.server.serve import run_server
    monkeypatch.setitem(sys.modules, "ray", None)   # proves nothing reached Ray
    engine, server = _configs("--model", str(stories_dir), "-dp", "2", "-tp", "2")
    with pytest.raises(ConfigError, match="--tensor-parallel-size > 1 is not supported"):
        run_server(engine, server)


def test_missing_ray_is_a_startup_error(stories_dir, monkeypatch):
    from tessellm.server.serve import run_server
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` raises ImportError
    engine, server = _configs("--model", str(stories_dir), "-dp", "2")
    with pytest.raises(ConfigError, match=r"pip install 'tessellm\[ray\]'"):
        run_server(engine, server)
