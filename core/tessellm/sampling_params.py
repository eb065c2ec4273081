"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessellm.errors import InvalidRequestError

MAX_LOGPROBS = 20  # the most top tokens a request may ask logprobs for (OpenAI's cap)


def _real(name: str, value: object) -> float:
    """`value` as a finite float, or InvalidRequestError (bools and non-numbers are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _stop_strings(stop: object) -> list[str]:
    """`stop` as a list of distinct non-empty strings, in order (None: none)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestError(
            f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
    for s in items:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}",
                                      "stop")
    return list(dict.fromkeys(items))


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature == 0 means greedy. top_k <= 0 (or None) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. `seed` makes sampling reproducible for this request alone,
    whatever else runs in the same batch (the random draw depends on (seed, output position)).

    Penalties (applied to the logits before everything else; defaults disable them):
    - presence_penalty, frequency_penalty in [-2, 2] (OpenAI): subtract
      presence_penalty * (count > 0) + frequency_penalty * count, where count is how often the
      token occurs among the GENERATED tokens only.
    - repetition_penalty > 0 (Hugging Face / vLLM): every token seen in the prompt OR the
      generated tokens has its logit divided by the penalty if positive, multiplied if negative.
    `logprobs`: None returns none; k in [0, MAX_LOGPROBS] returns the sampled token's logprob
    and the k most likely tokens' logprobs (see tessellm.engine.sampler for which logits).

    `stop`: stop strings (a single string is a list of one), non-empty, duplicates dropped in
    order. The output ends right before the first one to appear, which is not returned
    (OpenAI's semantics; tessellm.engine.stop_strings); the token ids keep the tokens up to
    the one that completed it. `n`: samples of the prompt (LLM.generate; sample i seeded with
    seed + i). Neither changes what the sampler does for one sequence.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(f"logprobs must be None or an integer in "
                                      f"[0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        self.stop = _stop_strings(self.stop)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}", "n")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any penalty would change the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
