"""RecentLatencies: the latencies of the last few minutes, for the dashboard's percentiles.

Prometheus histograms (metrics.py) are cumulative since start and bucketed; the dashboard
wants exact percentiles of what happened lately. Invariants: samples are kept in arrival
order (time.monotonic() never goes back), none older than `window_s` is reported, and at most
`max_samples` are held (the oldest are dropped first), so memory is bounded under any load.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    count: int
    percentiles: dict[int, float]   # p -> seconds (nearest rank); empty when count == 0

    def to_json(self) -> dict[str, object]:
        return {"count": self.count,
                **{f"p{p}": self.percentiles.get(p) for p in PERCENTILES}}


def nearest_rank(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (0 < p <= 100) of a non-empty sorted list, by nearest rank: the
    smallest value with at least p% of the values at or below it."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class RecentLatencies:
    def __init__(self, window_s: float = 300.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def observe(self, seconds: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def summary(self, now: float | None = None) -> LatencySummary:
        now = time.monotonic() if now is None else now
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        values = sorted(v for _, v in self._samples)
        if not values:
            return LatencySummary(0, {})
        return LatencySummary(len(values), {p: nearest_rank(values, p) for p in PERCENTILES})
