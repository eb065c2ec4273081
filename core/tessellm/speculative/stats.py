"""Counters of speculation, per method (the engine's /metrics and dashboard read them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecStats:
    """`verify_steps`: request-steps that carried drafts; `draft_tokens` proposed and
    scheduled; `accepted_tokens` of them accepted. Proposals the policy left out count in
    `refused_proposals` only."""

    method: str = ""
    proposals: int = 0           # requests given a non-empty proposal by the proposer
    refused_proposals: int = 0   # ... left out by the policy (or the token budget)
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step gives a request on average: accepted drafts + 1."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0
