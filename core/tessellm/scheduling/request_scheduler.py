"""Request scheduler: admission, priority classes and aging (the waiting side of the house).

Every unfinished request has a Ticket: its arrival order (the order of add_request, unique),
the scheduler step it arrived at, its priority class (0 is the most urgent, up to
priority_levels - 1) and, while it runs, the level it was admitted with.

Effective priority. A request's effective priority at step `now` is

    max(0, priority - (now - arrival_step) // aging_interval_steps)      (aging on)
    priority                                                             (interval 0: off)

so a request gains one level per aging_interval_steps scheduler steps since it arrived, until
it reaches 0: low priority cannot starve forever. Steps, not seconds: they are deterministic
(tests, the simulator's virtual clock) and the engine steps whenever a request is running, so
while a request waits behind others, steps pass. Aging counts from arrival, not from the last
time the request was queued; that is what lets a preempted request keep its place.

The effective priority is what counts everywhere: for the waiting order and for evictions (an
aged request may evict running requests whose admitted level is worse than its aged one), and
a request keeps the level it was admitted with while it runs, so it is not evicted at once by
the requests it overtook; aging then bounds the number of priority evictions a request
suffers, because once it is back at level 0 no waiting request outranks it.

Waiting order is (effective priority, arrival). Within one class the effective priority only
improves with age, so a class's earliest arrival is also its best entry; the queue is one heap
per class keyed by arrival, and the next request is the best of the class heads (O(levels)).

Invariants:
  * a request is in the queue iff it is unfinished and waiting (preempted requests are pushed
    back by the batch scheduler at the end of the step that preempted them, under their
    original arrival order, so they go ahead of every later arrival of the same class);
  * `tickets` holds exactly the unfinished requests; a ticket's arrival never changes;
  * the level stored on a ticket is meaningful only while it runs: the effective priority it
    was admitted with, frozen until it finishes or is preempted (aging never makes a running
    request easier to evict, and an aged request is not evicted by those it overtook).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from tessellm.cache.kv_groups import KVCache
from tessellm.errors import ConfigError, InvalidRequestError
from tessellm.request import Request, RequestStatus, max_kv_tokens

MAX_PRIORITY_LEVELS = 64


@dataclass(slots=True, eq=False)
class Ticket:
    """The scheduler's record of one unfinished request."""

    request: Request
    arrival: int          # order of add_request (unique, increasing)
    arrival_step: int     # scheduler steps completed when it arrived
    priority: int         # its class, 0 = most urgent
    level: int            # while running: the effective priority it was admitted with

    @property
    def request_id(self) -> str:
        return self.request.request_id


class RequestScheduler:
    __slots__ = ("priority_levels", "aging_interval_steps", "max_model_len", "_kv", "_tickets",
                 "_heaps", "_num_waiting", "_next_arrival", "step", "_step_tokens")

    def __init__(self, priority_levels: int, aging_interval_steps: int, max_model_len: int,
                 kv: KVCache, step_tokens: int = 0) -> None:
        """`step_tokens`: the most tokens a step computes (a windowed block-table group holds
        at most its window's bound for it; 0: one)."""
        if not isinstance(priority_levels, int) or not 1 <= priority_levels <= MAX_PRIORITY_LEVELS:
            raise ConfigError(f"priority_levels must be an integer in 1..{MAX_PRIORITY_LEVELS}, "
                              f"got {priority_levels!r}")
        if not isinstance(aging_interval_steps, int) or aging_interval_steps < 0:
            raise ConfigError(f"aging_interval_steps must be an integer >= 0 (0: no aging), "
                              f"got {aging_interval_steps!r}")
        self.priority_levels = priority_levels
        self.aging_interval_steps = aging_interval_steps
        self.max_model_len = max_model_len
        self._kv = kv
        self._step_tokens = step_tokens
        self._tickets: dict[str, Ticket] = {}
        self._heaps: list[list[tuple[int, Ticket]]] = [[] for _ in range(priority_levels)]
        self._num_waiting = 0
        self._next_arrival = 0
        self.step = 0   # scheduler steps completed; the clock of aging

    # ---- admission -------------------------------------------------------------------------

    def add(self, request: Request) -> Ticket:
        """Queue a new request. It was validated where it entered (RequestLimits); raises
        InvalidRequestError only for an id already in the scheduler."""
        self.check(request)
        p = request.priority
        ticket = Ticket(request, self._next_arrival, self.step, p, p)
        self._next_arrival += 1
        self._tickets[request.request_id] = ticket
        self.push(ticket)
        return ticket

    def check(self, request: Request) -> None:
        """Raise InvalidRequestError if the request's id is in the scheduler already. Asserts
        what validation promised: a fresh request of a known priority class whose prompt is
        shorter than max_model_len and whose KV fits the pool alone (the progress invariant
        of tessellm.scheduler rests on it)."""
        rid = request.request_id
        if rid in self._tickets:
            raise InvalidRequestError(f"request id {rid!r} is already in the scheduler")
        assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0, rid
        assert 0 <= request.priority < self.priority_levels, (rid, request.priority)
        assert 0 < request.num_prompt_tokens < self.max_model_len, rid
        assert self._kv.max_held_blocks(max_kv_tokens(
            request.num_prompt_tokens, request.params.max_tokens, self.max_model_len),
            self._step_tokens) <= self._kv.num_blocks, rid

    def adopt(self, request: Request, level: int) -> Ticket:
        """A ticket for a request that starts running without queueing (a forked sibling,
        see tessellm.scheduling.forks), admitted at `level`; the caller puts it in `running`.
        It arrives now: among equals it is the latest arrival."""
        ticket = Ticket(request, self._next_arrival, self.step, request.priority, level)
        self._next_arrival += 1
        self._tickets[request.request_id] = ticket
        return ticket

    # ---- priorities ------------------------------------------------------------------------

    def effective_priority(self, ticket: Ticket) -> int:
        """The ticket's priority aged to the current step (see the module docstring)."""
        interval = self.aging_interval_steps
        if interval == 0 or ticket.priority == 0:
            return ticket.priority
        return max(0, ticket.priority - (self.step - ticket.arrival_step) // interval)

    # ---- the waiting queue -----------------------------------------------------------------

    def push(self, ticket: Ticket) -> None:
        """Queue a waiting request (new, or preempted: it keeps its arrival order)."""
        heapq.heappush(self._heaps[ticket.priority], (ticket.arrival, ticket))
        self._num_waiting += 1

    def peek(self) -> Ticket | None:
        """The next request to admit: least (effective priority, arrival); None if none."""
        best: Ticket | None = None
        best_key = (0, 0)
        for heap in self._heaps:
            if heap:
                head = heap[0][1]
                key = (self.effective_priority(head), head.arrival)
                if best is None or key < best_key:
                    best, best_key = head, key
        return best

    def pop(self, ticket: Ticket) -> None:
        """Take `ticket`, which peek() just returned, out of the queue."""
        heap = self._heaps[ticket.priority]
        if not heap or heap[0][1] is not ticket:
            raise InvalidRequestError(f"request {ticket.request_id!r} is not next in its class")
        heapq.heappop(heap)
        self._num_waiting -= 1

    def discard_finished(self) -> None:
        """Drop finished requests from the queue (after aborts)."""
        for i, heap in enumerate(self._heaps):
            kept = [e for e in heap if not e[1].request.is_finished]
            if len(kept) != len(heap):
                heapq.heapify(kept)
                self._heaps[i] = kept
        self._num_waiting = sum(map(len, self._heaps))

    def waiting(self) -> list[Ticket]:
        """Waiting tickets, next to be admitted first (as of the next step)."""
        entries = [t for heap in self._heaps for _, t in heap]
        return sorted(entries, key=lambda t: (self.effective_priority(t), t.arrival))

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def num_waiting_by_class(self) -> list[int]:
        """[i]: waiting requests of priority class i (their class, not their aged level)."""
        return [len(heap) for heap in self._heaps]

    # ---- bookkeeping -----------------------------------------------------------------------

    def get(self, request_id: str) -> Ticket | None:
        return self._tickets.get(request_id)

    def request_ids(self) -> list[str]:
        """Every unfinished request's id (waiting or running)."""
        return list(self._tickets)

    def forget(self, request_id: str) -> None:
        del self._tickets[request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._tickets)
