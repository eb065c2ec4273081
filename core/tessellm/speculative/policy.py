"""Never slower: which proposals a step takes, from measured costs and acceptance.

Per request, `Acceptance` keeps decayed counts of draft trials: a verify step with d drafts of
which a were accepted is a accepted trials and, when a < d, one rejected one (the trials
after a rejection never happen). alpha = the per-token acceptance estimate (a Beta prior of
strength 2 around the method's running alpha), and d drafts are worth
E(d) = alpha + alpha^2 + .. + alpha^d expected extra tokens.

Per step, `StepCosts` keeps the measured seconds of steps by token count, apart for steps with
and without drafts (a verify step may run another path than a decode step: eager rows instead
of a captured graph or native program). A costly proposer's (a draft model's) time is not in
them: `proposal_cost` is its EMA per step in the steady state (every request it drafts for
had drafts the step before, so the draft catches up at most k + 1 tokens) and is added to a
step with drafts; a first proposal or one after refused steps also catches up the prompt or
the tokens since, a one-off the estimate leaves out (it would price the steady state at the
cost of a prompt prefill and refuse forever). A step of T tokens that decodes N requests yields
N tokens in c_plain(T) without drafts; taking proposals of D tokens worth E in all yields
N + E tokens in c_spec(T + D). Proposals are taken, best E(d) / d first, each cut to the
length (1 .. its own) that gives the step the best tokens per second, while that improves on
the step without it; a verify step of a size not measured yet is taken, and while the plain
step's cost is unknown proposals whose cost is known are not (explore both, then learn). Under load
(compute-bound steps, where c grows with T) the same rule takes fewer drafts or none.

A request whose proposals were refused `probe_interval` steps in a row is taken once anyway
(cut to the length whose measured cost pays best), so its estimate follows a text that becomes
predictable again. Each probe doubles the request's interval (up to MAX_BACKOFF times
probe_interval) and a proposal taken on its merit resets it, so on a text where drafts never
pay the probes cost one verify step in ever more steps (a draft model's probe also catches up
every token since its last draft).
"""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8          # weight of the past in the acceptance counts, per verify step
COST_DECAY = 0.8     # weight of the past in a step-cost estimate
PRIOR_STRENGTH = 2.0
MAX_BACKOFF = 16     # a refused request is probed at least every 16 x probe_interval steps


def token_bucket(num_tokens: int) -> int:
    """Exact up to 32 tokens, then the next power of two."""
    return num_tokens if num_tokens <= 32 else 1 << (num_tokens - 1).bit_length()


@dataclass(slots=True)
class Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    refused_steps: int = 0   # consecutive steps the policy left this request's drafts out
    backoff: int = 1         # probe after probe_interval x backoff refused steps

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)

    def alpha(self, prior: float) -> float:
        return (self.accepted + PRIOR_STRENGTH * prior) / (
            self.accepted + self.rejected + PRIOR_STRENGTH)

    def expected(self, drafts: int, prior: float) -> float:
        """Expected accepted drafts out of `drafts`."""
        a = self.alpha(prior)
        total, term = 0.0, 1.0
        for _ in range(drafts):
            term *= a
            total += term
        return total


class StepCosts:
    """EMA of step seconds per (token bucket, with drafts)."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, bool], float] = {}

    def observe(self, num_tokens: int, with_drafts: bool, seconds: float) -> None:
        key = (token_bucket(num_tokens), with_drafts)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds

    def estimate(self, num_tokens: int, with_drafts: bool) -> float | None:
        return self._seconds.get((token_bucket(num_tokens), with_drafts))


@dataclass(slots=True)
class Candidate:
    """A request's proposal this step (`acceptance` is its own, request.speculation's)."""

    request: object
    drafts: list[int]
    acceptance: Acceptance


class SpeculationPolicy:
    def __init__(self, adaptive: bool = True, probe_interval: int = 16,
                 costly: bool = False) -> None:
        self.adaptive = adaptive
        self.costly = costly   # the proposer's time is priced apart (observe_proposal)
        self.probe_interval = probe_interval
        self.costs = StepCosts()
        self.method_alpha = Acceptance()   # over every request: the prior of a new one
        self.proposal_cost: float | None = None   # a costly proposer's seconds a step

    def observe_proposal(self, seconds: float) -> None:
        """A costly proposer's steady-state seconds for one step's proposals."""
        old = self.proposal_cost
        self.proposal_cost = seconds if old is None else \
            COST_DECAY * old + (1 - COST_DECAY) * seconds

    def prior(self) -> float:
        return self.method_alpha.alpha(0.5)

    def probe_due(self, acceptance: Acceptance) -> bool:
        """Whether a refused request's next proposal is taken anyway (a probe)."""
        return acceptance.refused_steps >= self.probe_interval * acceptance.backoff

    def _best_length(self, c: Candidate, num_decodes: int, num_tokens: int, gain: float,
                     extra: int, best: float | None, prior: float
                     ) -> tuple[int, float, float | None, bool]:
        """How many of c's drafts to take (0: none), their expected accepted tokens, the
        step's rate with them (None: not measured or a probe), and whether it is a probe. A
        verify step of the whole proposal not measured yet is explored; while the plain step
        is not measured, nothing is taken; a refused request whose probe is due is probed at
        its best length."""
        whole = len(c.drafts)
        if self.costs.estimate(num_tokens + extra + whole, True) is None \
                or (self.costly and self.proposal_cost is None):
            return whole, c.acceptance.expected(whole, prior), None, False
        if best is None:
            return 0, 0.0, None, False
        chosen, chosen_e, chosen_rate = 0, 0.0, best
        probe, probe_rate = whole, 0.0
        for d in range(1, whole + 1):
            cost = self.costs.estimate(num_tokens + extra + d, True)
            if cost is None:
                continue
            if self.costly:
                cost += self.proposal_cost
            e = c.acceptance.expected(d, prior)
            rate = (num_decodes + gain + e) / cost
            if rate > chosen_rate:
                chosen, chosen_e, chosen_rate = d, e, rate
            if rate > probe_rate:
                probe, probe_rate = d, rate
        if not chosen and self.probe_due(c.acceptance):
            # a probe, so the estimate follows the text: at the length that would pay best
            return probe, c.acceptance.expected(probe, prior), None, True
        return chosen, chosen_e, chosen_rate if chosen else None, False

    def choose(self, candidates: list[Candidate], num_decodes: int, num_tokens: int
               ) -> list[Candidate]:
        """The candidates whose drafts this step takes (see the module docstring); the step
        would otherwise compute `num_tokens` tokens and decode `num_decodes` requests."""
        if not self.adaptive or not candidates:
            return candidates
        prior = self.prior()
        plain = self.costs.estimate(num_tokens, False)
        ranked = sorted(candidates, key=lambda c: -c.acceptance.expected(len(c.drafts), prior)
                        / len(c.drafts))
        taken: list[Candidate] = []
        gain, extra = 0.0, 0
        best = None if plain is None else num_decodes / plain
        for c in ranked:
            d, e, rate, probe = self._best_length(c, num_decodes, num_tokens, gain, extra, best,
                                                  prior)
            if d:
                del c.drafts[d:]
                taken.append(c)
                gain += e
                extra += d
                c.acceptance.refused_steps = 0
                if probe:
                    c.acceptance.backoff = min(2 * c.acceptance.backoff, MAX_BACKOFF)
                if rate is not None:   # taken on its merit
                    best = rate
                    c.acceptance.backoff = 1
            else:
                c.acceptance.refused_steps += 1
        return taken
