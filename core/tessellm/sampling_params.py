"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError
from tessellm.speculative.config import MAX_SPECULATIVE_TOKENS

MAX_LOGPROBS = 20  # the most top tokens a request may ask logprobs for (OpenAI's cap)
MAX_STOP_STRINGS = 16  # the most stop strings a request may carry (the server's schema too)
# Temperatures in (0, MIN_TEMPERATURE) are greedy: logits / 1e-37 overflow float32 to inf and
# the softmax to NaN, and long before that sampling equals greedy (vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
MAX_LOGIT_BIAS = 100.0      # |bias| (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 4096


def _int64(name: str, value: object, param: str | None = None) -> int:
    """`value` as an int in the int64 range (what crosses into the core and its tensors)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param or name)
    if not INT64_MIN <= value <= INT64_MAX:
        raise InvalidRequestError(f"{name} must fit in 64 bits (|{name}| < 2**63), got "
                                  f"{value}", param or name)
    return value


def _real(name: str, value: object) -> float:
    """`value` as a finite float, or InvalidRequestError (bools and non-numbers are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    try:
        as_float = float(value)
    except OverflowError:   # an int beyond float's range
        as_float = math.inf
    if not math.isfinite(as_float):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    return as_float


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
    unique = list(dict.fromkeys(items))
    if len(unique) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got "
                                  f"{len(unique)}", "stop")
    return unique


def _logit_bias(bias: object) -> dict[int, float] | None:
    """{token id: finite bias in [-100, 100]} (ids may arrive as strings: JSON keys); None
    when empty."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got "
                                  f"{type(bias).__name__}", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias has {len(bias)} entries; at most "
                                  f"{MAX_LOGIT_BIAS_ENTRIES}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                          "logit_bias") from None
        token = _int64("logit_bias token id", key, "logit_bias")
        v = _real("logit_bias value", value)
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {v} for "
                                      f"token {token}", "logit_bias")
        out[token] = v
    return out or None


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature == 0 means greedy, and so does any temperature below MIN_TEMPERATURE (1e-5; it
    is stored as 0). Every number must be finite; integers must fit in 64 bits.
    top_k <= 0 (or None) disables top-k; top_p == 1 and
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

    `logit_bias`: {token id: bias in [-100, 100]} added to the logits after the penalties
    (OpenAI's semantics; ids are checked against the vocabulary by the engine).
    `prompt_logprobs`: None returns none; k returns, for every prompt token after the first,
    its logprob given the tokens before it and the k most likely tokens there (vLLM's
    semantics; the prompt is then computed in full, without prefix-cache hits).
    `structured_outputs`: a constraint on the output (tessellm.constraints: a JSON schema, any
    JSON object, a regex, a choice, a grammar); tokens that would break it get -inf after the
    logit bias, so greedy, sampling and logprobs all see only allowed tokens, and a complete
    constrained output finishes the request (reason "stop").
    `num_speculative_tokens`: this request's cap on draft tokens per step on an engine that
    speculates (tessellm.speculative): None takes the engine's k, 0 turns speculation off
    for it, 1..k lowers it (more than the engine's k is refused by the engine). Outputs are
    the same either way; only speed changes.
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
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if _int64("max_tokens", self.max_tokens) < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got "
                                      f"{self.max_tokens!r}", "max_tokens")
        self.temperature = _real("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}",
                                      "temperature")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.top_k is not None:
            _int64("top_k", self.top_k)
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        self.min_p = _real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None:
            _int64("seed", self.seed)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
                self.stop_token_ids or [], (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got "
                                      f"{self.stop_token_ids!r}", "stop_token_ids")
        self.stop_token_ids = [_int64("stop_token_ids", t) for t in self.stop_token_ids or []]
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
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(f"prompt_logprobs must be None or an integer in "
                                      f"[0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
                                      "prompt_logprobs")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise InvalidRequestError(f"num_speculative_tokens must be None or an integer in "
                                      f"[0, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
                                      "num_speculative_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any penalty would change the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
