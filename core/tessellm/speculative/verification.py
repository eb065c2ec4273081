"""Which draft tokens a verify step accepts.

A request with drafts d_1..d_k is computed at k + 1 positions in one step: its last token
and the drafts. The sampler draws a token at every position j = 0..k, from the target's
distribution p_j there (penalties, bias, temperature and filters included), with the noise
of output position len(output) + j, as it would without speculation. Drafts are accepted
while they equal the draw: a = the first j with draw_j != d_{j+1} (k if none), and the
request gets d_1..d_a and draw_a (the correction, or the bonus token when all matched).

Exactness. Every built-in proposal is deterministic (the proposal distribution q is one-hot
on d), for which the rejection rule of Leviathan et al. / Chen et al., accept d with
probability min(1, p(d) / q(d)), is p(d), and on rejection the next token is drawn from
normalize(max(p - q, 0)) = p with d removed. The draw x ~ p equals d with probability p(d)
exactly, and given x != d it is distributed as that residual: one race does both. So the
output is the target's distribution; greedy rows (argmax) accept the longest matching prefix;
and a seeded row draws the same noise at each output position with or without speculation.
"""
from __future__ import annotations

from collections.abc import Sequence


def num_accepted(drafts: Sequence[int], draws: Sequence[int]) -> int:
    """How many leading drafts equal the target's draws (draws[j]: the token drawn at the
    position of draft j + 1; len(draws) == len(drafts) + 1)."""
    if len(draws) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} draws, got {len(draws)}")
    a = 0
    for d, x in zip(drafts, draws):
        if d != x:
            break
        a += 1
    return a
