"""Kernel choice before the first request: every token bucket an engine can meet is
profiled (or resolved by the kernel_selection policy) up front, then weights take the layout
their kernels read (tessellm.graph.lowering.adopt_weight_layouts), then the device's decode
graphs are captured (after that warm-up, on padding rows only).

Why up front: no request waits on a profile, a request's output never depends on when a
bucket was first seen, and a weight is converted once with no plain copy left beside it. The
decisions are cached on disk, so a restart only re-reads them.
"""
from __future__ import annotations

import logging
import sys

from tessellm.engine.llm_engine import LLMEngine
from tessellm.graph.lowering import adopt_weight_layouts, select_all_kernels

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """The powers of two a step of up to `max_tokens` tokens can fall in."""
    buckets, b = [], 1
    while b < 2 * max_tokens:
        buckets.append(b)
        b *= 2
    return buckets


def prepare_kernels(engine: LLMEngine, progress: bool = True) -> dict[str, str]:
    """Choose every kernel for every reachable bucket; returns {bucket key: kernel name}."""
    c = engine.parts.config
    buckets = token_buckets(max(c.max_num_batched_tokens, c.max_num_seqs))
    choices: dict[str, str] = {}
    for i, b in enumerate(buckets):
        if progress:
            print(f"tessellm: profiling kernels, token bucket {b} ({i + 1}/{len(buckets)})",
                  file=sys.stderr, flush=True)
        choices.update(select_all_kernels(engine.parts.plan, b, c.max_num_seqs))
    adopted = adopt_weight_layouts(engine.parts.plan, engine.parts.weights)
    if adopted:
        log.info("%d weight(s) converted to their kernels' layout", adopted)
    if engine.runner.graph_sizes:
        if progress:
            print(f"tessellm: capturing decode graphs for batch sizes {engine.runner.graph_sizes}",
                  file=sys.stderr, flush=True)
        engine.runner.capture_decode_graphs()
    return choices
