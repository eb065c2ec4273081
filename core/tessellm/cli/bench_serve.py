"""`tessellm bench serve`: workload W2 of ../shared/bench/WORKLOAD.md against a running server.

N streaming `/v1/completions` requests with Poisson arrivals at `request_rate` per second
(exponential gaps from numpy's default_rng(seed)); prompts are W1's token-id rows (ids below vocab_size); each asks
for exactly output_len tokens (ignore_eos). Per request: TTFT (submit to first streamed
token), TPOT ((end - first token) / (completion tokens - 1)), end-to-end latency. Prints one
JSON object: request throughput, output token throughput, p50/p90/p99 of TTFT and TPOT.

Shared-prefix workload (`shared_prefixes` > 0, the data-parallel routing figure of issue
#33): `shared_prefixes` system prompts of `prefix_len` random token ids are drawn first;
each request is one of them (chosen at random) followed by its own `input_len` random ids.
The report then adds the prefix-cache hit tokens the run produced (the server's
`tessellm:prefix_cache_hits` before and after, in total and per `replica` label).

Against a tessellm server the report also has "server_steps": the engine steps the run took
and its engine cores' time per step by stage (`tessellm:engine_stage_seconds` and
`tessellm:engine_steps` before and after, summed over replicas). "host_ms_per_step" is every
core stage but "execute" (the forward pass): the per-step host time of issue #29's W2 figure.
Servers without those series (vLLM) get no "server_steps".
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessellm.errors import ConfigError


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    completion_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def _percentiles(values: list[float], unit: float = 1e3) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * unit
    return {f"p{p}": round(float(np.percentile(arr, p)), 2) for p in (50, 90, 99)}


async def _one(session: Any, url: str, body: dict[str, Any], headers: dict[str, str]
               ) -> RequestResult:
    t0 = time.perf_counter()
    ttft = None
    usage_tokens = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"]))
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # connection refused, reset...: counted as a failed request
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter() - t0
    return RequestResult(True, ttft if ttft is not None else end, end, usage_tokens)


def _label(key: str, name: str) -> str:
    """The value of label `name` in a sample's `series{...}` key ("" without it)."""
    return key.partition(f'{name}="')[2].partition('"')[0]


def _samples(metrics_text: str, series: str) -> list[tuple[str, float]]:
    """(the key with its labels, value) of every sample of `series` in a Prometheus text."""
    out = []
    for line in metrics_text.splitlines():
        if line.startswith(series) and line[len(series):len(series) + 1] in ("{", " "):
            key, _, value = line.rpartition(" ")
            out.append((key, float(value)))
    return out


def prefix_hits(metrics_text: str) -> dict[str, float]:
    """`tessellm:prefix_cache_hits_total` per replica label ("" without one)."""
    return {_label(key, "replica"): v
            for key, v in _samples(metrics_text, "tessellm:prefix_cache_hits_total")}


def engine_step_totals(metrics_text: str) -> tuple[float, dict[str, float]] | None:
    """(engine steps, {stage: seconds}), each summed over replicas; None where the server
    exports no `tessellm:engine_steps_total` (not a tessellm server)."""
    steps = _samples(metrics_text, "tessellm:engine_steps_total")
    if not steps:
        return None
    stages: dict[str, float] = {}
    for key, v in _samples(metrics_text, "tessellm:engine_stage_seconds_total"):
        stage = _label(key, "stage")
        stages[stage] = stages.get(stage, 0.0) + v
    return sum(v for _, v in steps), stages


def server_steps(before: tuple[float, dict[str, float]] | None,
                 after: tuple[float, dict[str, float]] | None) -> dict[str, Any] | None:
    """What a run cost the server per engine step: {"steps", "stage_ms_per_step",
    "host_ms_per_step"} from totals before and after it; None without totals or steps.
    "detokenize" is the front end's, outside the engine core's step, and not host time."""
    if before is None or after is None or after[0] - before[0] <= 0:
        return None
    steps = after[0] - before[0]
    per_step = {stage: round((s - before[1].get(stage, 0.0)) / steps * 1e3, 3)
                for stage, s in sorted(after[1].items())}
    host = sum(ms for stage, ms in per_step.items() if stage not in ("execute", "detokenize"))
    return {"steps": int(steps), "stage_ms_per_step": per_step,
            "host_ms_per_step": round(host, 3)}


async def _metrics(session: Any, base: str, headers: dict[str, str]) -> str:
    async with session.get(f"{base}/metrics", headers=headers) as r:
        return await r.text()


def make_prompts(rng: np.random.Generator, num_prompts: int, input_len: int, vocab_size: int,
                 shared_prefixes: int = 0, prefix_len: int = 0) -> list[list[int]]:
    """W2's random rows, or (shared_prefixes > 0) one of the shared prefixes + a row each."""
    low, high = min(100, vocab_size - 1), min(32000, vocab_size)
    rows = rng.integers(low, high, size=(num_prompts, input_len)).tolist()
    if shared_prefixes <= 0:
        return rows
    prefixes = rng.integers(low, high, size=(shared_prefixes, prefix_len)).tolist()
    which = rng.integers(0, shared_prefixes, size=num_prompts).tolist()
    return [prefixes[k] + row for k, row in zip(which, rows)]


async def run_bench_serve(url: str, num_prompts: int, request_rate: float, input_len: int,
                          output_len: int, seed: int = 0, model: str | None = None,
                          api_key: str | None = None, vocab_size: int = 32000,
                          shared_prefixes: int = 0, prefix_len: int = 1000
                          ) -> dict[str, Any]:
    import aiohttp

    if shared_prefixes < 0 or (shared_prefixes and prefix_len < 1):
        raise ConfigError("the shared-prefix workload needs --shared-prefixes >= 0 and "
                         "--prefix-len >= 1")
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = np.random.default_rng(seed)
    prompts = make_prompts(rng, num_prompts, input_len, vocab_size, shared_prefixes,
                           prefix_len)
    gaps = rng.exponential(1.0 / request_rate, size=num_prompts) if request_rate > 0 \
        else np.zeros(num_prompts)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as r:
                model = (await r.json())["data"][0]["id"]
        metrics_before = await _metrics(session, base, headers)
        tasks = []
        t0 = time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(float(gap))
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(
                _one(session, f"{base}/v1/completions", body, headers)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        metrics_after = await _metrics(session, base, headers)
    hits_before, hits_after = prefix_hits(metrics_before), prefix_hits(metrics_after)
    steps = server_steps(engine_step_totals(metrics_before), engine_step_totals(metrics_after))
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    gained = {k: v - hits_before.get(k, 0.0) for k, v in sorted(hits_after.items())}
    return {
        "workload": "shared-prefix" if shared_prefixes else "W2", "url": base,
        "num_prompts": num_prompts,
        **({"shared_prefixes": shared_prefixes, "prefix_len": prefix_len}
           if shared_prefixes else {}),
        "request_rate": request_rate, "input_len": input_len, "output_len": output_len,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": round(wall, 3), "req_per_s": round(len(ok) / wall, 3),
        "output_tok_per_s": round(out_tokens / wall, 2),
        "ttft_ms": _percentiles([r.ttft_s for r in ok]),
        "tpot_ms": _percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": _percentiles([r.latency_s for r in ok]),
        "prefix_hit_tokens": sum(gained.values()),
        **({"prefix_hit_tokens_by_replica": gained} if any(k for k in gained) else {}),
        **({"server_steps": steps} if steps is not None else {}),
    }
