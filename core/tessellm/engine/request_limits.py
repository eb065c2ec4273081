"""RequestLimits: what decides whether a request can ever run on an engine, as plain values,
so the front end of an engine-core process validates exactly as the core does."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tessellm.errors import InvalidRequestError
from tessellm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    priority_levels: int
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0) -> None:
        """Raise InvalidRequestError if the request can never run (nothing else changes)."""
        levels = self.priority_levels
        if not isinstance(priority, int) or isinstance(priority, bool) \
                or not 0 <= priority < levels:
            raise InvalidRequestError(
                f"priority must be an integer in 0..{levels - 1} (0 is the most urgent), "
                f"got {priority!r}", "priority")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                                      "prompt")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids out of range [0, {vocab}): {bad[:5]}",
                                      "stop_token_ids")
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids out of range [0, {vocab}): "
                                      f"{bad[:5]}", "logit_bias")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate")
        total = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        needed = math.ceil(total / self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(f"the request needs {needed} KV blocks but the pool has "
                                      f"{self.num_kv_blocks}")
