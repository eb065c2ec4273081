"""Where an engine's time goes, per op kind and per stage (`tessellm bench ... --profile`).

While an `OpProfile` is active, every kernel site of the plan (attention's write, decode and
prefill sites included) and every structural instruction is wrapped in a timer that
synchronizes the device before and after the call, so each op's time is its own even on an
asynchronous device; stage times come from the engine's StageTimes. The wrapping perturbs
what it measures (one timer and two synchronizations per op), so benchmarks time their runs
without it and profile a separate run. A compiled form of the plan that reports its own time
(a `profile_sink` attribute: the CPU plugin's native decode programs) is handed this profile
as its PlanProfileSink: it adds its kernels' time per op and its host time around them
(crossings into native code, barriers between kernels, Python nodes), reported under
"host_ms_per_step". Other compiled forms (CUDA graph replays) call no op and are not
attributed; XLA steps attribute tracing, not execution.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any, Callable

from tessellm.engine.llm_engine import LLMEngine
from tessellm.graph.lowering import AttentionSite, KernelSite

STRUCTURAL = "structural (views, splits, getitem)"


class _Timed:
    __slots__ = ("fn", "kind", "profile")

    def __init__(self, fn: Callable[..., Any], kind: str, profile: "OpProfile") -> None:
        self.fn, self.kind, self.profile = fn, kind, profile

    @property
    def __wrapped__(self) -> Callable[..., Any]:   # what a recording keeps (functools' rule)
        return self.fn

    def __getattr__(self, name: str) -> Any:   # the site's own API (kernels_for, op, ...)
        return getattr(self.fn, name)

    def __call__(self, *args: Any) -> Any:
        p = self.profile
        p.synchronize()
        t0 = time.perf_counter()
        out = self.fn(*args)
        p.synchronize()
        p.seconds[self.kind] += time.perf_counter() - t0
        p.calls[self.kind] += 1
        return out


class OpProfile:
    """Context manager over one engine: per op kind seconds and calls, per stage seconds and
    the steps run while it was active; the plan is restored on exit."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.synchronize = engine.parts.device.synchronize
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.host_seconds: dict[str, float] = defaultdict(float)
        self._restore: list[Callable[[], None]] = []

    # PlanProfileSink: what a compiled plan reports
    def kernel(self, kind: str, seconds: float, calls: int = 1) -> None:
        self.seconds[kind] += seconds
        self.calls[kind] += calls

    def host(self, kind: str, seconds: float) -> None:
        self.host_seconds[kind] += seconds

    def _wrap_attr(self, owner: Any, attr: str, kind: str) -> None:
        fn = getattr(owner, attr)
        setattr(owner, attr, _Timed(fn, kind, self))
        self._restore.append(lambda: setattr(owner, attr, fn))

    def __enter__(self) -> "OpProfile":
        for ins in self.engine.parts.plan.instructions:
            if isinstance(ins.fn, AttentionSite):
                for part in ("write", "decode", "prefill"):
                    site = getattr(ins.fn, part)
                    self._wrap_attr(ins.fn, part, site.op)
            else:
                kind = ins.fn.op if isinstance(ins.fn, KernelSite) else STRUCTURAL
                self._wrap_attr(ins, "fn", kind)
        shapes = self.engine.runner.shapes
        shapes.set_profile_sink(self)
        self._restore.append(lambda: shapes.set_profile_sink(None))
        self._stages0 = self.engine.stage_times.snapshot()
        self._steps0 = self.engine.stats.num_steps
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stages = {k: v - self._stages0.get(k, 0.0)
                       for k, v in self.engine.stage_times.snapshot().items()}
        self.steps = self.engine.stats.num_steps - self._steps0
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def report(self) -> dict[str, Any]:
        """{"steps", "ops": {kind: ms/step, calls/step, share of op time}, "stages": ms/step},
        ops sorted by time."""
        steps = max(1, self.steps)
        total = sum(self.seconds.values()) or 1.0
        ops = {kind: {"ms_per_step": round(s / steps * 1e3, 3),
                      "calls_per_step": round(self.calls[kind] / steps, 2),
                      "share": round(s / total, 3)}
               for kind, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        stages = {k: round(v / steps * 1e3, 3) for k, v in self.stages.items()}
        report = {"steps": self.steps, "ops": ops, "stages_ms_per_step": stages}
        if self.host_seconds:
            report["host_ms_per_step"] = {k: round(v / steps * 1e3, 3)
                                          for k, v in sorted(self.host_seconds.items(),
                                                             key=lambda kv: -kv[1])}
        return report
