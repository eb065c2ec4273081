"""Driving the engine streams of one request into an HTTP answer, whole or as SSE.

The endpoint-specific JSON lives in a ResponseShape (completions.py, chat.py); the loops here
are shared. A sequence that finishes with "error" (a failed engine step) or "abort" (server
shutdown) fails the whole request: 500 / 503 before anything was sent, an SSE error event
then [DONE] after. Leaving early for any reason aborts the other sequences (streams.merged).
With `request_timeout_s` (ServerConfig), a request unfinished after that long is aborted and
answered 504, or ends its stream with an error event.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from tessellm.engine.async_engine import RequestStream
from tessellm.engine.output_processor import StreamDelta
from tessellm.sampling_params import SamplingParams
from tessellm.server.errors import APIError
from tessellm.server.requests import echo_id
from tessellm.server.sse import SSEWriter
from tessellm.server.state import ServerState
from tessellm.server.streams import merged

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceResult:
    """One sequence's whole output (non-streaming answers)."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    prompt_logprobs: list[Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, delta: StreamDelta) -> None:
        self.text_parts.append(delta.text)
        self.logprobs.extend(delta.logprobs or ())
        self.num_output_tokens = max(self.num_output_tokens, delta.num_output_tokens)
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason


class ResponseShape(Protocol):
    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]: ...

    def delta_chunks(self, index: int, delta: StreamDelta) -> list[dict[str, Any]]: ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]: ...

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]: ...


def timer_reason(delta: StreamDelta) -> str:
    return "error" if delta.finish_reason == "rejected" else delta.finish_reason or "stop"


def usage_of(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


FAILED = ("error", "abort", "rejected")   # finish reasons that fail the whole request


def failure(delta: StreamDelta) -> APIError:
    if delta.finish_reason == "rejected":   # the engine core refused it at admission
        return APIError(400, delta.error or "the engine refused the request")
    if delta.finish_reason == "abort":
        return APIError(503, "the request was aborted: the server is shutting down", code=503,
                        type="service_unavailable")
    return APIError(500, f"the engine failed while generating this request "
                    f"({delta.error or 'unknown error'}); other requests are unaffected",
                    code=500, type="server_error")


def timed_out(timeout_s: float) -> APIError:
    return APIError(504, f"the request did not finish within the server's request timeout "
                    f"({timeout_s:g} s); it was aborted", code="request_timeout")


async def respond(request: web.Request, state: ServerState, request_id: str,
                  streams: list[RequestStream], shape: ResponseShape, *, stream: bool,
                  include_usage: bool, num_prompt_tokens: int, start: float,
                  params: SamplingParams, n: int) -> web.StreamResponse:
    """Answer the request from its engine streams; `params` (choice 0's) and `n` go to the
    request's trace span (tracing.request_span) when the server traces."""
    timers = [state.metrics.timer(start) for _ in streams]
    timeout_s = state.config.request_timeout_s
    try:
        if stream:
            return await _stream(request, request_id, streams, shape, timers, include_usage,
                                 num_prompt_tokens, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                return await _whole(request_id, streams, shape, timers, num_prompt_tokens)
        except TimeoutError:
            raise timed_out(timeout_s) from None
    finally:  # whatever happened (even before the streams were read), nothing is left running
        for s in streams:
            s.abort()
        for t in timers:  # sequences left before their end were aborted
            t.finish("abort")
        if state.tracer is not None:
            state.tracer.record(state.model_name, request_id, start, request.headers, params,
                                n, streams, timers, num_prompt_tokens)


async def _whole(request_id: str, streams: list[RequestStream], shape: ResponseShape,
                 timers: list, num_prompt_tokens: int) -> web.Response:
    results = [ChoiceResult(k) for k in range(len(streams))]
    async with merged(streams) as deltas:
        async for k, d in deltas:
            timers[k].on_tokens(len(d.token_ids))
            results[k].add(d)
            if d.finished:
                timers[k].finish(timer_reason(d))
                if d.finish_reason in FAILED:
                    log.error("[%s] sequence %d failed: %s", request_id, k, d.error)
                    raise failure(d)
    usage = usage_of(num_prompt_tokens, sum(r.num_output_tokens for r in results))
    return web.json_response(shape.response(results, usage))  # the middleware adds the id


async def _stream(request: web.Request, request_id: str, streams: list[RequestStream],
                  shape: ResponseShape, timers: list, include_usage: bool,
                  num_prompt_tokens: int, timeout_s: float | None) -> web.StreamResponse:
    writer = SSEWriter(request, echo_id(request))
    outputs = [0] * len(streams)
    try:
        await writer.start()
        for chunk in shape.first_chunks(len(streams)):
            await writer.send(chunk)
        try:
            async with asyncio.timeout(timeout_s), merged(streams) as deltas:
                async for k, d in deltas:
                    timers[k].on_tokens(len(d.token_ids))
                    outputs[k] = max(outputs[k], d.num_output_tokens)
                    if d.finished:
                        timers[k].finish(timer_reason(d))
                        if d.finish_reason in FAILED:
                            log.error("[%s] sequence %d failed: %s", request_id, k, d.error)
                            await writer.send(failure(d).body())
                            await writer.done()
                            return writer.response
                    for chunk in shape.delta_chunks(k, d):
                        await writer.send(chunk)
        except TimeoutError:
            log.info("[%s] request timeout (%g s); aborted", request_id, timeout_s)
            await writer.send(timed_out(timeout_s or 0.0).body())
            await writer.done()
            return writer.response
        if include_usage:
            await writer.send(shape.usage_chunk(usage_of(num_prompt_tokens, sum(outputs))))
        await writer.done()
    except ConnectionResetError:
        log.info("[%s] client disconnected; request aborted", request_id)
    return writer.response
