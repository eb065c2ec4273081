"""The Proposer protocol, the built-in proposers, and those plugins register.

A proposer fills draft tokens for a batch of running requests once per engine step, before the
scheduler runs. What it may read of a request: `request_id`, `prompt_token_ids`,
`output_token_ids` (the last one sampled, its KV not computed yet), `params` (SamplingParams),
and `speculation.state`, a slot for its own per-request state, which follows the request
through preemption and is dropped with it. `release` is called once a request finishes (a
proposer holding device memory for it, a draft model's KV blocks, frees it there; one that
learns across requests reads its tokens there). Drafts must be deterministic given what the
proposer has seen (see tessellm.speculative.verification: that is what makes verification
exact); wrong drafts cost time, never correctness.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tessellm.errors import ConfigError
from tessellm.speculative.config import SpeculativeConfig
from tessellm.speculative.ngram import NgramIndex


class Proposer(Protocol):
    """`costly` (optional, default False): proposing costs a real share of a step (a draft
    model), so the speculator asks only for the requests its policy takes, at the lengths it
    chose; a cheap proposer (prompt lookup) is asked for every eligible request first, and the
    policy sees the actual proposals."""

    method: str

    def propose(self, requests: Sequence[Any], max_drafts: Sequence[int]) -> list[list[int]]:
        """Draft tokens for each request: at most max_drafts[i] (>= 1) for requests[i], []
        for none. Each request's last token is sampled and not computed yet."""

    def release(self, request: Any) -> None:
        """The request finished: drop what the proposer holds for it."""


# (config, engine parts) -> a Proposer; plugins return {method name: factory}
ProposerFactory = Callable[[SpeculativeConfig, Any], Proposer]


class NgramProposer:
    """Prompt lookup over each request's own prompt and output (tessellm.speculative.ngram)."""

    method = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Sequence[Any], max_drafts: Sequence[int]) -> list[list[int]]:
        out = []
        for request, k in zip(requests, max_drafts):
            state = request.speculation
            index = state.state
            if index is None:
                index = state.state = NgramIndex(self.min_n, self.max_n)
            known = request.num_known_tokens
            if index.num_indexed < known:
                index.extend(request.token_ids_slice(index.num_indexed, known))
            out.append(index.propose(k))
        return out

    def release(self, request: Any) -> None:
        return None


def _draft_model(config: SpeculativeConfig, parts: Any) -> Proposer:
    from tessellm.speculative.draft_model import DraftModelProposer   # builds an engine
    return DraftModelProposer(config, parts)


def builtin_proposers() -> dict[str, ProposerFactory]:
    return {"ngram": lambda config, parts: NgramProposer(config), "draft_model": _draft_model}


def known_proposer(method: str, plugin_proposers: dict[str, ProposerFactory] | None = None
                   ) -> ProposerFactory:
    """The factory of `method`: built in, or registered by a plugin. Raises ConfigError for
    an unknown method, naming the known ones."""
    known = {**(plugin_proposers or {}), **builtin_proposers()}
    factory = known.get(method)
    if factory is None:
        raise ConfigError(f"unknown speculative method {method!r}; known: {sorted(known)}")
    return factory


def make_proposer(config: SpeculativeConfig, parts: Any,
                  plugin_proposers: dict[str, ProposerFactory] | None = None) -> Proposer:
    """The proposer `config.method` names (see known_proposer), built for the engine."""
    proposer = known_proposer(config.method, plugin_proposers)(config, parts)
    if not callable(getattr(proposer, "propose", None)) or \
            not callable(getattr(proposer, "release", None)):
        raise ConfigError(f"speculative method {config.method!r}: its factory returned "
                          f"{proposer!r}, which lacks propose() or release()")
    return proposer
