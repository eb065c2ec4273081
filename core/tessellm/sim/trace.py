"""Synthetic request traces: mixed priorities, shared prefixes, bursty arrivals.

Everything comes from one numpy Generator seeded with `seed`, so a trace is a pure function
of its TraceConfig. Requests arrive in bursts of `burst` at the same instant; bursts follow
a Poisson process of rate request_rate / burst (exponential gaps), so the average rate is
request_rate. Each request draws:

  * a priority class, uniform over 0 .. priorities - 1;
  * a prompt length uniform in [input_len // 2, input_len * 3 // 2] (at least 2) and an
    output length uniform in [output_len // 2, output_len * 3 // 2] (at least 1);
  * with probability shared_prefix_frac, one of num_prefixes fixed random prefixes of
    prefix_len tokens, which starts its prompt (cut to leave one token of its own at least);
    the rest of the prompt is random tokens.

Invariants: arrivals are non-decreasing; prompts have >= 2 tokens; token ids are in
[0, vocab_size); prompts that share a prefix have equal leading tokens, and random tails
make any other sharing vanishingly unlikely.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessellm.errors import ConfigError


@dataclass(slots=True, frozen=True)
class TraceConfig:
    num_requests: int = 10_000
    seed: int = 0
    priorities: int = 3
    request_rate: float = 60.0         # requests per virtual second, on average
    burst: int = 16                    # requests arriving at the same instant
    input_len: int = 256
    output_len: int = 64
    shared_prefix_frac: float = 0.5
    num_prefixes: int = 8
    prefix_len: int = 192
    vocab_size: int = 32_000

    def __post_init__(self) -> None:
        for name in ("num_requests", "priorities", "burst", "input_len", "output_len",
                     "num_prefixes", "prefix_len", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.request_rate > 0:
            raise ConfigError(f"request_rate must be > 0, got {self.request_rate!r}")
        if not 0.0 <= self.shared_prefix_frac <= 1.0:
            raise ConfigError(
                f"shared_prefix_frac must be in [0, 1], got {self.shared_prefix_frac!r}")


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    priority: int
    prefix_group: int      # -1: no shared prefix


def _uniform_len(rng: np.random.Generator, mean: int, minimum: int, n: int) -> np.ndarray:
    lo, hi = max(minimum, mean // 2), max(minimum, mean * 3 // 2)
    return rng.integers(lo, hi + 1, size=n)


def make_trace(cfg: TraceConfig) -> list[TraceRequest]:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    num_bursts = -(-n // cfg.burst)
    gaps = rng.exponential(cfg.burst / cfg.request_rate, size=num_bursts)
    burst_times = np.cumsum(gaps) - gaps[0]               # the first burst arrives at 0
    arrivals = np.repeat(burst_times, cfg.burst)[:n]
    priorities = rng.integers(0, cfg.priorities, size=n)
    prompt_lens = _uniform_len(rng, cfg.input_len, 2, n)
    output_lens = _uniform_len(rng, cfg.output_len, 1, n)
    shared = rng.random(n) < cfg.shared_prefix_frac
    groups = rng.integers(0, cfg.num_prefixes, size=n)
    prefixes = rng.integers(0, cfg.vocab_size, size=(cfg.num_prefixes, cfg.prefix_len))
    tails = rng.integers(0, cfg.vocab_size, size=int(prompt_lens.sum()))
    prefix_lists = [p.tolist() for p in prefixes]
    out: list[TraceRequest] = []
    pos = 0
    for i in range(n):
        length = int(prompt_lens[i])
        group = int(groups[i]) if shared[i] else -1
        head = prefix_lists[group][:min(cfg.prefix_len, length - 1)] if group >= 0 else []
        prompt = head + tails[pos:pos + length - len(head)].tolist()
        pos += length
        out.append(TraceRequest(float(arrivals[i]), prompt, int(output_lens[i]),
                                int(priorities[i]), group))
    return out
