"""StepMasks: the token bitmask rows of one step's constrained requests, off the critical path.

`start(requests)` is called after the step's inputs are built and before its forward pass is
launched: it picks the requests that carry a constraint (none: it returns None and the step
pays nothing) and has llguidance's executor fill their rows on a worker thread (the matchers
release the interpreter lock), while the forward pass runs. The sampler then calls
`PendingMasks.wait()` for the host rows, [len(rows), ceil(vocab / 32)] int32 in one reused
buffer (a step's masks are uploaded before the next step starts them), and applies them with
the `apply_token_bitmask` op. Times: `compute_seconds` on the worker, `wait_seconds` on the
critical path (the part the forward pass did not hide).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class PendingMasks:
    rows: list[int]            # positions, in the step's sampled requests, of the masked rows
    _future: Future
    _owner: "StepMasks"

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        result = self._future.result()
        self._owner.wait_seconds += time.perf_counter() - t0
        return result


class StepMasks:
    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.max_rows = max_rows
        self.compute_seconds = 0.0
        self.wait_seconds = 0.0
        self._buffer: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None

    def start(self, requests: Sequence[Any]) -> PendingMasks | None:
        rows = [i for i, r in enumerate(requests) if r.constraint is not None]
        if not rows:
            return None
        if len(rows) > self.max_rows:
            raise ValueError(f"{len(rows)} constrained rows in one step; at most {self.max_rows}")
        if self._pool is None:
            from llguidance import LLExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessellm-token-masks")
            self._executor = LLExecutor()
            self._buffer = torch.empty((self.max_rows, self.words), dtype=torch.int32)
        matchers = [(requests[i].constraint.matcher, k) for k, i in enumerate(rows)]
        return PendingMasks(rows, self._pool.submit(self._fill, matchers), self)

    def _fill(self, matchers: list[tuple[Any, int]]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self._buffer[:len(matchers)]   # type: ignore[index]
        self._executor.unsafe_compute_mask_ptr(matchers, out.data_ptr(), self.words * 4,
                                               len(matchers))
        self.compute_seconds += time.perf_counter() - t0
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
