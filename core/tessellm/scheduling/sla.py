"""SLA-driven batch sizing (optional, off by default): the running-batch cap follows latency.

The engine reports every step with `observe(duration_s, num_decode_tokens)`. A step with at
least one decode is one inter-token latency (ITL) sample for each request it decoded: a
decoding request gets one token per step, so the step's duration is its ITL. Samples are
collected in windows of `window_steps` decode steps; at the end of each window:

    p99 ITL > itl_p99_s                    -> shrink: cap = max(min_num_seqs,
                                               floor(min(cap, largest decode batch seen) *
                                               shrink_factor)), and at least one lower
    otherwise, throughput < target (or no
    target given)                          -> grow: cap = min(max_num_seqs, cap + grow_step)
    otherwise                              -> keep

Throughput is the window's decode tokens over its decode steps' total duration. Shrinking
starts from the batch actually in use, so a cap far above the load is not shrunk in vain.
The cap only gates admission (a request already running is never preempted because the cap
fell; the batch shrinks as requests finish), and only fresh windows decide: a decision is
never based on samples taken before the previous one. p99 is the nearest-rank percentile.

Invariants: min_num_seqs <= cap <= max_num_seqs at all times; the cap changes only at the end
of a window, by one rule above; with no observations it stays max_num_seqs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tessellm.errors import ConfigError


@dataclass(slots=True, frozen=True)
class SLAConfig:
    """itl_p99_s: the latency SLA. target_tokens_per_s: grow only while the decode throughput
    is below it (None: whenever the SLA holds)."""

    itl_p99_s: float
    target_tokens_per_s: float | None = None
    window_steps: int = 64
    min_num_seqs: int = 1
    shrink_factor: float = 0.75
    grow_step: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.itl_p99_s, (int, float)) or not self.itl_p99_s > 0:
            raise ConfigError(f"itl_p99_s must be > 0 seconds, got {self.itl_p99_s!r}")
        t = self.target_tokens_per_s
        if t is not None and (not isinstance(t, (int, float)) or not t > 0):
            raise ConfigError(f"target_tokens_per_s must be > 0 or None, got {t!r}")
        for name in ("window_steps", "min_num_seqs", "grow_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0 < self.shrink_factor < 1:
            raise ConfigError(f"shrink_factor must be in (0, 1), got {self.shrink_factor!r}")


def p99(samples: list[float]) -> float:
    """Nearest-rank 99th percentile of a non-empty list."""
    ordered = sorted(samples)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class SLABatchSizer:
    __slots__ = ("config", "max_num_seqs", "cap", "num_shrinks", "num_grows", "last_p99_itl_s",
                 "last_tokens_per_s", "_itl", "_tokens", "_busy_s", "_largest_batch")

    def __init__(self, config: SLAConfig, max_num_seqs: int) -> None:
        if config.min_num_seqs > max_num_seqs:
            raise ConfigError(f"SLA min_num_seqs {config.min_num_seqs} exceeds max_num_seqs "
                              f"{max_num_seqs}")
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.cap = max_num_seqs
        self.num_shrinks = 0
        self.num_grows = 0
        self.last_p99_itl_s: float | None = None
        self.last_tokens_per_s: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._itl: list[float] = []
        self._tokens = 0
        self._busy_s = 0.0
        self._largest_batch = 0

    def observe(self, duration_s: float, num_decode_tokens: int) -> None:
        """One engine step: its duration and how many requests it decoded."""
        if duration_s < 0 or num_decode_tokens < 0:
            raise ConfigError(f"bad step observation ({duration_s!r} s, "
                              f"{num_decode_tokens!r} decode tokens)")
        if num_decode_tokens == 0:
            return
        self._itl.append(duration_s)
        self._tokens += num_decode_tokens
        self._busy_s += duration_s
        self._largest_batch = max(self._largest_batch, num_decode_tokens)
        if len(self._itl) >= self.config.window_steps:
            self._decide()

    def _decide(self) -> None:
        c = self.config
        latency = p99(self._itl)
        throughput = self._tokens / self._busy_s if self._busy_s > 0 else math.inf
        self.last_p99_itl_s, self.last_tokens_per_s = latency, throughput
        if latency > c.itl_p99_s:
            in_use = min(self.cap, self._largest_batch)
            new = min(math.floor(in_use * c.shrink_factor), in_use - 1)
            new = max(c.min_num_seqs, new)
            if new < self.cap:
                self.cap = new
                self.num_shrinks += 1
        elif c.target_tokens_per_s is None or throughput < c.target_tokens_per_s:
            new = min(self.max_num_seqs, self.cap + c.grow_step)
            if new > self.cap:
                self.cap = new
                self.num_grows += 1
        self._reset()
