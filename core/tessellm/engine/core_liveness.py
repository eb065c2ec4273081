"""CoreLiveness: what the front end knows of the engine core's responsiveness.

A live core reports at least every HEARTBEAT_S (0.25 s): its step loop after every step and
while idle, its heartbeat thread while one step runs long (with that step's age). From the
time of the latest report and the step age it carried:

    silence    = now - last report
    step age   = reported step age + silence   (only while a step was running at that report)

    unresponsive: silence > heartbeat_timeout_s     (a frozen process: SIGSTOP, swapped out)
               or step age > stall_timeout_s        (a step loop that does not come back)
    stalled:      silence > stall_timeout_s or step age > stall_timeout_s

Unresponsive: /health answers 503 with the reason and new requests get 503. Stalled: the
requests in flight are failed too. A report from the core makes it responsive again at once.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tessellm.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LivenessConfig:
    heartbeat_timeout_s: float = 2.0   # silence past this: unhealthy, new requests refused
    stall_timeout_s: float = 60.0      # silence or one step past this: in-flight requests fail

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_timeout_s <= self.stall_timeout_s:
            raise ConfigError(f"the engine heartbeat timeout ({self.heartbeat_timeout_s} s) must "
                              f"be > 0 and at most the stall timeout ({self.stall_timeout_s} s)")


class CoreLiveness:
    def __init__(self, config: LivenessConfig = LivenessConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.last_heard = clock()
        self._step_age_at_report: float | None = None   # None: no step was running

    def heard(self, step_age_s: float | None = None) -> None:
        """A message from the core; `step_age_s` when it says a step is running."""
        self.last_heard = self._clock()
        self._step_age_at_report = step_age_s

    @property
    def silence_s(self) -> float:
        return max(0.0, self._clock() - self.last_heard)

    @property
    def step_age_s(self) -> float:
        """How long the core's current step has run (0 when none was running)."""
        if self._step_age_at_report is None:
            return 0.0
        return self._step_age_at_report + self.silence_s

    def _reason(self, silence_limit_s: float) -> str | None:
        silence, step_age = self.silence_s, self.step_age_s
        if silence > silence_limit_s:
            return f"the engine core has not reported for {silence:.1f} s"
        if step_age > self.config.stall_timeout_s:
            return f"the engine core's current step has run for {step_age:.1f} s"
        return None

    def unresponsive_reason(self) -> str | None:
        """Why the core counts as unresponsive now, or None while it is responsive."""
        return self._reason(self.config.heartbeat_timeout_s)

    def stalled_reason(self) -> str | None:
        """Why requests in flight should be failed now, or None."""
        return self._reason(self.config.stall_timeout_s)
