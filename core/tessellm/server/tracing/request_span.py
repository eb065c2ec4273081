"""One span per request, written when the request is over, from timings the server keeps.

Timings, all time.monotonic() of the front end (the core stamps queue time against the
arrival the front end sent, on the same clock):

    arrival ──queue──> first schedule ──prefill──> first token ──decode──> last token
    │<────────────── time_to_first_token ─────────>│                           │
    │<──────────────────────────────── e2e (until the span ends) ─────────────>│

`arrival` is when the request reached the server (before validation and tokenization);
queue time is the engine's (admission to first schedule, RequestStream.queue_time_s), so
time_to_first_token >= time_in_queue + time_in_model_prefill. With n > 1 or several prompts
the first schedule and first token are the earliest of any sequence, the last token the
latest, tokens the sum. A latency that never happened (no token) is left out. The span
starts at arrival, ends when the request's last message is sent, is a SERVER span named
`llm_request` and is a child of the W3C `traceparent` the client sent (an HTTP header or gRPC
metadata), else a root span. A sequence that failed (finish "error") sets status ERROR.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tessellm.engine.async_engine import RequestStream
from tessellm.sampling_params import SamplingParams
from tessellm.server.metrics import SequenceTimer
from tessellm.server.tracing import attributes as a

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracer:
    """Writes request spans through `provider` (its exporter decides where they go)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("tessellm.server")

    def record(self, model: str, request_id: str, arrival: float,
               carrier: Mapping[str, str], params: SamplingParams, n: int,
               streams: Sequence[RequestStream], timers: Sequence[SequenceTimer],
               num_prompt_tokens: int) -> None:
        """The span of one finished request (see the module's docstring)."""
        now, now_ns = time.monotonic(), time.time_ns()
        span = self._tracer.start_span(
            a.SPAN_NAME, context=_PROPAGATOR.extract(carrier), kind=SpanKind.SERVER,
            start_time=now_ns - int((now - arrival) * 1e9))
        span.set_attributes(_attributes(model, request_id, arrival, now, params, n, streams,
                                        timers, num_prompt_tokens))
        if any(t.reason == "error" for t in timers):
            span.set_status(Status(StatusCode.ERROR, "a sequence failed"))
        span.end(end_time=now_ns)

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()


def _attributes(model: str, request_id: str, arrival: float, now: float,
                params: SamplingParams, n: int, streams: Sequence[RequestStream],
                timers: Sequence[SequenceTimer], num_prompt_tokens: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        a.RESPONSE_MODEL: model, a.REQUEST_ID: request_id,
        a.REQUEST_TEMPERATURE: params.temperature, a.REQUEST_TOP_P: params.top_p,
        a.REQUEST_MAX_TOKENS: params.max_tokens, a.REQUEST_N: n,
        a.USAGE_PROMPT_TOKENS: num_prompt_tokens,
        a.USAGE_COMPLETION_TOKENS: sum(t.num_tokens for t in timers),
        a.USAGE_NUM_SEQUENCES: len(streams),
        a.RESPONSE_FINISH_REASONS: [t.reason or "abort" for t in timers],
        a.LATENCY_E2E: now - arrival}
    scheduled = [(s.added_at + s.queue_time_s, s.queue_time_s) for s in streams
                 if s.queue_time_s is not None]
    first_tokens = [t.first_token_at for t in timers if t.first_token_at is not None]
    last_tokens = [t.last_token_at for t in timers if t.last_token_at is not None]
    if scheduled:
        attrs[a.LATENCY_TIME_IN_QUEUE] = min(q for _, q in scheduled)
    if first_tokens:
        first = min(first_tokens)
        last = max(last_tokens)
        attrs[a.LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
        attrs[a.LATENCY_TIME_IN_MODEL_DECODE] = last - first
        if scheduled:
            start = min(at for at, _ in scheduled)
            attrs[a.LATENCY_TIME_IN_MODEL_PREFILL] = max(0.0, first - start)
            attrs[a.LATENCY_TIME_IN_MODEL_INFERENCE] = max(0.0, last - start)
    return attrs
