"""RequestLimits: the one rule set that decides whether a request can ever run on an engine,
as plain values, so the front end of an engine-core process validates exactly as the core does.

A request is validated where it enters (AsyncEngine.add_request_group, LLMEngine.validate);
the scheduler trusts what was validated and only asserts its invariants (a non-empty prompt
shorter than max_model_len, KV that fits the pool alone: tessellm.request.max_kv_tokens, in
each sliding-window group only the window's bound).
"""
from __future__ import annotations

from dataclasses import dataclass

from tessellm.cache.sliding_window import kv_blocks_bound
from tessellm.errors import InvalidRequestError
from tessellm.request import max_kv_tokens
from tessellm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """prompt_logprobs: whether the engine can return prompt logprobs (a device whose steps
    have static shapes cannot). speculative_tokens: the engine's k (0: it does not
    speculate), the most a request's num_speculative_tokens may ask."""

    priority_levels: int
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    prompt_logprobs: bool = True
    speculative_tokens: int = 0
    kv_windows: tuple[int, ...] = (0,)
    step_tokens: int = 0

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, n: int = 1) -> None:
        """Raise InvalidRequestError if `n` samples of the request can never run (nothing
        else changes)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", "n")
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
        kv_tokens = max_kv_tokens(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        needed = kv_blocks_bound(self.kv_windows, self.block_size, kv_tokens, self.step_tokens)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(f"the request needs {needed} KV blocks but the pool has "
                                      f"{self.num_kv_blocks}")
        k = params.num_speculative_tokens
        if k and k > self.speculative_tokens:
            raise InvalidRequestError(
                f"num_speculative_tokens {k} exceeds this engine's {self.speculative_tokens}"
                + (" (it does not speculate: start it with a speculative_config)"
                   if not self.speculative_tokens else ""), "num_speculative_tokens")
        if params.prompt_logprobs is not None and not self.prompt_logprobs:
            raise InvalidRequestError("prompt logprobs are not supported on this engine's "
                                      "device, whose steps have static shapes",
                                      "prompt_logprobs")
