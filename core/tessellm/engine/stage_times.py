"""Cumulative wall time per engine stage (schedule, prepare_inputs, execute, sample, update,
detokenize): the seeds' "time share per CPU stage". Written by the engine thread only;
readers (metrics) take a snapshot."""
from __future__ import annotations

import threading


class StageTimes:
    STAGES = ("schedule", "prepare_inputs", "execute", "sample", "update", "detokenize")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(self.STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)
