"""The offline API: `LLM(model=DIR, device=..., dtype=..., **engine_options).generate(...)`."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from tessellm.config import EngineConfig
from tessellm.engine.builder import build_engine_parts
from tessellm.engine.detokenizer import decode_continuation
from tessellm.engine.llm_engine import LLMEngine
from tessellm.errors import InvalidRequestError
from tessellm.plugins import PluginManager
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    samples: list[RequestOutput] = field(default_factory=list)  # n > 1: all n, first one too


class LLM:
    def __init__(self, model: str | None = None, *, plugins: PluginManager | None = None,
                 **engine_options: Any) -> None:
        self.config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(build_engine_parts(self.config, plugins))
        self.tokenizer = self.engine.parts.tokenizer

    @property
    def is_demo(self) -> bool:
        return self.engine.parts.is_demo

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def decode(self, token_ids: list[int], prompt_token_ids: list[int] | None = None) -> str:
        """Text of `token_ids`; after a prompt, the text they add to it (a SentencePiece word
        start keeps its space), exactly what the streaming server sends."""
        return decode_continuation(self.tokenizer, prompt_token_ids or [], token_ids, True)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] | None = None, n: int = 1
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. Nothing is queued if
        any prompt, params or priority entry is invalid. `priority`: one for all prompts or
        one per prompt, 0 (most urgent, the default) .. priority_levels - 1.
        `n`: samples per prompt (sample i seeded with seed + i when params.seed is set); the
        samples share the prompt's KV blocks (copy-on-write). With n > 1 each output holds
        its first sample's fields and all n in `samples`."""
        if isinstance(prompts, str):
            raise InvalidRequestError("prompts must be a list of strings or of token-id lists")
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        priority = 0 if priority is None else priority
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", "n")
        token_lists = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        groups: list[list[Request]] = []
        requests: list[Request] = []
        try:
            for ids, p, prio in zip(token_lists, per_prompt, priorities):
                group = self.engine.add_request_group(ids, p, n, priority=prio)
                groups.append(group)
                requests += group
        except Exception:
            for r in requests:
                self.engine.abort(r.request_id)
            raise
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        finally:  # on a failed step, the other requests of this call are aborted too
            for r in requests:
                if not r.is_finished:
                    self.engine.abort(r.request_id)
        outputs = []
        for group in groups:
            samples = [self._output(r) for r in group]
            first = samples[0]
            if n > 1:
                first = replace(first, samples=samples)
            outputs.append(first)
        return outputs

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                             self.decode(r.output_token_ids, r.prompt_token_ids),
                             r.finish_reason.value)
