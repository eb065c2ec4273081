"""POST /v1/chat/completions.

The prompt is the chat template (the tokenizer's, or the server's --chat-template file)
rendered with the generation prompt; a model without one gets a 400 saying how to fix it.
Streaming follows OpenAI's chunk order per choice: a role chunk, content chunks, then a chunk
with an empty delta and the finish_reason.
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


class ChatShape:
    """The JSON of chat.completion answers and chat.completion.chunk events."""

    def __init__(self, request_id: str, model: str, texts: TokenTexts, logprobs: bool,
                 include_usage: bool) -> None:
        self._created = int(time.time())
        self._id, self._model = request_id, model
        self._texts = texts
        self._logprobs = logprobs
        self._usage_field = include_usage

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

    def delta_chunks(self, index: int, delta: StreamDelta) -> list[dict[str, Any]]:
        chunks = []
        if delta.text or (self._logprobs and delta.logprobs):
            chunks.append(self._chunk([{"index": index, "delta": {"content": delta.text},
                                        "logprobs": self._lp(delta.logprobs),
                                        "finish_reason": None}]))
        if delta.finished:
            chunks.append(self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                        "finish_reason": delta.finish_reason}]))
        return chunks

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self._id, "object": "chat.completion.chunk", "created": self._created,
                "model": self._model, "choices": [], "usage": usage}

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": r.index,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": self._lp(r.logprobs),
                    "finish_reason": r.finish_reason} for r in results]
        return {"id": self._id, "object": "chat.completion", "created": self._created,
                "model": self._model, "choices": choices, "usage": usage}


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state, request_id, start = request_context(request)
    req = await read_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    check_limits(req, state.config)
    ids = await state.encode_chat(req.template_messages())
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(req.requested_max_tokens, len(ids), state.max_model_len,
                                    param)
    groups = [(ids, sampling_params(req, max_tokens, req.num_logprobs, 0), req.n)]
    streams = state.submit(request_id, groups, req.stop_strings, req.priority)
    shape = ChatShape(request_id, state.model_name, state.texts, req.logprobs,
                      req.stream and req.include_usage)
    return await respond(request, state, request_id, streams, shape, stream=req.stream,
                         include_usage=req.include_usage, num_prompt_tokens=len(ids),
                         start=start)
