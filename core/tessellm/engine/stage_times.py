"""Cumulative wall time per engine stage (schedule, prepare_inputs, execute, sample, update):
the seeds' "time share per CPU stage". Written by the engine loop only; readers take a
snapshot. (Detokenization runs in the server's front end, which counts it itself.) On an
asynchronous device `execute` is the time to enqueue the plan; the device time then shows in
`sample`, which ends with the step's one synchronization (reading back the token ids).
`core_messages` is the engine core loop's own time around the steps: reading messages and
building, encoding and sending StepOutputs."""
from __future__ import annotations

import threading


class StageTimes:
    STAGES = ("schedule", "prepare_inputs", "execute", "sample", "update", "core_messages")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(self.STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)
