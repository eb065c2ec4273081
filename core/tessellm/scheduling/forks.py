"""Request groups (n > 1): siblings that fork from a parent's computed prompt (copy-on-write).

A group is one parent request, queued normally, and its sibling requests (same prompt), which
wait here, outside the queue, until the step that computes the parent's last prompt chunk:

    pending     added with the parent; no ticket, no blocks, not in the waiting queue
    in flight   the parent's last prompt chunk is scheduled: the siblings ride in
                SchedulerOutput.forks[parent id] and sample their first token from the
                parent's logits row (the runner repeats it, each with its own params)
    forked      update_from_output: kv.fork(parent, sibling) shares every prompt block (the
                partial last one too; tessellm.cache.kv_manager copies it before a write), the
                sibling runs with the parent's computed count and appends its sampled token

Only as many siblings go in flight as there are free sequence slots in that step; the others
are queued as ordinary requests then (they recompute, or hit the prefix cache). If the parent
finishes before its siblings are forked (abort, error), the siblings are queued as ordinary
requests too: a sibling never depends on a parent that is gone.

Invariants: a sibling is in at most one group, either pending or in flight, and in neither
once it has a ticket; a group's parent is unfinished while it has pending siblings; the
siblings hold no KV blocks until forked.
"""
from __future__ import annotations

from tessellm.errors import InvalidRequestError
from tessellm.request import Request, RequestStatus


class ForkGroups:
    __slots__ = ("_pending", "_in_flight")

    def __init__(self) -> None:
        self._pending: dict[str, list[Request]] = {}     # parent id -> waiting siblings
        self._in_flight: dict[str, list[Request]] = {}   # parent id -> siblings of this step

    def add(self, parent: Request, children: list[Request]) -> None:
        """Hold `children` until `parent`'s prompt is computed. Raises InvalidRequestError
        for a sibling that is not fresh, shares an id, or has another prompt or priority."""
        ids = {parent.request_id}
        for child in children:
            cid = child.request_id
            if cid in ids or self.get(cid) is not None:
                raise InvalidRequestError(f"request id {cid!r} is used twice in a group")
            ids.add(cid)
            if child.status is not RequestStatus.WAITING or child.num_computed_tokens != 0 \
                    or child.output_token_ids:
                raise InvalidRequestError(f"request {cid!r} must be fresh to join a group")
            if child.prompt_token_ids != parent.prompt_token_ids:
                raise InvalidRequestError(
                    f"request {cid!r} must have the prompt of its parent {parent.request_id!r}")
            if child.priority != parent.priority or child.cache_salt != parent.cache_salt:
                raise InvalidRequestError(
                    f"request {cid!r} must have the priority and cache salt of its parent")
        if children:
            self._pending.setdefault(parent.request_id, []).extend(children)

    def has_pending(self, parent_id: str) -> bool:
        return parent_id in self._pending

    def take_pending(self, parent_id: str) -> list[Request]:
        """The parent's pending siblings, no longer held ([] when none)."""
        return self._pending.pop(parent_id, [])

    def start(self, parent_id: str, children: list[Request]) -> None:
        """`children` ride in this step's output for `parent_id`."""
        if children:
            self._in_flight[parent_id] = children

    def finish_step(self, parent_id: str) -> list[Request]:
        """The parent's in-flight siblings, no longer held ([] when none)."""
        return self._in_flight.pop(parent_id, [])

    def get(self, request_id: str) -> Request | None:
        """A sibling held here (pending or in flight), or None."""
        for groups in (self._pending, self._in_flight):
            for children in groups.values():
                for child in children:
                    if child.request_id == request_id:
                        return child
        return None

    def remove(self, request_id: str) -> Request | None:
        """Take a held sibling out of its group (it is being finished); None if not held."""
        for groups in (self._pending, self._in_flight):
            for parent_id, children in list(groups.items()):
                for i, child in enumerate(children):
                    if child.request_id == request_id:
                        del children[i]
                        if not children and groups is self._pending:
                            del groups[parent_id]
                        return child
        return None

    def held_ids(self) -> list[str]:
        """Ids of every sibling held here (pending or in flight)."""
        return [c.request_id for groups in (self._pending, self._in_flight)
                for children in groups.values() for c in children]

    @property
    def num_pending(self) -> int:
        return sum(map(len, self._pending.values()))

    def __bool__(self) -> bool:
        return bool(self._pending or self._in_flight)
