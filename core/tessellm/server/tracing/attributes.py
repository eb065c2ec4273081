"""Span attribute names: OpenTelemetry's gen_ai semantic conventions where they exist, and
the `gen_ai.*` names vLLM adds (vllm/tracing SpanAttributes), so one dashboard reads both."""
from __future__ import annotations

SPAN_NAME = "llm_request"

RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
REQUEST_ID = "gen_ai.request.id"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_N = "gen_ai.request.n"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
