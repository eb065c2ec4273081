"""EngineHistory: one sample of the engine's state per second over the last minutes.

The dashboard's charts read it, so a page opened now still shows the last five minutes.
A task of the app (started on startup, cancelled on cleanup) takes a sample every
`interval_s` from the engine core's latest report (AsyncEngine.stats). Invariants: samples
are in time order; at most `max_samples` are kept (the oldest dropped first); rates are
derived from consecutive samples of cumulative counters, so a missed tick only widens the
interval, it never loses tokens.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from tessellm.engine.async_engine import AsyncEngine


@dataclass(frozen=True, slots=True)
class EngineSample:
    t: float                 # time.time() of the sample
    running: int
    waiting: int
    kv_usage: float          # 0..1
    generation_tokens: int   # cumulative
    prompt_tokens: int       # cumulative
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int


def take_sample(engine: AsyncEngine, now: float | None = None) -> EngineSample:
    s = engine.stats
    return EngineSample(time.time() if now is None else now, s.num_running, engine.num_waiting,
                        s.kv_usage, s.num_generated_tokens, s.num_prompt_tokens,
                        s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions)


def rate(a: EngineSample, b: EngineSample, field: str) -> float:
    """Per-second increase of a cumulative field from sample a to the later sample b."""
    dt = b.t - a.t
    return (getattr(b, field) - getattr(a, field)) / dt if dt > 0 else 0.0


class EngineHistory:
    def __init__(self, engine: AsyncEngine, interval_s: float = 1.0,
                 max_samples: int = 300) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.samples: deque[EngineSample] = deque(maxlen=max_samples)
        self._task: asyncio.Task | None = None

    def sample(self, now: float | None = None) -> EngineSample:
        s = take_sample(self.engine, now)
        self.samples.append(s)
        return s

    def points(self) -> list[dict[str, float]]:
        """The samples as chart points: generated and prompt tokens/s over the interval that
        ends at each sample (the first sample has no interval and is left out)."""
        out = []
        prev = None
        for s in self.samples:
            if prev is not None:
                out.append({"t": s.t, "running": s.running, "waiting": s.waiting,
                            "kv_usage": s.kv_usage,
                            "gen_tps": rate(prev, s, "generation_tokens"),
                            "prompt_tps": rate(prev, s, "prompt_tokens")})
            prev = s
        return out

    def recent_rate(self, field: str, span_s: float = 5.0) -> float:
        """Per-second increase of `field` over the last ~span_s seconds of samples, up to the
        engine's state right now."""
        now = take_sample(self.engine)
        start = None
        for s in reversed(self.samples):
            start = s
            if now.t - s.t >= span_s:
                break
        return rate(start, now, field) if start is not None else 0.0

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
