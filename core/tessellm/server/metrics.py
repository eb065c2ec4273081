"""Prometheus metrics of one server (names prefixed `tessellm:`), in the app's own registry.

Two sources, so that nothing goes stale between engine steps:
- engine state is read at scrape time by EngineCollector: running/waiting requests, KV cache
  usage, prompt/generation token and preemption counters (LLMEngine.stats) and the cumulative
  seconds per engine stage (`stage_times` of the LLMEngine or the AsyncEngine, when present:
  a StageTimes (its snapshot()), a mapping stage -> seconds, or a dataclass of such fields);
- request latencies are observed as they happen: queue time from the engine thread (the
  EngineObserver hook), TTFT, inter-token latency and end-to-end latency from the handlers.
No module-level state: two apps in one process have two registries.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                         0.5, 1.0, 2.5)


def _stage_items(stage_times: Any) -> list[tuple[str, float]]:
    if stage_times is None:
        return []
    if callable(getattr(stage_times, "snapshot", None)):  # tessellm.engine.stage_times
        stage_times = stage_times.snapshot()
    if isinstance(stage_times, Mapping):
        return [(str(k), float(v)) for k, v in list(stage_times.items())]
    if dataclasses.is_dataclass(stage_times):
        return [(f.name, float(getattr(stage_times, f.name)))
                for f in dataclasses.fields(stage_times)]
    return []


class EngineCollector(Collector):
    """Reads the engine's live state at every scrape (reads only; the GIL keeps each read
    consistent enough for monitoring)."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self._async = async_engine

    def collect(self) -> Iterator[Metric]:
        engine: LLMEngine = self._async.engine
        yield GaugeMetricFamily("tessellm:num_requests_running",
                                "Requests in the running batch", engine.scheduler.num_running)
        yield GaugeMetricFamily("tessellm:num_requests_waiting",
                                "Requests accepted and not yet running", self._async.num_waiting)
        yield GaugeMetricFamily("tessellm:kv_cache_usage_perc",
                                "Fraction of KV cache blocks in use (0..1)", engine.kv.usage)
        yield GaugeMetricFamily("tessellm:model_weight_bytes",
                                "Bytes of model weights on the device (packed ones as stored)",
                                engine.parts.weight_bytes)
        s = engine.stats
        yield CounterMetricFamily("tessellm:prompt_tokens", "Prompt tokens computed",
                                  s.num_prompt_tokens)
        yield CounterMetricFamily("tessellm:generation_tokens", "Tokens generated",
                                  s.num_generated_tokens)
        yield CounterMetricFamily("tessellm:num_preemptions", "Requests preempted",
                                  s.num_preemptions)
        yield CounterMetricFamily("tessellm:engine_steps", "Engine steps run", s.num_steps)
        stages = CounterMetricFamily("tessellm:engine_stage_seconds",
                                     "Cumulative seconds per engine stage", labels=["stage"])
        seen: set[str] = set()
        for owner in (engine, self._async):
            for stage, seconds in _stage_items(getattr(owner, "stage_times", None)):
                if stage not in seen:
                    seen.add(stage)
                    stages.add_metric([stage], seconds)
        yield stages


class ServerMetrics:
    """The registry of one app, and the EngineObserver that feeds its queue-time histogram."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(async_engine))
        r = self.registry
        self.queue_time = Histogram("tessellm:request_queue_time_seconds",
                                    "Arrival to first schedule", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.ttft = Histogram("tessellm:time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("tessellm:inter_token_latency_seconds",
                             "Time between generated tokens", buckets=TOKEN_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tessellm:e2e_request_latency_seconds",
                             "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter("tessellm:request_finished", "Finished sequences by reason "
                                "(stop, length, abort, error)", ["finished_reason"], registry=r)

    # EngineObserver (called on the engine thread). Gauges and counters are read at scrape
    # time by EngineCollector, so on_step has nothing to record.
    def on_step(self, engine: LLMEngine, num_scheduled: int, preempted: int) -> None:
        return None

    def on_first_scheduled(self, request_id: str, queue_time_s: float) -> None:
        self.queue_time.observe(queue_time_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, start: float) -> SequenceTimer:
        return SequenceTimer(self, start)


class SequenceTimer:
    """Latencies of one generated sequence, seen from the handler (time.monotonic)."""

    __slots__ = ("_done", "_last", "_m", "_start")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self._m, self._start, self._last, self._done = metrics, start, None, False

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.observe(now - self._start)
        else:
            gap = (now - self._last) / num_tokens
            for _ in range(num_tokens):
                self._m.itl.observe(gap)
        self._last = now

    def finish(self, reason: str) -> None:
        if not self._done:
            self._done = True
            self._m.e2e.observe(time.monotonic() - self._start)
            self._m.finished.labels(reason).inc()
