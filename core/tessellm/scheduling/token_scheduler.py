"""Token scheduler: how many tokens one request gets this step.

A request has num_computed_tokens out of num_tokens; it is granted

    min(missing, budget, long_prefill_token_threshold if set)

where missing = num_tokens - computed. That one rule is prefill (missing = the prompt),
chunked prefill (budget or threshold < missing), decode (missing = 1: the last sampled token)
and resumption after a prefix-cache hit (computed = the tokens the hit covers).

A request that wants prompt logprobs (Request.wants_prompt_logits) is granted at most
PROMPT_LOGITS_CHUNK tokens a step, so one step's prompt logits stay that many rows of the
vocabulary.

Invariants: the grant is >= 1 whenever budget >= 1 (a request with nothing missing is a bug of
the caller and raises SchedulerError); it never exceeds missing, the budget or the threshold.
"""
from __future__ import annotations

from tessellm.errors import ConfigError
from tessellm.request import Request
from tessellm.scheduling.output import SchedulerError

PROMPT_LOGITS_CHUNK = 256


class TokenScheduler:
    __slots__ = ("long_prefill_token_threshold",)

    def __init__(self, long_prefill_token_threshold: int = 0) -> None:
        t = long_prefill_token_threshold
        if not isinstance(t, int) or t < 0:
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0, got {t!r}")
        self.long_prefill_token_threshold = t

    def num_new_tokens(self, request: Request, budget: int, num_computed: int | None = None
                       ) -> int:
        """Tokens to grant `request` under `budget`, counting from `num_computed` (by default
        the request's own count; admission passes its prefix-cache hit)."""
        done = request.num_computed_tokens if num_computed is None else num_computed
        missing = request.num_tokens - done
        if missing < 1:
            raise SchedulerError(
                f"request {request.request_id!r} has no token to compute; was the previous "
                f"output passed to update_from_output()?")
        n = missing if missing < budget else budget
        if request.wants_prompt_logits and n > PROMPT_LOGITS_CHUNK:
            n = PROMPT_LOGITS_CHUNK
        t = self.long_prefill_token_threshold
        return n if t == 0 or n <= t else t
