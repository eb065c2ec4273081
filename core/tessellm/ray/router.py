"""Choosing the replica for a request: least-loaded, or prefix-aware with a balance cap.

A replica's load is its open requests (running + waiting) as the front end knows them, so a
burst is counted before any core reports it. Least-loaded: the smallest load; ties go round
robin (a rotating start), so an idle set spreads requests. Prefix-aware: the replica whose
PrefixIndex holds the longest leading run of the prompt's block hashes; ties and a miss
(no replica holds the first block) fall back to least-loaded among the tied; and, as SGLang's
cache-aware router does, the prefix is ignored while it would overload its replica: when that
replica's load exceeds the least-loaded one's by more than `balance_abs` requests and is more
than `balance_rel` times it, the request goes to the least-loaded replica instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tessellm.errors import ConfigError

ROUTING_POLICIES = ("least-loaded", "prefix-aware")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica in rotation as the router sees it."""

    index: int        # the replica's position in the set
    load: int         # open requests
    matched: int = 0  # leading prompt blocks its prefix cache holds (prefix-aware only)


@dataclass
class Router:
    policy: str = "least-loaded"
    balance_abs: int = 16
    balance_rel: float = 1.5
    _next: int = field(default=0, init=False)   # round-robin start among ties

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ConfigError(f"unknown data-parallel routing {self.policy!r}; one of "
                              f"{', '.join(ROUTING_POLICIES)}")
        if self.balance_abs < 0 or self.balance_rel < 1:
            raise ConfigError("the routing balance cap needs balance_abs >= 0 and "
                              "balance_rel >= 1")

    @property
    def uses_prefixes(self) -> bool:
        return self.policy == "prefix-aware"

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        low = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == low]
        choice = tied[self._next % len(tied)]
        self._next += 1
        return choice

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate to send the request to (at least one is needed)."""
        if not candidates:
            raise ValueError("no replica to route to")
        least = self._least_loaded(candidates)
        if not self.uses_prefixes:
            return least
        best = max(c.matched for c in candidates)
        if best == 0:
            return least
        holders = [c for c in candidates if c.matched == best]
        choice = least if least in holders else self._least_loaded(holders)
        if choice.load > least.load + self.balance_abs and \
                choice.load > self.balance_rel * least.load:
            return least
        return choice
