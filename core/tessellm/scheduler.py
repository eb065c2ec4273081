"""Which requests run this step, and how many tokens each (continuous batching).

There is no prefill phase. A request has num_computed_tokens out of num_tokens; each step the
scheduler grants it some of the missing tokens under a token budget (max_num_batched_tokens)
and a sequence cap (max_num_seqs). That one rule covers prefill, chunked prefill and decode.

A step, in order:
  1. Running requests, earliest arrival first, each get min(missing, budget) tokens (capped by
     long_prefill_token_threshold when set). When the KV blocks for them cannot be allocated,
     the most recently arrived running request is preempted by recompute (blocks freed,
     num_computed_tokens = 0, back to the waiting queue, output ids kept) and the allocation is
     retried; when the request itself is the most recent one it is preempted and the pass stops.
  2. Only if nothing was preempted: waiting requests in arrival order, while the budget and the
     cap allow. Each first asks the KV manager for its prefix-cache hits (full blocks already
     computed, never its last token) and starts at the tokens they cover, so it needs fewer
     tokens of the budget. The first one whose blocks cannot be allocated stops the pass (no
     skipping ahead, so a long prompt is not starved by short ones behind it).
The output lists one-token entries (decodes) first, then the others, each group in the order
it was scheduled: the model runner's attention wants decodes first.

Invariants:
  * arrival order is the order of add_request; `running` is sorted by it, so the preemption
    victim (its last entry) is never a request scheduled earlier in the same step;
  * `waiting` is sorted by it too. Admission is FIFO without skipping, so every request ever
    admitted arrived before every request never admitted: preempted requests come back at the
    front of the queue, in arrival order;
  * an unfinished request is in exactly one of waiting / running; waiting and finished
    requests hold no KV blocks; len(running) <= max_num_seqs; a step's tokens sum to at most
    max_num_batched_tokens;
  * progress: the earliest running request is preempted only when it is alone and still does
    not fit, which add_request rules out, so every step with unfinished requests schedules at
    least one token (otherwise schedule() raises SchedulerError naming the request).

schedule() and update_from_output() alternate: the computed counts move only in the latter,
except that admission sets a request's count to its prefix-cache hit. update_from_output()
enters newly computed full blocks into the prefix cache (their KV is written by then).
Prefix-cache counters (`prefix_cache_queries`, `prefix_cache_hits`, in tokens, and
`prefix_cache_hit_rate`) count admissions; see tessellm.cache.prefix_cache.PrefixCacheStats.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, replace
from typing import Iterable

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.cache.prefix_cache import PrefixCacheStats
from tessellm.errors import ConfigError, InvalidRequestError, TessellmError
from tessellm.request import FinishReason, Request, RequestStatus


class SchedulerError(TessellmError, RuntimeError):
    """The scheduler cannot make progress, or was fed an output that does not match its state."""


@dataclass(slots=True)
class SchedulerConfig:
    """long_prefill_token_threshold: most tokens one request gets per step (0: no cap)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or t < 0:
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0, got {t!r}")


@dataclass(slots=True)
class ScheduledRequest:
    """`num_tokens` tokens of `request`, at positions num_computed_tokens.. (as of schedule())."""

    request: Request
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]   # one-token entries first
    preempted: list[Request]
    num_batched_tokens: int

    @property
    def num_decodes(self) -> int:
        """Entries with one query token; they form the head of `scheduled`."""
        n = 0
        for s in self.scheduled:
            if s.num_tokens != 1:
                break
            n += 1
        return n

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self._next_arrival = 0
        self._arrival: dict[str, int] = {}                  # unfinished request id -> order
        self._unfinished: dict[str, Request] = {}
        self._waiting: list[tuple[int, Request]] = []       # heap keyed by arrival order
        self._running: list[Request] = []                   # sorted by arrival order
        self._prefix_stats = PrefixCacheStats()

    # ---- admission and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises InvalidRequestError for a duplicate id, a request that is
        not fresh, a prompt longer than max_model_len, or one that could never fit the pool."""
        rid = request.request_id
        if rid in self._unfinished:
            raise InvalidRequestError(f"request id {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise InvalidRequestError(
                f"request {rid!r} must be waiting with no computed tokens to be added")
        n_prompt = request.num_prompt_tokens
        if n_prompt < 1:
            raise InvalidRequestError(f"request {rid!r} has an empty prompt")
        if n_prompt > self.config.max_model_len:
            raise InvalidRequestError(
                f"request {rid!r}: prompt of {n_prompt} tokens exceeds max_model_len "
                f"{self.config.max_model_len}")
        need = self.kv.num_blocks_needed(self._max_kv_tokens(request))
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"request {rid!r} may need {need} KV blocks but the cache has "
                f"{self.kv.num_blocks}")
        order = self._next_arrival
        self._next_arrival += 1
        self._arrival[rid] = order
        self._unfinished[rid] = request
        heapq.heappush(self._waiting, (order, request))

    def abort(self, request_id: str) -> Request | None:
        """Finish the request with FinishReason.ABORT and free its blocks; None if unknown."""
        done = self.finish_requests([request_id], FinishReason.ABORT)
        return done[0] if done else None

    def finish_requests(self, request_ids: Iterable[str],
                        reason: FinishReason) -> list[Request]:
        """Finish the named unfinished requests (others are ignored) with `reason`, wherever
        they are, and free their blocks. Safe between schedule() and update_from_output():
        the latter skips requests finished meanwhile."""
        done: list[Request] = []
        for rid in request_ids:
            request = self._unfinished.get(rid)
            if request is None:
                continue
            request.finish(reason)
            self._forget(request)
            done.append(request)
        if done:
            self._waiting = [(o, r) for o, r in self._waiting if not r.is_finished]
            heapq.heapify(self._waiting)
            self._running = [r for r in self._running if not r.is_finished]
        return done

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        running = self._running

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            n = self._num_new_tokens(request, budget)
            if not self._allocate_or_preempt(request, n, preempted):
                break  # the request preempted itself: nothing after it is left either
            scheduled.append(ScheduledRequest(request, n))
            budget -= n
            i += 1

        # A step that had to preempt has no room to admit anyone.
        while (not preempted and self._waiting and budget > 0
               and len(running) < self.config.max_num_seqs):
            request = self._waiting[0][1]
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            n = self._num_new_tokens(request, budget, num_hit_tokens)
            if not self.kv.allocate_slots(request, n, hits):
                if not running:
                    raise SchedulerError(
                        f"request {request.request_id!r} cannot get KV blocks for {n} tokens "
                        f"after {num_hit_tokens} cached ones with nothing running: "
                        f"{self.kv.num_free_blocks} of {self.kv.num_blocks} blocks free")
                break
            heapq.heappop(self._waiting)
            request.num_computed_tokens = num_hit_tokens
            if self.kv.enable_prefix_caching:
                self._prefix_stats.record(request.num_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            bisect.insort(running, request, key=self._arrival_of)
            scheduled.append(ScheduledRequest(request, n))
            budget -= n

        decodes = [s for s in scheduled if s.num_tokens == 1]
        if 0 < len(decodes) < len(scheduled):
            scheduled = decodes + [s for s in scheduled if s.num_tokens != 1]
        return SchedulerOutput(scheduled, preempted,
                               self.config.max_num_batched_tokens - budget)

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Account the step's computed tokens and append the sampled ones.

        `sampled` holds one token for each scheduled request that became fully computed, and
        for no other (a partial prompt chunk samples nothing); entries for requests finished
        since schedule() are ignored. Returns the requests that finished (blocks freed).
        Raises SchedulerError, changing nothing, when `sampled` does not match the output.
        """
        self._check_output(output, sampled)
        finished: list[Request] = []
        for s in output.scheduled:
            request = s.request
            if request.is_finished:
                continue
            request.num_computed_tokens += s.num_tokens
            self.kv.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue
            request.append_output(sampled[request.request_id])
            if not request.is_finished and request.num_tokens >= self.config.max_model_len:
                request.finish(FinishReason.LENGTH)
            if request.is_finished:
                self._forget(request)
                finished.append(request)
        if finished:
            self._running = [r for r in self._running if not r.is_finished]
        return finished

    # ---- state -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting requests, next to be admitted first."""
        return tuple(r for _, r in sorted(self._waiting, key=lambda e: e[0]))

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache by admitted requests (0 when caching is off)."""
        return self._prefix_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens of admitted requests found computed in the prefix cache."""
        return self._prefix_stats.hits

    @property
    def prefix_cache_hit_rate(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (0.0 before any query)."""
        return self._prefix_stats.hit_rate

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A copy of the counters (tokens and requests)."""
        return replace(self._prefix_stats)

    def get_request(self, request_id: str) -> Request | None:
        return self._unfinished.get(request_id)

    # ---- helpers ---------------------------------------------------------------------------

    def _arrival_of(self, request: Request) -> int:
        return self._arrival[request.request_id]

    def _max_kv_tokens(self, request: Request) -> int:
        """Most tokens whose KV the request will ever hold: its last sampled token is never
        computed, and it stops once num_tokens reaches max_model_len."""
        n_prompt = request.num_prompt_tokens
        more = min(request.params.max_tokens - 1, self.config.max_model_len - 1 - n_prompt)
        return n_prompt + max(more, 0)

    def _num_new_tokens(self, request: Request, budget: int,
                        num_computed: int | None = None) -> int:
        """Tokens to grant: the missing ones (after `num_computed`, by default the request's
        count) under the budget and the per-request threshold."""
        done = request.num_computed_tokens if num_computed is None else num_computed
        missing = request.num_tokens - done
        if missing < 1:
            raise SchedulerError(
                f"request {request.request_id!r} has no token to compute; was the previous "
                f"output passed to update_from_output()?")
        n = min(missing, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(n, threshold) if threshold > 0 else n

    def _allocate_or_preempt(self, request: Request, n: int,
                             preempted: list[Request]) -> bool:
        """Allocate blocks for `n` more tokens of `request`, preempting the most recently
        arrived running requests until they fit. False when `request` itself was preempted."""
        while not self.kv.allocate_slots(request, n):
            victim = self._running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        heapq.heappush(self._waiting, (self._arrival[request.request_id], request))

    def _forget(self, request: Request) -> None:
        self.kv.free(request)
        del self._unfinished[request.request_id]
        del self._arrival[request.request_id]

    def _check_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        ids: set[str] = set()
        for s in output.scheduled:
            request = s.request
            rid = request.request_id
            ids.add(rid)
            if request.is_finished:
                continue
            if self._unfinished.get(rid) is not request or \
                    request.status is not RequestStatus.RUNNING:
                raise SchedulerError(f"scheduled request {rid!r} is not running")
            done = request.num_computed_tokens + s.num_tokens
            if done > request.num_tokens:
                raise SchedulerError(
                    f"request {rid!r} would have {done} computed tokens out of "
                    f"{request.num_tokens}; was this output applied twice?")
            if done == request.num_tokens and rid not in sampled:
                raise SchedulerError(f"request {rid!r} is fully computed but has no sampled token")
            if done < request.num_tokens and rid in sampled:
                raise SchedulerError(
                    f"request {rid!r} computed a partial chunk ({done} of "
                    f"{request.num_tokens} tokens) and must not sample")
        extra = sampled.keys() - ids
        if extra:
            raise SchedulerError(f"sampled tokens for requests not in this step: {sorted(extra)}")
