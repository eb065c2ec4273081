"""DeltaTracker: what each tracked request produced since it was last reported.

Used by the engine core (to send StepOutputs) and by the offline LLM (to watch stop strings):
a request's deltas come in generation order, its last one has finished=True, and then it is
no longer tracked.
"""
from __future__ import annotations

import time

from tessellm.engine.core_messages import TokenDelta
from tessellm.request import FinishReason, Request


class DeltaTracker:
    """Per tracked request: how many of its tokens were already sent."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[Request, int]] = {}
        self.arrivals: dict[str, float] = {}
        self.step_errors: dict[str, str] = {}
        self.prompt_logprobs_sent: set[str] = set()

    def track(self, request: Request, arrival: float | None = None) -> None:
        """Start reporting `request`; with `arrival`, also report its first schedule."""
        self.sent[request.request_id] = (request, 0)
        if arrival is not None:
            self.arrivals[request.request_id] = arrival

    def deltas(self) -> list[TokenDelta]:
        """New tokens and finish states of every tracked request since the last call."""
        out = []
        for rid, (r, sent) in list(self.sent.items()):
            n = len(r.output_token_ids)
            prompt_lps = self._prompt_logprobs(r)
            if n == sent and not r.is_finished and not prompt_lps:
                continue
            reason = r.finish_reason.value if r.is_finished and r.finish_reason else None
            error = (r.error or self.step_errors.pop(rid, "engine step failed")) \
                if r.finish_reason is FinishReason.ERROR else None
            out.append(TokenDelta(
                request_id=rid, token_ids=r.output_token_ids[sent:n],
                logprobs=r.output_logprobs[sent:n], finished=r.is_finished,
                finish_reason=reason, error=error, num_prompt_tokens=r.num_prompt_tokens,
                num_output_tokens=n, prompt_logprobs=prompt_lps))
            if r.is_finished:
                del self.sent[rid]
                self.arrivals.pop(rid, None)
                self.prompt_logprobs_sent.discard(rid)
            else:
                self.sent[rid] = (r, n)
        return out

    def _prompt_logprobs(self, r: Request) -> list:
        """A request's prompt logprobs, once, as soon as they are all collected."""
        rid = r.request_id
        if r.params.prompt_logprobs is None or rid in self.prompt_logprobs_sent \
                or r.wants_prompt_logits:
            return []
        self.prompt_logprobs_sent.add(rid)
        return list(r.prompt_logprobs)

    def first_scheduled(self) -> list[tuple[str, float]]:
        now = time.monotonic()
        started = [(rid, now - t) for rid, t in self.arrivals.items()
                   if self.sent[rid][0].num_computed_tokens > 0]
        for rid, _ in started:
            del self.arrivals[rid]
        return started

    def fail_all(self, error: str) -> list[TokenDelta]:
        out = [TokenDelta.final(rid, "error", error, r.num_prompt_tokens,
                                len(r.output_token_ids)) for rid, (r, _) in self.sent.items()]
        self.sent.clear()
        return out
