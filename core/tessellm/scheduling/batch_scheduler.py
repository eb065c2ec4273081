"""Batch scheduler: which requests run this step and how many tokens each, under the token
budget, the sequence cap and the KV pool; it decides every preemption.

`running` is sorted by (level, arrival): the level a request was admitted with (its effective
priority then, frozen while it runs), ties by arrival. One pass per step visits requests in
priority order, merging the running list with the waiting queue:

    level 0: running (arrival order), then waiting (arrival order);  level 1: ...

so among equals running requests go first (nobody waiting evicts an equal), and a waiting
request of a better level is served before running requests of a worse one.

  * A running request gets its tokens (`num_new_tokens`). When its blocks cannot be allocated,
    the tail of `running` (lowest priority, latest arrival among equals) is preempted, and the
    allocation retried; when the request is the tail itself it is preempted and the pass ends.
  * A waiting request is admitted with its prefix-cache hits; a swapped-out one (swap mode)
    with its kept num_computed_tokens and new device blocks, into which the SwapSpace has its
    host blocks copied back (no prefix-cache lookup: swapped-in blocks are new blocks).
    When the sequence cap is reached
    or its blocks cannot be allocated, it evicts running requests of a strictly worse level,
    tail first, but only if evicting all of them would make room (computed exactly, shared
    blocks included): an eviction never happens in vain. Otherwise admission stops for this
    step: no skipping ahead, so a long prompt is not starved by short ones behind it.
  * In a step that preempted, a waiting request is admitted only if it outranks every request
    preempted in it (with a single level: nobody is, as before priorities existed), and the
    preempted ones are queued again only at the end of the pass: never back in the same step.

Tokens per request: a request has num_computed_tokens out of num_tokens and is granted
min(missing, budget) of the missing ones: prefill (missing = the prompt), chunked prefill
(budget < missing), decode (missing = 1: the last sampled token) and resumption after a
prefix-cache hit (computed = the tokens the hit covers) are that one rule. A request that wants
prompt logprobs is granted at most PROMPT_LOGITS_CHUNK tokens a step, so one step's prompt
logits stay that many rows of the vocabulary.

LoRA (max_loras > 0): a waiting request whose adapter is not among the running requests'
adapters is admitted only while fewer than max_loras distinct adapters run (the device's
slot table holds that many); otherwise admission stops for the step as for a full pool, so
the steps' adapters always fit the table.

Speculation: a decoding request with draft tokens (request.draft_token_ids, set by
tessellm.speculative before the step) is granted its last token plus as many drafts as the
budget leaves (an entry of 1 + d tokens, scheduled with the non-decodes); drafts whose blocks
do not fit are dropped, never a reason to preempt.

Async scheduling: a running request whose pending tokens (sampled on the device by the step
still in flight) already reach its max_tokens or max_model_len is skipped: it is finished as
soon as they are read back, so a step for it would be wasted (and past max_model_len, wrong).

Invariants: the pass visits `running` in list order, and every victim is the list's tail, of a
key >= the request being served: a victim was never granted tokens earlier in the same step.
A waiting request admitted in the step has a key below the running request visited next, so
it is inserted before it. len(running) <= the cap of the step when something is admitted (the
SLA policy may lower the cap below len(running): then only evictions make room); a step's
grants sum to at most max_num_batched_tokens; victims are in no table and not in `scheduled`.
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable

from tessellm.cache.host_pool import SwapSpace
from tessellm.cache.kv_groups import KVCache
from tessellm.cache.prefix_cache import PrefixCacheStats
from tessellm.request import Request, RequestStatus
from tessellm.scheduling.output import ScheduledRequest, SchedulerError, SchedulerOutput
from tessellm.scheduling.request_scheduler import RequestScheduler, Ticket

PROMPT_LOGITS_CHUNK = 256


def num_new_tokens(request: Request, budget: int, num_computed: int | None = None) -> int:
    """Tokens to grant `request` under `budget` (>= 1 when budget >= 1), counting from
    `num_computed` (by default the request's own count; admission passes its prefix-cache
    hit). Raises SchedulerError when nothing is missing (a bug of the caller)."""
    done = request.num_computed_tokens if num_computed is None else num_computed
    missing = request.num_tokens - done
    if missing < 1:
        raise SchedulerError(
            f"request {request.request_id!r} has no token to compute; was the previous "
            f"output passed to update_from_output()?")
    n = min(missing, budget)
    return min(n, PROMPT_LOGITS_CHUNK) if request.wants_prompt_logits else n


def _running_key(ticket: Ticket) -> tuple[int, int]:
    return ticket.level, ticket.arrival


class BatchScheduler:
    __slots__ = ("kv", "requests", "max_num_batched_tokens", "running", "_preempt",
                 "_prefix_stats", "swap", "max_loras")

    def __init__(self, kv: KVCache, requests: RequestScheduler,
                 max_num_batched_tokens: int, preempt: Callable[[Request], None],
                 prefix_stats: PrefixCacheStats, swap: SwapSpace | None = None,
                 max_loras: int = 0) -> None:
        self.kv = kv
        self.requests = requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running: list[Ticket] = []
        self._preempt = preempt           # releases a victim's KV (recompute or swap)
        self._prefix_stats = prefix_stats
        self.swap = swap                  # swap mode: where swapped-out requests' KV is
        self.max_loras = max_loras        # LoRA: distinct adapters running at most (0: off)

    def schedule(self, max_num_seqs: int) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        victims: list[Ticket] = []
        running, queue = self.running, self.requests
        admitting = True
        i = 0
        while budget > 0:
            cand = queue.peek() if admitting else None
            if cand is not None:
                eff = queue.effective_priority(cand)
                if i >= len(running) or eff < running[i].level:
                    n = -1
                    # In a step that preempted, only a request that outranks the victims.
                    if all(eff < v.level for v in victims):
                        n = self._admit(cand, eff, budget, max_num_seqs, victims)
                    if n < 0:
                        admitting = False
                        continue
                    i += 1                   # inserted before running[i]: skip past it
                    scheduled.append(ScheduledRequest(cand.request, n))
                    budget -= n
                    continue
            if i >= len(running):
                break
            ticket = running[i]
            if ticket.request.finishes_by_length_when_resolved(queue.max_model_len):
                i += 1                       # in flight, done once read back: nothing to run
                continue
            n = num_new_tokens(ticket.request, budget)
            drafts = self._drafts(ticket.request, n, budget)
            if drafts:
                n += len(drafts)
            elif not self._allocate_or_preempt(ticket, n, victims):
                break                        # it was the tail: nothing after it is left
            scheduled.append(ScheduledRequest(ticket.request, n, draft_token_ids=drafts))
            budget -= n
            i += 1

        for ticket in victims:               # back in the queue, in their arrival places
            queue.push(ticket)
        decodes = [s for s in scheduled if s.num_tokens == 1]
        if 0 < len(decodes) < len(scheduled):
            scheduled = decodes + [s for s in scheduled if s.num_tokens != 1]
        return SchedulerOutput(scheduled, [v.request for v in victims],
                               self.max_num_batched_tokens - budget)

    # ---- running requests ------------------------------------------------------------------

    def _allocate_or_preempt(self, ticket: Ticket, n: int, victims: list[Ticket]) -> bool:
        """Allocate blocks for `n` more tokens, preempting the tail of `running` until they
        fit. False when `ticket` itself was the tail and was preempted."""
        while not self.kv.allocate_slots(ticket.request, n):
            victim = self.running.pop()
            self._evict(victim, victims)
            if victim is ticket:
                return False
        return True

    def _drafts(self, request: Request, n: int, budget: int) -> tuple[int, ...]:
        """The drafts a decoding request verifies this step (takes request.draft_token_ids):
        as many as the budget leaves room for, with their blocks allocated, or none. Drafts
        never preempt anyone: when their blocks do not fit, the request decodes alone."""
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if not drafts or n != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return ()
        drafts = drafts[:budget - 1]
        if not drafts or not self.kv.allocate_slots(request, 1 + len(drafts)):
            return ()
        return tuple(drafts)

    # ---- waiting requests ------------------------------------------------------------------

    def _admit(self, cand: Ticket, eff: int, budget: int, max_num_seqs: int,
               victims: list[Ticket]) -> int:
        """Admit `cand` at level `eff`, evicting running requests of a worse level if that
        makes room. Returns the tokens granted, or -1 (nothing changed) when it cannot run."""
        request, running, kv = cand.request, self.running, self.kv
        if request.lora_int_id and not self._adapter_fits(request.lora_int_id):
            return -1
        swapped = self.swap is not None and self.swap.is_swapped(request.request_id)
        if swapped:   # resumes from its kept computed tokens, into new blocks
            hits, num_hit_tokens = [], request.num_computed_tokens
        else:
            hits, num_hit_tokens = ([], 0) if request.wants_prompt_logits \
                else kv.get_computed_blocks(request)
        n = num_new_tokens(request, budget, num_hit_tokens)
        slots_short = len(running) - max_num_seqs + 1
        if slots_short > 0 or not self._fits(request, n, hits, ()):
            lower = self._lower_than(eff)
            if len(lower) < slots_short or not self._fits(request, n, hits, lower):
                if not running and slots_short <= 0:
                    raise SchedulerError(
                        f"request {request.request_id!r} cannot get KV blocks for {n} tokens "
                        f"after {num_hit_tokens} cached ones with nothing running: "
                        f"{kv.num_free_blocks} of {kv.num_blocks} blocks free")
                return -1
            for _ in range(max(slots_short, 0)):
                self._evict(running.pop(), victims)
        while not kv.allocate_slots(request, n, hits):
            self._evict(running.pop(), victims)   # _fits promised room before `lower` runs out
        self.requests.pop(cand)
        if swapped:
            self.swap.swap_in(request)
        else:
            request.num_computed_tokens = num_hit_tokens
            if kv.enable_prefix_caching:
                self._prefix_stats.record(request.num_tokens, num_hit_tokens)
        request.status = RequestStatus.RUNNING
        cand.level = eff
        bisect.insort(running, cand, key=_running_key)
        return n

    def _adapter_fits(self, lora_int_id: int) -> bool:
        """Whether a request of this adapter may run: its adapter already runs, or fewer
        than max_loras distinct adapters do (the device slot table's size)."""
        running = {t.request.lora_int_id for t in self.running}
        running.discard(0)
        return lora_int_id in running or len(running) < self.max_loras

    def _lower_than(self, level: int) -> list[Ticket]:
        """Running requests of a level worse than `level`: the tail of `running`."""
        running = self.running
        k = len(running)
        while k > 0 and running[k - 1].level > level:
            k -= 1
        return running[k:]

    def _fits(self, request: Request, n: int, hits: list[int], evicted: list[Ticket] | tuple
              ) -> bool:
        """Whether allocate_slots(request, n, hits) would succeed once `evicted` released
        their blocks: a block becomes free when every table holding it is evicted."""
        pool = self.kv.pool
        freed: set[int] = set()
        if evicted:
            held = Counter(b for t in evicted for b in self.kv.held_blocks(t.request_id))
            freed = {b for b, c in held.items() if pool.ref_count(b) == c}
        # computed tokens: none, or those a swapped-out request kept (it has no hits then);
        # with a sliding window only the blocks inside it (tessellm.cache.sliding_window);
        # every block-table group's (tessellm.cache.kv_groups: one pool, global block ids)
        held_hits, missing = self.kv.growth(request, n, hits)
        revived = sum(1 for b in held_hits if b in freed or pool.ref_count(b) == 0)
        return missing + revived <= self.kv.num_free_blocks + len(freed)

    def _evict(self, victim: Ticket, victims: list[Ticket]) -> None:
        self._preempt(victim.request)
        victims.append(victim)
