"""Prometheus metrics of one server (names prefixed `tessellm:`), in the app's own registry.

Two sources, so that nothing goes stale between engine steps:
- engine state is read at scrape time by EngineCollector from the latest CoreStats the engine
  core sent (after every step, and every 0.25 s while idle): running/waiting requests, KV cache
  usage, prompt/generation token and preemption counters, prefix-cache queries and hits (in
  tokens, as vLLM's prefix_cache_queries / prefix_cache_hits), cumulative seconds per engine
  stage, plus the front end's own: engine-core liveness, IPC seconds, detokenize seconds;
- request latencies are observed as they happen: queue time reported by the core (the
  EngineObserver hook), TTFT, inter-token latency and end-to-end latency from the handlers;
  TTFT and TPOT (a sequence's mean time per output token after its first) also go to
  time-windowed samples (RecentLatencies) for the dashboard's percentiles.
No module-level state: two apps in one process have two registries.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessellm.engine.async_engine import AsyncEngine
from tessellm.server.latency_window import RecentLatencies
from tessellm.speculative.stats import SpecStats

FINISH_REASONS = ("stop", "length", "abort", "error")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                         0.5, 1.0, 2.5)


class EngineCollector(Collector):
    """Reads the engine core's latest report at every scrape (the event loop's own copy).
    Behind a replica set (tessellm.ray) every per-engine series carries a `replica` label,
    one sample per replica; a single engine's series have no label."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self._async = async_engine

    def collect(self) -> Iterator[Metric]:
        members = self._async.members
        labelled = any(name for name, _ in members)
        labels = ["replica"] if labelled else []

        def family(kind, name: str, doc: str, value, extra: tuple[str, ...] = ()
                   ) -> Metric:   # noqa: ANN001 (a metric family class; value: engine ->)
            metric = kind(name, doc, labels=labels + list(extra))
            for replica, e in members:
                for keys, v in value(e):
                    metric.add_metric(([replica] if labelled else []) + list(keys), v)
            return metric

        def one(fn):   # noqa: ANN001, ANN202 (engine -> number) as one unlabelled sample
            return lambda e: [((), fn(e))]

        gauges = (
            ("tessellm:num_requests_running", "Requests in the running batch",
             lambda e: e.stats.num_running),
            ("tessellm:num_requests_waiting", "Requests accepted and not yet running",
             lambda e: e.num_waiting),
            ("tessellm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)",
             lambda e: e.stats.kv_usage),
            ("tessellm:model_weight_bytes", "Bytes of model weights on the device (packed "
             "ones as stored)", lambda e: e.info.weight_bytes),
            ("tessellm:engine_core_alive", "1 while the engine core process runs, else 0",
             lambda e: int(e.is_alive)),
            ("tessellm:engine_core_responsive", "1 while the engine core reports within the "
             "heartbeat timeout (and its step is not stalled), else 0",
             lambda e: int(e.is_alive and e.unresponsive_reason is None)),
            ("tessellm:engine_core_last_report_age_seconds", "Seconds since the engine "
             "core's latest message", lambda e: time.monotonic() - e.last_heard),
            ("tessellm:engine_core_step_age_seconds", "Seconds the engine core's current "
             "step has run (0: none)", lambda e: e.liveness.step_age_s))
        counters = (
            ("tessellm:prompt_tokens", "Prompt tokens computed",
             lambda e: e.stats.num_prompt_tokens),
            ("tessellm:generation_tokens", "Tokens generated",
             lambda e: e.stats.num_generated_tokens),
            ("tessellm:num_preemptions", "Requests preempted",
             lambda e: e.stats.num_preemptions),
            ("tessellm:engine_steps", "Engine steps run", lambda e: e.stats.num_steps),
            ("tessellm:engine_overlapped_steps", "Engine steps launched while the previous "
             "one was still on the device (async scheduling)",
             lambda e: e.stats.num_overlapped_steps),
            ("tessellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             lambda e: e.stats.prefix_cache_queries),
            ("tessellm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
             lambda e: e.stats.prefix_cache_hits),
            ("tessellm:host_device_syncs", "Times the engine core's host blocked on the "
             "device (one per sampling step)", lambda e: e.stats.host_syncs),
            ("tessellm:ipc_seconds", "Cumulative seconds from the core sending a message to "
             "the front end reading it", lambda e: e.core.ipc_seconds))
        for name, doc, fn in gauges:
            yield family(GaugeMetricFamily, name, doc, one(fn))
        for name, doc, fn in counters:
            yield family(CounterMetricFamily, name, doc, one(fn))
        yield family(CounterMetricFamily, "tessellm:engine_stage_seconds",
                     "Cumulative seconds per engine stage",
                     lambda e: [((stage,), seconds)
                                for stage, seconds in sorted(e.stats.stage_seconds.items())]
                     + [(("detokenize",), e.detokenize_seconds)], ("stage",))
        totals = self._async.stats   # a replica set's: the sum of its replicas' reports
        yield from spec_metrics(totals)
        yield from lora_metrics(totals)
        yield family(GaugeMetricFamily, "tessellm:device_counter", "The device plugin's own "
                     "counters (xla: xla_compilations, ...)",
                     lambda e: [((name,), value)
                                for name, value in sorted(e.stats.device_counters.items())],
                     ("name",))


def spec_metrics(s) -> Iterator[Metric]:
    """Speculative decoding, per method (vLLM's spec_decode_* counters, plus the acceptance
    rate and mean accepted length they imply); nothing when the engine does not speculate."""
    st = SpecStats.from_wire(s)
    if st is None:
        return
    method = [st.method]
    for name, doc, value in (
            ("spec_decode_num_proposals", "Proposals the proposer made (a request's drafts "
             "for a step)", st.proposals),
            ("spec_decode_num_refused_proposals", "Proposals left out because they would not "
             "pay (measured acceptance and step cost) or did not fit", st.refused_proposals),
            ("spec_decode_num_drafts", "Request-steps verified with drafts", st.verify_steps),
            ("spec_decode_num_draft_tokens", "Draft tokens verified", st.draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", st.accepted_tokens)):
        counter = CounterMetricFamily(f"tessellm:{name}", doc, labels=["method"])
        counter.add_metric(method, value)
        yield counter
    for name, doc, value in (
            ("spec_decode_acceptance_rate", "Accepted / verified draft tokens since start",
             st.acceptance_rate),
            ("spec_decode_mean_accepted_length", "Tokens a verify step gives a request on "
             "average (accepted drafts + 1)", st.mean_accepted_length)):
        gauge = GaugeMetricFamily(f"tessellm:{name}", doc, labels=["method"])
        gauge.add_metric(method, value)
        yield gauge


def lora_metrics(s) -> Iterator[Metric]:
    """Per LoRA adapter: requests, prompt and generated tokens (nothing without LoRA)."""
    if not s.lora_counts:
        return
    for i, (name, doc) in enumerate((
            ("lora_requests", "Requests (samples) admitted with the adapter"),
            ("lora_prompt_tokens", "Prompt tokens of the adapter's requests"),
            ("lora_generation_tokens", "Tokens generated by the adapter's finished requests"))):
        counter = CounterMetricFamily(f"tessellm:{name}", doc, labels=["adapter"])
        for adapter, counts in sorted(s.lora_counts.items()):
            counter.add_metric([adapter], counts[i])
        yield counter


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
        self.recent_ttft = RecentLatencies()
        self.recent_tpot = RecentLatencies()

    # EngineObserver (called on the event loop when the core reports a first schedule).
    def on_first_scheduled(self, request_id: str, queue_time_s: float) -> None:
        self.queue_time.observe(queue_time_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finished_counts(self) -> dict[str, int]:
        """Finished sequences per reason since start (the request_finished counter)."""
        get = self.registry.get_sample_value
        return {reason: int(get("tessellm:request_finished_total",
                                {"finished_reason": reason}) or 0)
                for reason in FINISH_REASONS}

    def timer(self, start: float) -> SequenceTimer:
        return SequenceTimer(self, start)


class SequenceTimer:
    """Latencies of one generated sequence, seen from the handler (time.monotonic)."""

    __slots__ = ("_done", "_first", "_last", "_m", "_reason", "_start", "_tokens")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self._m, self._start, self._done = metrics, start, False
        self._first: float | None = None
        self._last: float | None = None
        self._tokens = 0
        self._reason: str | None = None

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        self._tokens += num_tokens
        if self._last is None:
            self._first = now
            self._m.ttft.observe(now - self._start)
            self._m.recent_ttft.observe(now - self._start, now)
        else:
            gap = (now - self._last) / num_tokens
            for _ in range(num_tokens):
                self._m.itl.observe(gap)
        self._last = now

    @property
    def first_token_at(self) -> float | None:
        return self._first

    @property
    def last_token_at(self) -> float | None:
        return self._last

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def reason(self) -> str | None:
        """The finish reason, once finished."""
        return self._reason

    def finish(self, reason: str) -> None:
        if not self._done:
            self._done = True
            self._reason = reason
            self._m.e2e.observe(time.monotonic() - self._start)
            self._m.finished.labels(reason).inc()
            if self._first is not None and self._last is not None and self._tokens > 1:
                self._m.recent_tpot.observe((self._last - self._first) / (self._tokens - 1))
