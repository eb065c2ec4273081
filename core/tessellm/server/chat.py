"""POST /v1/chat/completions.

The prompt is the chat template (the tokenizer's, or the server's --chat-template file)
rendered with the generation prompt; a model without one gets a 400 saying how to fix it.
Streaming follows OpenAI's chunk order per choice: a role chunk, content chunks, then a chunk
with an empty delta and the finish_reason.
Tools (tools.tool_plan): with tools offered, each choice's text goes through its tool-call
format's parser (tools.call_format): text outside calls is `content`, calls are `tool_calls`
(ids `call_...`); streamed, a call's first chunk carries its index, id and name and later
chunks its arguments' JSON text, piece by piece. A choice whose output held complete calls and
stopped normally finishes with "tool_calls"; one cut off inside a call keeps its complete
calls (the unfinished one is dropped; with none complete, the text is the content) and its
"length".
"""
from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from tessellm.engine.output_processor import StreamDelta
from tessellm.server.generation import ChoiceResult, respond
from tessellm.server.logprobs import TokenTexts, chat_logprobs
from tessellm.server.params import check_limits, resolve_max_tokens, sampling_params
from tessellm.server.protocol import ChatCompletionRequest
from tessellm.server.requests import read_body, request_context
from tessellm.server.structured import structured_outputs_of
from tessellm.tools.call_format import ArgumentsDelta, CallStarted, ContentDelta, ToolCall
from tessellm.tools.tool_plan import plan_tools


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


class ChatShape:
    """The JSON of chat.completion answers and chat.completion.chunk events; `tool_format`:
    the tool-call format to parse each choice with (None: plain content)."""

    def __init__(self, request_id: str, model: str, texts: TokenTexts, logprobs: bool,
                 include_usage: bool, tool_format: Any = None) -> None:
        self._created = int(time.time())
        self._id, self._model = request_id, model
        self._texts = texts
        self._logprobs = logprobs
        self._usage_field = include_usage
        self._format = tool_format
        self._streams: dict[int, Any] = {}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self._id, "object": "chat.completion.chunk", "created": self._created,
                 "model": self._model, "choices": choices}
        if self._usage_field:
            chunk["usage"] = None
        return chunk

    def _lp(self, entries: list[Any]) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        return {"content": chat_logprobs(self._texts, entries), "refusal": None}

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for k in range(num_choices)]

    def _deltas(self, index: int, delta: StreamDelta) -> list[dict[str, Any]]:
        """The message deltas of one engine delta: its text, or its tool-call events."""
        if self._format is None:
            return [{"content": delta.text}] if delta.text else []
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._format.stream()
        events = stream.feed(delta.text) if delta.text else []
        if delta.finished:
            events += stream.finish()
        out = []
        for e in events:
            if isinstance(e, ContentDelta):
                out.append({"content": e.text})
            elif isinstance(e, CallStarted):
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ArgumentsDelta):
                out.append({"tool_calls": [{"index": e.index,
                                            "function": {"arguments": e.text}}]})
        return out

    def delta_chunks(self, index: int, delta: StreamDelta) -> list[dict[str, Any]]:
        chunks = []
        deltas = self._deltas(index, delta)
        if not deltas and self._logprobs and delta.logprobs:
            deltas = [{"content": ""}]
        for k, d in enumerate(deltas):
            chunks.append(self._chunk([{"index": index, "delta": d,
                                        "logprobs": self._lp(delta.logprobs) if k == 0
                                        else None, "finish_reason": None}]))
        if delta.finished:
            stream = self._streams.get(index)
            has_calls = stream is not None and bool(stream.calls) and not stream.incomplete
            chunks.append(self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                        "finish_reason": _finish_reason(delta.finish_reason,
                                                                        has_calls)}]))
        return chunks

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self._id, "object": "chat.completion.chunk", "created": self._created,
                "model": self._model, "choices": [], "usage": usage}

    def _message(self, r: ChoiceResult) -> tuple[dict[str, Any], str | None]:
        if self._format is None:
            return {"role": "assistant", "content": r.text}, r.finish_reason
        parsed = self._format.parse_calls(r.text)
        if not parsed.calls:
            return {"role": "assistant", "content": r.text}, r.finish_reason
        message = {"role": "assistant", "content": parsed.content,
                   "tool_calls": [_tool_call(c) for c in parsed.calls]}
        return message, _finish_reason(r.finish_reason, parsed.complete)

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for r in results:
            message, finish_reason = self._message(r)
            choices.append({"index": r.index, "message": message,
                            "logprobs": self._lp(r.logprobs), "finish_reason": finish_reason})
        return {"id": self._id, "object": "chat.completion", "created": self._created,
                "model": self._model, "choices": choices, "usage": usage}


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state, request_id, start = request_context(request)
    req = await read_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    check_limits(req, state.config)
    renders_tools, tool_format = await state.tool_setup() if req.tools else (False, None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") \
        else req.tool_choice
    plan = plan_tools(req.template_messages(), tools, choice, req.parallel_tool_calls,
                      renders_tools, tool_format, state.tokenizer)
    constraint, param = structured_outputs_of(req, plan.forced)
    if constraint is not None:
        await state.check_constraint(constraint, param)
    ids = await state.encode_chat(plan.messages, plan.template_tools)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(req.requested_max_tokens, len(ids), state.max_model_len,
                                    param)
    params = sampling_params(req, max_tokens, req.num_logprobs, 0, constraint)
    streams = state.submit(request_id, [(ids, params, req.n)], req.stop_strings, req.priority,
                           req.model)
    shape = ChatShape(request_id, state.response_model(req.model), state.texts, req.logprobs,
                      req.stream and req.include_usage, plan.format)
    return await respond(request, state, request_id, streams, shape, stream=req.stream,
                         include_usage=req.include_usage, num_prompt_tokens=len(ids),
                         start=start, params=params, n=req.n)
