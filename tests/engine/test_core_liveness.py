"""CoreLiveness: silence past the heartbeat timeout is unresponsive, past the stall timeout
stalled; a step that runs past the stall timeout while the heartbeats still come is both; a
report makes the core responsive again at once."""
from __future__ import annotations

import pytest

from tessellm.engine.core_liveness import CoreLiveness, LivenessConfig
from tessellm.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> Clock:
    return Clock()


def test_silence_is_unresponsive_then_stalled_and_a_report_recovers(clock):
    live = CoreLiveness(LivenessConfig(heartbeat_timeout_s=2.0, stall_timeout_s=10.0), clock)
    clock.now += 1.9
    assert live.unresponsive_reason() is None and live.stalled_reason() is None
    clock.now += 0.2
    assert "not reported for 2.1 s" in live.unresponsive_reason()
    assert live.stalled_reason() is None
    clock.now += 8.0
    assert "not reported for 10.1 s" in live.stalled_reason()
    live.heard()
    assert live.unresponsive_reason() is None and live.stalled_reason() is None
    assert live.silence_s == 0.0 and live.step_age_s == 0.0


def test_a_step_that_does_not_end_stalls_while_heartbeats_arrive(clock):
    live = CoreLiveness(LivenessConfig(heartbeat_timeout_s=2.0, stall_timeout_s=10.0), clock)
    for age in (0.25, 5.0, 9.75):
        live.heard(step_age_s=age)
        assert live.unresponsive_reason() is None
    clock.now += 0.5   # between heartbeats the step keeps ageing
    assert live.step_age_s == pytest.approx(10.25)
    assert "current step has run for 10.2 s" in live.unresponsive_reason()
    assert live.stalled_reason() is not None
    live.heard()       # the step ended: a plain report
    assert live.step_age_s == 0.0 and live.stalled_reason() is None


@pytest.mark.parametrize("heartbeat,stall", [(0.0, 1.0), (5.0, 1.0), (-1.0, 2.0)])
def test_timeouts_must_be_ordered_and_positive(heartbeat, stall):
    with pytest.raises(ConfigError, match="heartbeat timeout"):
        LivenessConfig(heartbeat, stall)
