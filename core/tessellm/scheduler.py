"""Which requests run this step, and how many tokens each (continuous batching with
preemptive priorities). This module is the facade; the parts live in tessellm.scheduling:

  request scheduler  admission, priority classes (0 most urgent .. priority_levels - 1), aging
  batch scheduler    which requests run under the token budget, the sequence cap and the KV
                     pool, and how many tokens each (min(missing, budget)); preemption (a
                     waiting request evicts running ones of a worse level)
  SLA batch sizer    optional: the sequence cap follows the measured p99 inter-token latency

There is no prefill phase. A request has num_computed_tokens out of num_tokens; each step the
scheduler grants it some of the missing tokens under a token budget (max_num_batched_tokens)
and a sequence cap (max_num_seqs). That one rule covers prefill, chunked prefill and decode.

Order: by (effective priority, arrival). The effective priority ages by one level every
aging_interval_steps steps since arrival (0: no aging) and is frozen while a request runs. A
step serves requests in that order, running ones before waiting ones of the same level (see
tessellm.scheduling.batch_scheduler); with one level it is FIFO exactly as before priorities:
running requests first, preempting the latest arrival when blocks run out, then admissions
without skipping and none in a step that preempted.

Preemption (`preempt`, the one hook for every victim) frees the victim's device blocks and
queues it again at the end of the step, in its (priority, arrival) place:
  recompute (default)  num_computed_tokens = 0, output ids kept; it recomputes on resume;
  swap                 its computed blocks are copied to host blocks (tessellm.cache.host_pool:
                       the step's output carries the (device, host) pairs for the runner); it
                       keeps num_computed_tokens and on resume gets new device blocks that the
                       host blocks are copied back into (output.swap_in), with no recompute.
                       When the host pool is short that victim falls back to recompute
                       (counted in swap_stats.fallbacks): a policy, not a hidden failure.

The output lists one-token entries (decodes) first, then the others, each group in the order
it was scheduled: the model runner's attention wants decodes first.

Invariants:
  * an unfinished request is in exactly one of waiting / running between calls; waiting and
    finished requests hold no KV blocks; len(running) <= max_num_seqs; a step's tokens sum to
    at most max_num_batched_tokens;
  * a request is never evicted for a waiting request of an equal or worse effective priority;
    a preempted request goes back ahead of every later arrival of its class;
  * progress: every step with unfinished requests schedules at least one token (the first
    request of the step fits the pool alone, which validation promised and add_request
    asserts), otherwise schedule() raises SchedulerError naming the request; with aging on
    every request finishes.

schedule() and update_from_output() alternate: the computed counts move only in the latter,
except that admission sets a request's count to its prefix-cache hit. update_from_output()
enters newly computed full blocks into the prefix cache (their KV is written by then).
update_from_output() is commit() (computed counts move; a request completing in the step holds
a pending token, so the next schedule() can grant its next decode) then complete() (tokens
appended, stops and lengths, blocks cached). Async scheduling calls them a step apart; in
between a request may be preempted (waiting then) or finished (its token is dropped).
Prefix-cache counters (`prefix_cache_queries`, `prefix_cache_hits`, in tokens, and
`prefix_cache_hit_rate`) count admissions; see tessellm.cache.prefix_cache.PrefixCacheStats.

Request groups (n > 1, `add_request_group`): the siblings wait outside the queue until the
step that computes the parent's last prompt chunk; that output lists them in `forks` (as many
as the sequence cap leaves room for; the others are queued as ordinary requests), they sample
their first token from the parent's logits row, and update_from_output forks them from the
parent (every prompt block shared, copied before a write). See tessellm.scheduling.forks.
"""
from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Iterable, Sequence

from tessellm.cache.host_pool import SwapSpace, SwapStats
from tessellm.cache.kv_groups import KVCache
from tessellm.cache.prefix_cache import PrefixCacheStats
from tessellm.errors import InvalidRequestError
from tessellm.request import FinishReason, Request, RequestStatus
from tessellm.scheduling.appending import append_token, append_verified
from tessellm.scheduling.batch_scheduler import BatchScheduler
from tessellm.scheduling.config import SchedulerConfig
from tessellm.scheduling.forks import ForkGroups
from tessellm.scheduling.output_checks import (check_accepted, check_output, check_running,
                                               check_samples)
from tessellm.scheduling.output import ScheduledRequest, SchedulerError, SchedulerOutput
from tessellm.scheduling.request_scheduler import RequestScheduler
from tessellm.scheduling.sla import SLABatchSizer, SLAConfig

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerError",
           "SchedulerOutput", "SLAConfig"]

class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCache) -> None:
        self.config = config
        self.kv = kv
        self._prefix_stats = PrefixCacheStats()
        self._requests = RequestScheduler(config.priority_levels, config.aging_interval_steps,
                                          config.max_model_len, kv,
                                          config.max_num_batched_tokens)
        self._swap = SwapSpace(kv, config.num_host_blocks) \
            if config.preemption_mode == "swap" else None
        self._batch = BatchScheduler(kv, self._requests,
                                     config.max_num_batched_tokens, self.preempt,
                                     self._prefix_stats, self._swap, config.max_loras)
        self._sla = SLABatchSizer(config.sla, config.max_num_seqs) if config.sla else None
        self._num_preemptions = 0
        self._forks = ForkGroups()

    # ---- admission and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request at its `priority`. The request was validated where it entered
        (tessellm.engine.request_limits); raises InvalidRequestError only for an id already
        in the scheduler (RequestScheduler.check asserts the rest)."""
        if self._forks.get(request.request_id) is not None:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in the scheduler")
        self._requests.add(request)

    def add_request_group(self, parent: Request, children: Iterable[Request]) -> None:
        """Queue `parent`; its `children` (same prompt, priority and salt) wait until the
        parent's prompt is computed, then fork from it (see tessellm.scheduling.forks).
        Raises InvalidRequestError, queueing nothing, for an id already in the scheduler or
        used twice, or a sibling that does not match its parent."""
        children = list(children)
        for request in [parent, *children]:
            if self._forks.get(request.request_id) is not None:
                raise InvalidRequestError(
                    f"request id {request.request_id!r} is already in the scheduler")
            self._requests.check(request)
        self._forks.add(parent, children)
        self._requests.add(parent)

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
            ticket = self._requests.get(rid)
            if ticket is None:
                child = self._forks.remove(rid)   # a sibling not forked yet: no blocks
                if child is not None:
                    child.finish(reason)
                    done.append(child)
                continue
            ticket.request.finish(reason)
            self._forget(ticket.request)
            done.append(ticket.request)
            # its siblings not forked yet go on as ordinary requests
            for child in self._forks.take_pending(rid) + self._forks.finish_step(rid):
                self._requests.add(child)
        if done:
            self._requests.discard_finished()
            self._drop_finished_running()
        return done

    def preempt(self, request: Request) -> None:
        """Release a running request's KV: swapped to host in swap mode when the host pool has
        room (num_computed_tokens kept), else by recompute (blocks freed, num_computed_tokens
        = 0, generated ids kept). The batch scheduler has taken it off `running` and queues it
        again at the end of the step."""
        if self._swap is None or not self._swap.swap_out(request):
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step's batch (see tessellm.scheduling.batch_scheduler); advances aging."""
        out = self._batch.schedule(self.max_num_seqs_now)
        if self._swap is not None:
            out.swap_out, out.swap_in = self._swap.end_step()
        out.block_copies = self.kv.take_block_copies()
        if self._forks:
            self._start_forks(out)
        self._requests.step += 1
        return out

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           accepted: dict[str, Sequence[int]] | None = None) -> list[Request]:
        """Account the step's computed tokens and append the sampled ones.

        `sampled` holds one token for each scheduled request that became fully computed, and
        for no other (a partial prompt chunk samples nothing); entries for requests finished
        since schedule() are ignored. `accepted`: per request scheduled with drafts, the
        drafts it accepted (a prefix of them; see `complete`). Returns the requests that
        finished (blocks freed). Raises SchedulerError, changing nothing, when `sampled` does
        not match the output.
        """
        check_output(self.get_request, output, sampled)
        check_accepted(output, accepted)
        self._commit(output)
        return self._complete(output, sampled, accepted)

    def commit(self, output: SchedulerOutput) -> None:
        """The step is on the device (see the module docstring). Raises SchedulerError,
        changing nothing, when a scheduled request is not running or was committed."""
        for s in output.scheduled:
            check_running(self.get_request, s)
        self._commit(output)

    def complete(self, output: SchedulerOutput, sampled: dict[str, int],
                 accepted: dict[str, Sequence[int]] | None = None) -> list[Request]:
        """The committed step's ids, one per id in output.sampling (ignored for requests
        finished since); returns the requests that finished (blocks freed). A request
        scheduled with drafts gets its accepted drafts (`accepted[id]`, a prefix of its
        drafts, default none) and then its sampled token, appended in that order and
        stopping where it finishes; their KV counts as computed, and the blocks past its
        tokens (rejected drafts' slots) are freed, never cached. Raises SchedulerError,
        changing nothing, on a mismatch."""
        check_samples(self.get_request, output, sampled)
        check_accepted(output, accepted)
        return self._complete(output, sampled, accepted)

    def _commit(self, output: SchedulerOutput) -> None:
        sampling = output.sampling
        for s in output.scheduled:
            request = s.request
            if request.is_finished:
                continue
            s.start = request.num_computed_tokens
            request.num_computed_tokens += s.num_real_tokens   # drafts: once accepted
            if request.num_computed_tokens == request.num_tokens:
                request.num_pending += 1
                sampling.append(request.request_id)
                sampling += [c.request_id for c in output.forks.get(request.request_id, ())]

    def _complete(self, output: SchedulerOutput, sampled: dict[str, int],
                  accepted: dict[str, Sequence[int]] | None = None) -> list[Request]:
        finished: list[Request] = []
        max_model_len = self.config.max_model_len
        accepted = accepted or {}
        waiting_finished = False
        for s in output.scheduled:
            request = s.request
            if request.is_finished:
                continue
            running = request.status is RequestStatus.RUNNING
            rid = request.request_id
            if s.draft_token_ids and rid in sampled:
                append_verified(self.kv, s, accepted.get(rid, ()), sampled[rid], running,
                                max_model_len)
            else:
                if running:   # one preempted since (async scheduling) has no blocks to cache
                    self.kv.cache_full_blocks(request, s.start + s.num_tokens)
                if rid not in sampled:
                    continue
                if rid in output.forks:
                    finished += self._fork_children(request, sampled)
                append_token(request, sampled[rid], max_model_len)
            if request.is_finished:
                self._forget(request)
                finished.append(request)
                waiting_finished |= not running
        if waiting_finished:
            self._requests.discard_finished()
        if finished:
            self._drop_finished_running()
        return finished

    def observe_step(self, duration_s: float, num_decode_tokens: int) -> None:
        """Timing of one engine step, for the SLA policy (a no-op when it is off)."""
        if self._sla is not None:
            self._sla.observe(duration_s, num_decode_tokens)

    # ---- state -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._requests.num_waiting

    @property
    def num_running(self) -> int:
        return len(self._batch.running)

    def num_by_priority(self) -> tuple[list[int], list[int]]:
        """(running, waiting) request counts per priority class (index = class)."""
        running = [0] * self._requests.priority_levels
        for ticket in self._batch.running:
            running[ticket.priority] += 1
        return running, self._requests.num_waiting_by_class()

    @property
    def has_unfinished(self) -> bool:
        return self._requests.has_unfinished

    def unfinished_request_ids(self) -> list[str]:
        """Every unfinished request, siblings not forked yet included."""
        return self._requests.request_ids() + self._forks.held_ids()

    @property
    def running(self) -> tuple[Request, ...]:
        """Running requests in service order: (admitted level, arrival)."""
        return tuple(t.request for t in self._batch.running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting requests, next to be admitted first."""
        return tuple(t.request for t in self._requests.waiting())

    @property
    def num_steps(self) -> int:
        """schedule() calls so far: the clock of aging."""
        return self._requests.step

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def swap_stats(self) -> SwapStats:
        """A copy of the swap counters (all 0 in recompute mode)."""
        return replace(self._swap.stats) if self._swap is not None else SwapStats()

    @property
    def swap_space(self) -> SwapSpace | None:
        """The host-block bookkeeping of swap mode (None in recompute mode)."""
        return self._swap

    @property
    def max_num_seqs_now(self) -> int:
        """The sequence cap of the next step: max_num_seqs, or the SLA policy's cap."""
        return self._sla.cap if self._sla is not None else self.config.max_num_seqs

    @property
    def sla(self) -> SLABatchSizer | None:
        return self._sla

    def effective_priority(self, request_id: str) -> int | None:
        """A waiting request's aged priority as of the next step; a running one's admitted
        level; None when unknown or finished."""
        ticket = self._requests.get(request_id)
        if ticket is None:
            return None
        if ticket.request.status is RequestStatus.RUNNING:
            return ticket.level
        return self._requests.effective_priority(ticket)

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
        ticket = self._requests.get(request_id)
        return ticket.request if ticket is not None else self._forks.get(request_id)

    # ---- helpers ---------------------------------------------------------------------------

    def _forget(self, request: Request) -> None:
        self.kv.free(request)
        if self._swap is not None:
            self._swap.discard(request.request_id)
        self._requests.forget(request.request_id)

    def _start_forks(self, out: SchedulerOutput) -> None:
        """Put in flight the pending siblings of parents whose last prompt chunk is in `out`,
        as many as the sequence cap leaves room for; queue the others as ordinary requests."""
        free = self.max_num_seqs_now - len(self._batch.running)
        for s in out.scheduled:
            r = s.request
            rid = r.request_id
            if r.output_token_ids or r.num_computed_tokens + s.num_tokens < r.num_tokens \
                    or not self._forks.has_pending(rid):
                continue
            children = self._forks.take_pending(rid)
            k = max(0, min(len(children), free))
            free -= k
            for child in children[k:]:
                self._requests.add(child)
            if k:
                self._forks.start(rid, children[:k])
                out.forks[rid] = list(children[:k])

    def _fork_children(self, parent: Request, sampled: dict[str, int]) -> list[Request]:
        """Fork the parent's in-flight siblings (its prompt just computed, no token appended
        yet): shared blocks, the parent's computed count, their own sampled first token.
        Returns those that finished with that token."""
        finished: list[Request] = []
        level = self._requests.get(parent.request_id).level
        for child in self._forks.finish_step(parent.request_id):
            if child.is_finished:
                continue
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            ticket = self._requests.adopt(child, level)
            bisect.insort(self._batch.running, ticket, key=lambda t: (t.level, t.arrival))
            append_token(child, sampled[child.request_id], self.config.max_model_len)
            if child.is_finished:
                self._forget(child)
                finished.append(child)
        return finished

    def _drop_finished_running(self) -> None:
        self._batch.running[:] = [t for t in self._batch.running if not t.request.is_finished]
