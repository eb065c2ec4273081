"""One OpenTelemetry span per request (InMemorySpanExporter), with vLLM's gen_ai.*
attributes, parented from the client's `traceparent`: HTTP (whole and streamed) and gRPC, on
the app in-process over an engine core on a thread."""
from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tessellm import LLM
from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.core_client import EngineCoreClient
from tessellm.errors import ConfigError
from tessellm.models.source import ModelSource
from tessellm.server.app import create_app
from tessellm.server.grpc import tessellm_pb2 as pb
from tessellm.server.grpc.client import TessellmStub
from tessellm.server.grpc.runner import GrpcRunner
from tessellm.server.server_config import ServerConfig
from tessellm.server.state import ServerState
from tessellm.server.tracing import attributes as a
from tessellm.server.tracing.request_span import RequestTracer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PROMPT = "Once upon a time"


def _check_span(span, *, parented: bool, max_tokens: int, temperature: float, top_p: float,
                prompt_tokens: int) -> None:
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    if parented:
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_ID and span.parent.is_remote
    else:
        assert span.parent is None
    attrs = span.attributes
    assert attrs[a.RESPONSE_MODEL] == "stories260K-hf"
    assert attrs[a.REQUEST_ID].startswith("cmpl-")
    assert (attrs[a.REQUEST_TEMPERATURE], attrs[a.REQUEST_TOP_P],
            attrs[a.REQUEST_MAX_TOKENS], attrs[a.REQUEST_N]) == (temperature, top_p,
                                                                 max_tokens, 1)
    assert attrs[a.USAGE_PROMPT_TOKENS] == prompt_tokens
    assert attrs[a.USAGE_COMPLETION_TOKENS] == max_tokens
    assert tuple(attrs[a.RESPONSE_FINISH_REASONS]) == ("length",)
    queue, ttft, e2e = (attrs[a.LATENCY_TIME_IN_QUEUE], attrs[a.LATENCY_TIME_TO_FIRST_TOKEN],
                        attrs[a.LATENCY_E2E])
    prefill, decode = attrs[a.LATENCY_TIME_IN_MODEL_PREFILL], attrs[a.LATENCY_TIME_IN_MODEL_DECODE]
    assert 0 <= queue < ttft <= e2e and prefill > 0 and decode > 0
    assert queue + prefill <= ttft + 1e-3 and ttft + decode <= e2e + 1e-3
    assert attrs[a.LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(prefill + decode)
    assert span.end_time - span.start_time == pytest.approx(e2e * 1e9, rel=0.05, abs=2e6)
    assert span.status.status_code != StatusCode.ERROR


def test_one_span_per_request_parented_from_traceparent(stories_dir):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def run() -> None:
        llm = LLM(str(stories_dir), dtype="float32", kernel_selection="first",
                  load_progress=False, max_num_batched_tokens=64, max_num_seqs=4)
        core = EngineCoreClient.in_thread(llm.engine)
        await core.wait_ready()
        engine = AsyncEngine(core, llm.tokenizer)
        source = ModelSource("hf_dir", stories_dir, "stories260K-hf")
        state = ServerState.build(engine, llm.tokenizer, ServerConfig(), source, None)
        state.tracer = RequestTracer(provider)
        prompt_tokens = len(llm.encode(PROMPT))
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.5, "top_p": 0.9,
                "ignore_eos": True}
        async with TestClient(TestServer(create_app(state))) as client:
            resp = await client.post("/v1/completions", json=body,
                                     headers={"traceparent": TRACEPARENT})
            assert resp.status == 200
            (span,) = exporter.get_finished_spans()
            _check_span(span, parented=True, max_tokens=6, temperature=0.5, top_p=0.9,
                        prompt_tokens=prompt_tokens)
            assert span.attributes[a.REQUEST_ID] == (await resp.json())["id"]
            exporter.clear()
            resp = await client.post("/v1/completions", json={**body, "stream": True})
            await resp.read()
            (span,) = exporter.get_finished_spans()   # no traceparent: a root span
            _check_span(span, parented=False, max_tokens=6, temperature=0.5, top_p=0.9,
                        prompt_tokens=prompt_tokens)
            exporter.clear()
            resp = await client.post("/v1/completions", json={**body, "max_tokens": 0})
            assert resp.status == 400 and not exporter.get_finished_spans()  # never admitted

            runner = GrpcRunner(state, "127.0.0.1", 0)
            await runner.start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{runner.port}") as channel:
                stub = TessellmStub(channel)
                call = stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=5,
                                                        temperature=0.5, top_p=0.9,
                                                        ignore_eos=True),
                                     metadata=(("traceparent", TRACEPARENT),))
                messages = [m async for m in call]
            await runner.stop(1.0)
            (span,) = exporter.get_finished_spans()
            _check_span(span, parented=True, max_tokens=5, temperature=0.5, top_p=0.9,
                        prompt_tokens=prompt_tokens)
            assert span.attributes[a.REQUEST_ID] == messages[0].request_id

    asyncio.run(run())


def test_a_missing_opentelemetry_is_a_start_up_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        None)
    from tessellm.config import EngineConfig
    from tessellm.server.serve import serve
    from tessellm.server.tracing.setup import load_tracer
    with pytest.raises(ConfigError, match=r"tessellm\[otel\]"):
        load_tracer("http://127.0.0.1:4318/v1/traces")
    with pytest.raises(ConfigError, match=r"--otlp-traces-endpoint needs OpenTelemetry"):
        asyncio.run(serve(EngineConfig(), None, None,   # before any engine core is spawned
                          ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318")))


def test_the_otlp_tracer_builds(monkeypatch):
    from tessellm.server.tracing.setup import load_tracer
    tracer = load_tracer("http://127.0.0.1:9/v1/traces")
    tracer.shutdown()   # nothing buffered: returns at once
