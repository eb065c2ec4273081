"""TokenLogprobs: one sampled token's logprobs, as the sampler makes them and messages carry
them (no torch here: the server's front end imports it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs for one sampled token: its own and the top tokens' (descending, ids on ties in
    the order torch.topk gives), len(top) == min(params.logprobs, vocab)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
