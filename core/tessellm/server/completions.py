"""POST /v1/completions.

Choices are indexed prompt-major: choice k = prompt_index * n + i. Usage counts each prompt
once and every choice's generated tokens. `echo`: each choice's text starts with its prompt
(a streamed choice sends it in its first chunk); with `logprobs`, the prompt's tokens come
first in the logprobs too (the first with null logprobs, the others from the engine's prompt
logprobs), and a streamed choice sends the prompt with them once they are computed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tessellm.engine.output_processor import StreamDelta
from tessellm.sampling_params import SamplingParams
from tessellm.server.errors import bad_request
from tessellm.server.generation import ChoiceResult, respond
from tessellm.server.logprobs import CompletionLogprobs, TokenTexts
from tessellm.server.params import check_limits, resolve_max_tokens, sampling_params
from tessellm.server.protocol import CompletionRequest
from tessellm.server.requests import read_body, request_context
from tessellm.server.state import ServerState
from tessellm.server.structured import structured_outputs_of


@dataclass(frozen=True, slots=True)
class _FirstPromptToken:
    """Echo's first prompt token: nothing predicts it (null logprobs, as OpenAI answers)."""

    token_id: int
    logprob: None = None
    top: None = None


class CompletionShape:
    """The JSON of text_completion answers and chunks for one request."""

    def __init__(self, request_id: str, model: str, texts: TokenTexts, logprobs: bool,
                 include_usage: bool, echo: list[str] | None = None,
                 echo_first_tokens: list[int] | None = None) -> None:
        self._base = {"id": request_id, "object": "text_completion",
                      "created": int(time.time()), "model": model}
        self._texts = texts
        self._logprobs = logprobs
        self._usage_field = include_usage
        self._echo = echo   # per choice: its prompt's text
        self._first_tokens = echo_first_tokens   # per choice: its prompt's first token id
        self._builders: dict[int, CompletionLogprobs] = {}

    def _lp(self, index: int, entries: list[Any]) -> dict[str, list] | None:
        if not self._logprobs:
            return None
        builder = self._builders.setdefault(index, CompletionLogprobs(self._texts))
        return builder.build(entries)

    def _prompt_entries(self, index: int, prompt_logprobs: list[Any] | None) -> list[Any]:
        return [_FirstPromptToken(self._first_tokens[index]),  # type: ignore[index]
                *(prompt_logprobs or [])]

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        if self._echo is None or self._logprobs:   # with logprobs: once they are computed
            return []
        return [self._chunk({"index": k, "text": self._echo[k], "logprobs": None,
                             "finish_reason": None}) for k in range(num_choices)]

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._base, "choices": [choice]}
        if self._usage_field:
            chunk["usage"] = None
        return chunk

    def delta_chunks(self, index: int, delta: StreamDelta) -> list[dict[str, Any]]:
        chunks = []
        if self._echo is not None and self._logprobs and delta.prompt_logprobs:
            chunks.append(self._chunk({"index": index, "text": self._echo[index],
                                       "logprobs": self._lp(index, self._prompt_entries(
                                           index, delta.prompt_logprobs)),
                                       "finish_reason": None}))
        if not delta.text and not delta.finished and not (self._logprobs and delta.logprobs):
            return chunks
        return chunks + [self._chunk({"index": index, "text": delta.text,
                             "logprobs": self._lp(index, delta.logprobs),
                             "finish_reason": delta.finish_reason if delta.finished else None})]

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._base, "choices": [], "usage": usage}

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for r in results:
            entries = r.logprobs
            if self._echo is not None and self._logprobs:
                entries = self._prompt_entries(r.index, r.prompt_logprobs) + entries
            choices.append({"index": r.index,
                            "text": r.text if self._echo is None else self._echo[r.index] + r.text,
                            "logprobs": self._lp(r.index, entries),
                            "finish_reason": r.finish_reason})
        return {**self._base, "choices": choices, "usage": usage}


PromptGroup = tuple[list[int], SamplingParams, int]   # token ids, params of choice 0, n


async def completion_groups(state: ServerState, req: CompletionRequest
                            ) -> tuple[list[list[int]], list[PromptGroup]]:
    """The checks of a validated completion request that need the server (model, limits,
    constraint, prompt length), and what ServerState.submit takes: (each prompt's token ids,
    the (token ids, params of choice 0, n) groups). Raises APIError; nothing is submitted.
    The HTTP endpoint and the gRPC Generate both go through here."""
    state.check_model(req.model)
    prompts = req.prompts
    check_limits(req, state.config, len(prompts))
    constraint, param = structured_outputs_of(req)
    if constraint is not None:
        await state.check_constraint(constraint, param)
    token_lists: list[list[int]] = []
    for p in prompts:
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        token_lists.append(await state.encode(p) if isinstance(p, str) else list(p))
    groups: list[PromptGroup] = []
    for ids in token_lists:
        max_tokens = resolve_max_tokens(req.max_tokens, len(ids), state.max_model_len)
        params = sampling_params(req, max_tokens, req.logprobs, 0, constraint,
                                 prompt_logprobs=req.logprobs if req.echo else None)
        groups.append((ids, params, req.n))
    return token_lists, groups


async def create_completion(request: web.Request) -> web.StreamResponse:
    state, request_id, start = request_context(request)
    req = await read_body(request, CompletionRequest)
    prompts = req.prompts
    token_lists, groups = await completion_groups(state, req)
    echo = first_tokens = None
    if req.echo:
        texts = [p if isinstance(p, str) else await state.decode(p) for p in prompts]
        echo = [texts[k // req.n] for k in range(len(prompts) * req.n)]
        first_tokens = [token_lists[k // req.n][0] for k in range(len(prompts) * req.n)]
    streams = state.submit(request_id, groups, req.stop_strings, req.priority, req.model)
    shape = CompletionShape(request_id, state.response_model(req.model), state.texts, req.logprobs is not None,
                            req.stream and req.include_usage, echo, first_tokens)
    return await respond(request, state, request_id, streams, shape, stream=req.stream,
                         include_usage=req.include_usage,
                         num_prompt_tokens=sum(len(t) for t in token_lists), start=start,
                         params=groups[0][1], n=req.n)
