"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once, replayed over
the engine's persistent input buffers.

The engine (ModelRunner) guarantees the preconditions: the plan is called with the same input
tensors (same storage) on every step of a shape, rewritten in place, and only with kernels that
read lengths on the device (the Triton decode kernel loops to seq_lens[i]; no kernel of a
decode step reads the host-side metadata lists). A moved input is an error, never a silent
replay over stale memory. All graphs share one memory pool: a graph's output is read (by the
sampler) before the next replay, so the sharing is safe.
"""
from __future__ import annotations

from typing import Any

import torch

WARMUP_RUNS = 2


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 (vLLM's buckets), up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def input_pointers(feeds: dict[str, Any]) -> tuple[int, ...]:
    """The storage addresses of every tensor the plan reads (metadata fields included)."""
    ptrs = []
    for value in feeds.values():
        if isinstance(value, torch.Tensor):
            ptrs.append(value.data_ptr())
        elif hasattr(value, "__slots__"):   # AttentionMetadata
            ptrs += [getattr(value, f).data_ptr() for f in value.__slots__
                     if isinstance(getattr(value, f), torch.Tensor)]
    return tuple(ptrs)


class CudaGraphPlan:
    """`run(feeds)` like the plan's: the first call warms up on a side stream (lazy
    initialization and Triton compilation happen outside the capture), captures, and every
    call replays; returns the captured output tensor (overwritten by each replay)."""

    def __init__(self, plan: Any, device: torch.device, pool: Any) -> None:
        self.plan = plan
        self.device = device
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None
        self._pointers: tuple[int, ...] = ()

    def run(self, feeds: dict[str, Any]) -> Any:
        pointers = input_pointers(feeds)
        if self.graph is None:
            self._capture(feeds)
            self._pointers = pointers
        elif pointers != self._pointers:
            raise RuntimeError("decode graph inputs moved since capture: the engine must pass "
                               "its persistent buffers (run with enforce_eager to bypass)")
        self.graph.replay()
        return self.output

    def _capture(self, feeds: dict[str, Any]) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.plan.run(feeds)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.output = self.plan.run(feeds)
        self.graph = graph
