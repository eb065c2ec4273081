"""The engine core's side of speculation: proposals before schedule(), learning after a step.

Each step, `propose` gives every eligible running request (decoding: only its last sampled
token is missing; some output already; nothing pending on the device; no output constraint;
room for one draft under max_tokens and max_model_len; its num_speculative_tokens not 0) a proposal from the proposer, and the
policy (tessellm.speculative.policy) keeps those that pay; the kept ones are the requests'
`draft_token_ids`, which the scheduler grants as extra tokens of the request under the
step's token budget (tessellm.scheduling.batch_scheduler). Every other running request's
drafts are cleared, so drafts never outlive the step they were proposed for.

A costly proposer (one with `costly = True`: a draft model) is asked only for the requests
the policy takes, at the lengths it chose (the policy decides on nominal proposals of length k
first), so a step whose proposals would not pay does not pay for proposing either. Its time is
left out of the step's (observe_step) and priced apart: the policy learns it from the steps
whose every request was drafted for the step before (`warm`: the draft catches up only what
the last verify accepted).

After the step, `verify` accepts each request's drafts against the step's draws (recording
how many it accepted, `observe_verify`), and
`observe_step` the step's duration (the policy's costs). A request's RequestSpeculation
(proposer state and acceptance) is created on first proposal and released with the request.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tessellm.request import Request
from tessellm.speculative.config import SpeculativeConfig
from tessellm.speculative.policy import Acceptance, Candidate, SpeculationPolicy
from tessellm.speculative.proposer import Proposer
from tessellm.speculative.stats import SpecStats
from tessellm.speculative.verification import num_accepted


@dataclass(slots=True)
class RequestSpeculation:
    """One request's speculation state (request.speculation)."""

    state: Any = None                       # the proposer's (an n-gram index, ...)
    acceptance: Acceptance = field(default_factory=Acceptance)
    warm: bool = False                      # a costly proposer drafted for it last step


def max_drafts(request: Request, k: int, max_model_len: int) -> int:
    """Drafts a decoding request may verify in one step: the step computes its last token
    and the drafts, and may return them all plus one, so they must fit max_tokens outputs and
    the positions below max_model_len (the KV its validation reserved)."""
    outputs = len(request.output_token_ids)
    return max(0, min(k, request.params.max_tokens - outputs - 1,
                      max_model_len - 1 - request.num_tokens))


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int
                 ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.costly = bool(getattr(proposer, "costly", False))
        self.policy = SpeculationPolicy(config.adaptive, costly=self.costly)
        self.stats = SpecStats(method=config.method)
        self._proposal_seconds = 0.0   # the costly proposer's time in the step being made

    def _eligible(self, r: Request) -> int:
        if r.is_finished or r.num_pending or r.constraint is not None \
                or not r.output_token_ids or r.num_computed_tokens != r.num_tokens - 1:
            return 0
        k = self.config.num_speculative_tokens
        if r.params.num_speculative_tokens is not None:   # the request's own cap (0: off)
            k = min(k, r.params.num_speculative_tokens)
        return max_drafts(r, k, self.max_model_len) if k else 0

    def propose(self, running: Sequence[Request], max_num_batched_tokens: int) -> None:
        """Set the drafts of the running requests for the next schedule()."""
        requests, ks = [], []
        num_tokens = num_decodes = 0
        for r in running:
            r.draft_token_ids = []
            missing = r.num_tokens - r.num_computed_tokens
            num_tokens += missing
            num_decodes += missing == 1
            k = self._eligible(r)
            if r.speculation is not None and not k:
                r.speculation.warm = False   # the draft falls behind
            if k:
                if r.speculation is None:
                    r.speculation = RequestSpeculation()
                requests.append(r)
                ks.append(k)
        if not requests:
            return
        budget = min(num_tokens, max_num_batched_tokens)
        if self.costly:
            self._decide_then_propose(requests, ks, num_decodes, budget)
            return
        proposals = self.proposer.propose(requests, ks)
        candidates = []
        for r, k, drafts in zip(requests, ks, proposals):
            if drafts:
                candidates.append(Candidate(r, list(drafts[:k]), r.speculation.acceptance))
        self.stats.proposals += len(candidates)
        taken = self.policy.choose(candidates, num_decodes, budget)
        self.stats.refused_proposals += len(candidates) - len(taken)
        for c in taken:
            c.request.draft_token_ids = c.drafts

    def _decide_then_propose(self, requests: list[Request], ks: list[int], num_decodes: int,
                             budget: int) -> None:
        """A costly proposer (a draft model): the policy decides on proposals of the full
        length k first (their content does not change its choice), and only the requests it
        takes are proposed for, at the lengths it chose; a step it refuses costs nothing."""
        placeholders = [Candidate(r, [0] * k, r.speculation.acceptance)
                        for r, k in zip(requests, ks)]
        taken = self.policy.choose(placeholders, num_decodes, budget)
        self.stats.refused_proposals += len(placeholders) - len(taken)
        steady = all(c.request.speculation.warm for c in taken)
        for c in placeholders:
            c.request.speculation.warm = False
        if not taken:
            return
        t0 = time.perf_counter()
        proposals = self.proposer.propose([c.request for c in taken],
                                          [len(c.drafts) for c in taken])
        self._proposal_seconds = time.perf_counter() - t0
        if steady:
            self.policy.observe_proposal(self._proposal_seconds)
        for c, drafts in zip(taken, proposals):
            c.request.draft_token_ids = list(drafts[:len(c.drafts)])
            c.request.speculation.warm = bool(drafts)
        self.stats.proposals += len(placeholders)

    def wants_ids(self, sampled: Sequence[Request]) -> bool:
        """Async scheduling: whether a step sampling `sampled` should complete before the next
        is scheduled, so that its requests can get drafts (a request with a token in flight
        gets none). True for any request that may speculate and whose proposals the policy
        does not refuse now; a refused one counts the step as refused, so it is probed after
        the policy's probe interval like one whose proposals were refused."""
        want = False
        for r in sampled:
            if r.is_finished or r.constraint is not None or r.params.num_speculative_tokens == 0 \
                    or r.params.max_tokens - len(r.output_token_ids) - r.num_pending < 2:
                continue
            acceptance = r.speculation.acceptance if r.speculation is not None else None
            if acceptance is None or acceptance.refused_steps == 0 \
                    or self.policy.probe_due(acceptance):
                want = True
            else:
                acceptance.refused_steps += 1
        return want

    def verify(self, step: Any, token_ids: Sequence[int]
               ) -> tuple[dict[str, tuple[int, ...]], set[int], int]:
        """A launched step's verify entries against its draws (tessellm.speculative.
        verification): (accepted drafts per request, the sampled rows whose tokens are not
        the step's own for their request, rejected rows). A request with a accepted drafts
        keeps its row at offset a (the token after them); the logprobs of rows 0..a-1 go to
        its output logprobs now, with the drafts, rows after a are rejected."""
        accepted: dict[str, tuple[int, ...]] = {}
        skip: set[int] = set()
        rejected = 0
        first_row = {step.sampled[i].request_id: i
                     for i, j in enumerate(step.sample_offsets) if j == 0}
        for s in step.out.scheduled:
            drafts, request = s.draft_token_ids, s.request
            if not drafts or request.is_finished:
                continue
            first = first_row[request.request_id]
            a = num_accepted(drafts, token_ids[first:first + len(drafts) + 1])
            accepted[request.request_id] = drafts[:a]
            self.observe_verify(request, len(drafts), a)
            request.output_logprobs += [lp for lp in step.logprobs[first:first + a]
                                        if lp is not None]
            skip.update(range(first, first + a))
            skip.update(range(first + a + 1, first + len(drafts) + 1))
            rejected += len(drafts) - a
        return accepted, skip, rejected

    def observe_verify(self, request: Request, drafted: int, accepted: int) -> None:
        """A verify step's outcome for one request (drafted >= 1 scheduled drafts)."""
        self.stats.verify_steps += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        if request.speculation is not None:
            request.speculation.acceptance.observe(drafted, accepted)
        self.policy.method_alpha.observe(drafted, accepted)

    def observe_step(self, seconds: float, num_tokens: int, with_drafts: bool) -> None:
        """A completed step's seconds (a costly proposer's time for it left out)."""
        seconds, self._proposal_seconds = max(0.0, seconds - self._proposal_seconds), 0.0
        self.policy.costs.observe(num_tokens, with_drafts, seconds)

    def release(self, request: Request) -> None:
        if request.speculation is not None:
            self.proposer.release(request)
            request.speculation = None
