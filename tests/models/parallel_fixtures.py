"""Shared checks for the tensor- and pipeline-parallel engine tests."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tessellm import SamplingParams
from tessellm.parallel.group import ParallelGroupError


def assert_killed_worker_fails_requests(llm, named: str) -> None:
    """SIGKILL of the first worker process (a child process or a Ray actor) 1 s into generation: the open requests fail with a
    ParallelGroupError matching `named` within 30 s, none is left open, and the engine stays
    dead (the next request fails the same way)."""
    worker = llm.engine.parts.parallel.workers.pids[0]
    killer = threading.Timer(1.0, os.kill, (worker, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with pytest.raises(ParallelGroupError, match=named):
        for _ in range(1000):   # until the kill lands mid-generation
            llm.generate([[1, 403, 407]] * 3, long)
    assert time.monotonic() - t0 < 30
    assert not llm.engine.has_unfinished()
    with pytest.raises(ParallelGroupError, match=named):
        llm.generate([[1, 403]], SamplingParams(max_tokens=4, temperature=0.0))
