"""Appending what a step produced to a request: a sampled token, or a verify entry's outcome
(speculation). Either stops where the request finishes: EOS, max_tokens (Request.append_output)
or max_model_len (here, reason LENGTH)."""
from __future__ import annotations

from collections.abc import Sequence

from tessellm.cache.kv_groups import KVCache
from tessellm.request import FinishReason, Request
from tessellm.scheduling.output import ScheduledRequest


def append_token(request: Request, token_id: int, max_model_len: int) -> None:
    request.append_output(token_id)
    if not request.is_finished and request.num_known_tokens >= max_model_len:
        request.finish(FinishReason.LENGTH)


def append_verified(kv: KVCache, s: ScheduledRequest, accepted: Sequence[int],
                    token_id: int, running: bool, max_model_len: int) -> None:
    """A verify entry's outcome: the accepted drafts, then the sampled token, appended until
    the request finishes; the accepted drafts' KV counts as computed (its full blocks are
    cached), and the blocks past the request's tokens, which hold only rejected drafts, are
    freed. `running`: the request still holds its blocks (not preempted since)."""
    request = s.request
    for draft in accepted:
        append_token(request, draft, max_model_len)
        if request.is_finished:
            break
    request.num_computed_tokens = min(s.start + s.num_real_tokens + len(accepted),
                                      request.num_tokens)
    if running:
        kv.cache_full_blocks(request, min(request.num_computed_tokens,
                                          request.num_known_tokens))
    if not request.is_finished:
        append_token(request, token_id, max_model_len)
    if running and not request.is_finished:
        kv.trim(request, request.num_tokens)
