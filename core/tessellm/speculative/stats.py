"""Counters of speculation, per method (the engine's /metrics and dashboard read them).

On the wire (engine_core.CoreStats) they are the same fields prefixed `spec_`
(`to_wire` / `from_wire`); the rates are derived here only."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


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

    def to_wire(self) -> dict[str, Any]:
        """The counters as CoreStats fields (`spec_` + name)."""
        return {f"spec_{k}": v for k, v in asdict(self).items()}

    @classmethod
    def from_wire(cls, stats: Any) -> SpecStats | None:
        """The counters of a CoreStats; None when its engine does not speculate."""
        if not stats.spec_method:
            return None
        return cls(**{f.name: getattr(stats, f"spec_{f.name}") for f in fields(cls)})
