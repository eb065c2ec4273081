"""POST /v1/completions.

Choices are indexed prompt-major: choice k = prompt_index * n + i. Usage counts each prompt
once and every choice's generated tokens. `echo`: each choice's text starts with its prompt
(a streamed choice sends it in its first chunk).
"""
from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from tessellm.engine.output_processor import StreamDelta
from tessellm.server.errors import bad_request
from tessellm.server.generation import ChoiceResult, respond
from tessellm.server.logprobs import CompletionLogprobs, TokenTexts
from tessellm.server.params import check_limits, resolve_max_tokens, sampling_params
from tessellm.server.protocol import CompletionRequest
from tessellm.server.requests import read_body, request_context
from tessellm.server.structured import structured_outputs_of


class CompletionShape:
    """The JSON of text_completion answers and chunks for one request."""

    def __init__(self, request_id: str, model: str, texts: TokenTexts, logprobs: bool,
                 include_usage: bool, echo: list[str] | None = None) -> None:
        self._base = {"id": request_id, "object": "text_completion",
                      "created": int(time.time()), "model": model}
        self._texts = texts
        self._logprobs = logprobs
        self._usage_field = include_usage
        self._echo = echo   # per choice: its prompt's text
        self._builders: dict[int, CompletionLogprobs] = {}

    def _lp(self, index: int, entries: list[Any]) -> dict[str, list] | None:
        if not self._logprobs:
            return None
        builder = self._builders.setdefault(index, CompletionLogprobs(self._texts))
        return builder.build(entries)

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        if self._echo is None:
            return []
        return [self._chunk({"index": k, "text": self._echo[k], "logprobs": None,
                             "finish_reason": None}) for k in range(num_choices)]

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._base, "choices": [choice]}
        if self._usage_field:
            chunk["usage"] = None
        return chunk

    def delta_chunks(self, index: int, delta: StreamDelta) -> list[dict[str, Any]]:
        if not delta.text and not delta.finished and not (self._logprobs and delta.logprobs):
            return []
        return [self._chunk({"index": index, "text": delta.text,
                             "logprobs": self._lp(index, delta.logprobs),
                             "finish_reason": delta.finish_reason if delta.finished else None})]

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._base, "choices": [], "usage": usage}

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": r.index,
                    "text": r.text if self._echo is None else self._echo[r.index] + r.text,
                    "logprobs": self._lp(r.index, r.logprobs),
                    "finish_reason": r.finish_reason} for r in results]
        return {**self._base, "choices": choices, "usage": usage}


async def create_completion(request: web.Request) -> web.StreamResponse:
    state, request_id, start = request_context(request)
    req = await read_body(request, CompletionRequest)
    state.check_model(req.model)
    prompts = req.prompts
    check_limits(req, state.config, len(prompts))
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported yet", "echo")
    constraint, param = structured_outputs_of(req)
    if constraint is not None:
        await state.check_constraint(constraint, param)
    token_lists: list[list[int]] = []
    for p in prompts:
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        token_lists.append(await state.encode(p) if isinstance(p, str) else list(p))
    groups = []
    for ids in token_lists:
        max_tokens = resolve_max_tokens(req.max_tokens, len(ids), state.max_model_len)
        groups.append((ids, sampling_params(req, max_tokens, req.logprobs, 0, constraint),
                       req.n))
    echo = None
    if req.echo:
        texts = [p if isinstance(p, str) else await state.decode(p) for p in prompts]
        echo = [texts[k // req.n] for k in range(len(prompts) * req.n)]
    streams = state.submit(request_id, groups, req.stop_strings, req.priority)
    shape = CompletionShape(request_id, state.model_name, state.texts, req.logprobs is not None,
                            req.stream and req.include_usage, echo)
    return await respond(request, state, request_id, streams, shape, stream=req.stream,
                         include_usage=req.include_usage,
                         num_prompt_tokens=sum(len(t) for t in token_lists), start=start)
