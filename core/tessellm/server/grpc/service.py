"""The four methods of tessellm.v1.Tessellm over one ServerState, and their handler table.

Generate is POST /v1/completions with `stream: true` over gRPC: the same validation
(messages.completion_request, completions.completion_groups), the same admission
(ServerState.submit), the same metrics (SequenceTimer) and the same failures, answered as
gRPC statuses (status.grpc_code). Order of checks as HTTP's: the API key (401), draining (503),
then the body (400), the model (404), the engine (503).
A call's handle (`request_id`, default the server's id) names it to Abort while it is in
flight, from registration (before the prompt is encoded) until its last message. Abort
expires the call's wait for its next delta (the timeout scope request_timeout_s also sets),
so the loop leaves the engine streams where it stands (merged() aborts them: their KV blocks
are freed) and every unfinished choice ends with finish_reason "abort"; the call itself ends
OK with its usage.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from tessellm.engine.async_engine import RequestStream
from tessellm.engine.output_processor import StreamDelta
from tessellm.sampling_params import SamplingParams
from tessellm.server.completions import completion_groups
from tessellm.server.errors import APIError, bad_request, from_exception, internal_error
from tessellm.server.generation import FAILED, failure, timed_out, timer_reason, usage_of
from tessellm.server.grpc import tessellm_pb2 as pb
from tessellm.server.grpc.messages import (SERVICE, completion_request, delta_response,
                                           message_class, usage_response)
from tessellm.server.grpc.status import check_api_key, grpc_code, trailing_metadata
from tessellm.server.requests import arrival_now, client_request_id, new_request_id
from tessellm.server.service_info import draining_error, health_error, model_cards
from tessellm.server.state import ServerState
from tessellm.server.streams import merged

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext


@dataclass(slots=True)
class _Call:
    """A Generate call in flight. `scope` is set only while it waits for the next delta, so
    an Abort interrupts that wait and never a write to the client (a write cut short would
    leave the call unusable)."""

    request_id: str   # the server's (the engine's) id
    scope: asyncio.Timeout | None = None
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        if self.scope is not None:
            self.scope.reschedule(asyncio.get_running_loop().time())

    async def next_delta(self, deltas: AsyncIterator[tuple[int, StreamDelta]],
                         deadline: float | None) -> tuple[int, StreamDelta] | None:
        """The next (choice, delta), None at the end; TimeoutError past `deadline` (the
        loop's clock) or on abort."""
        try:
            async with asyncio.timeout_at(deadline) as scope:
                self.scope = scope
                return await anext(deltas)
        except StopAsyncIteration:
            return None
        finally:
            self.scope = None


class TessellmService:
    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._calls: dict[str, _Call] = {}   # Generate calls in flight, by handle

    async def _fail(self, context: Context, exc: Exception, method: str) -> None:
        """Answer `exc` as the HTTP server would, as a gRPC status (raises AbortError)."""
        err = from_exception(exc)
        if err is None:
            log.exception("unhandled error in gRPC %s", method)
            err = internal_error()
        elif err.status >= 500:
            log.error("gRPC %s -> %d: %s", method, err.status, err.message)
        await context.abort(grpc_code(err.status), err.message, trailing_metadata(err))

    def _authorize(self, context: Context) -> None:
        check_api_key(self._state.config, context.invocation_metadata() or ())

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> None:
        state, start, request_id = self._state, arrival_now(), new_request_id()
        handle, call = request_id, _Call(request_id)
        try:
            self._authorize(context)
            draining = draining_error(state)
            if draining is not None:
                raise draining
            handle = client_request_id(request.request_id or None, "request_id") or request_id
            if handle in self._calls:
                raise bad_request(f"request_id {handle!r} is already in flight", "request_id")
        except Exception as exc:
            await self._fail(context, exc, "Generate")
        self._calls[handle] = call
        try:
            req = completion_request(request)
            token_lists, groups = await completion_groups(state, req)
            streams = state.submit(request_id, groups, req.stop_strings, req.priority,
                                   req.model)
            num_prompt_tokens = sum(len(t) for t in token_lists)
            await self._stream(context, handle, call, streams, start, num_prompt_tokens,
                               groups[0][1], req.n)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await self._fail(context, exc, "Generate")
        finally:
            del self._calls[handle]

    async def _stream(self, context: Context, handle: str, call: _Call,
                      streams: list[RequestStream], start: float, num_prompt_tokens: int,
                      params: SamplingParams, n: int) -> None:
        state = self._state
        timers = [self._state.metrics.timer(start) for _ in streams]
        outputs, done = [0] * len(streams), [False] * len(streams)
        timeout_s = self._state.config.request_timeout_s
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        try:
            async with merged(streams) as deltas:
                while not call.aborted:
                    item = await call.next_delta(deltas, deadline)
                    if item is None:
                        break
                    k, d = item
                    timers[k].on_tokens(len(d.token_ids))
                    outputs[k] = max(outputs[k], d.num_output_tokens)
                    if d.finished:
                        timers[k].finish(timer_reason(d))
                        done[k] = True
                        if d.finish_reason in FAILED:
                            raise failure(d)
                    if d.text or d.token_ids or d.finished:
                        await context.write(delta_response(handle, k, d))
        except TimeoutError:
            if not call.aborted:
                raise timed_out(timeout_s or 0.0) from None
        finally:
            for s in streams:
                s.abort()
            for t in timers:   # sequences left before their end were aborted
                t.finish("abort")
            if state.tracer is not None:   # parented from the `traceparent` metadata
                state.tracer.record(state.model_name, call.request_id, start,
                                    dict(context.invocation_metadata() or ()), params, n,
                                    streams, timers, num_prompt_tokens)
        for k in (k for k in range(len(streams)) if not done[k]):   # aborted ones
            await context.write(pb.GenerateResponse(request_id=handle, index=k,
                                                    finish_reason="abort"))
        await context.write(usage_response(handle, usage_of(num_prompt_tokens, sum(outputs))))

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        try:
            self._authorize(context)
            call = self._calls.get(request.request_id)
            if call is None:
                raise APIError(404, f"no Generate call with request_id {request.request_id!r} "
                               "is in flight", param="request_id")
        except Exception as exc:
            await self._fail(context, exc, "Abort")
        call.abort()
        return pb.AbortResponse()

    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        """No key needed, as GET /health (a load balancer's probe)."""
        error = health_error(self._state)
        if error is not None:
            await self._fail(context, error, "Health")
        return pb.HealthResponse(status="ok")

    async def Models(self, request: pb.ModelsRequest, context: Context) -> pb.ModelsResponse:
        try:
            self._authorize(context)
        except Exception as exc:
            await self._fail(context, exc, "Models")
        fields = ("id", "created", "owned_by", "max_model_len")
        return pb.ModelsResponse(data=[pb.Model(**{f: card[f] for f in fields})
                                       for card in model_cards(self._state)])


def generic_handler(service: TessellmService) -> grpc.GenericRpcHandler:
    """The handler table of `service`, read off the proto's service descriptor (a method
    named there is looked up on the service by the same name)."""
    handlers = {}
    for method in SERVICE.methods:
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=message_class(method, output=False).FromString,
            response_serializer=message_class(method, output=True).SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
