"""Kernel choice before the first request: every token bucket an engine can meet is
profiled (or resolved by the kernel_selection policy) up front, and so are the sampler's
`sample_tokens`, `greedy_tokens` and `apply_token_bitmask` kernels for every bucket of rows up
to the rows a step may sample (max_num_seqs, times 1 + k with speculation; on a device that has them; greedy in the model's dtype and in float32, the
dtype of penalised logits; the token mask in float32); then weights take the layout their
kernels read
(tessellm.graph.lowering.adopt_weight_layouts), then the device's decode graphs are captured
(after that warm-up, on padding rows only).

Why up front: no request waits on a profile, a request's output never depends on when a
bucket was first seen, and a weight is converted once with no plain copy left beside it. The
decisions are cached on disk, so a restart only re-reads them.
"""
from __future__ import annotations

import logging

import torch

from tessellm.engine.builder import EngineParts
from tessellm.engine.llm_engine import LLMEngine
from tessellm.engine.startup_progress import StartupProgress
from tessellm.engine.step_rows import max_step_rows
from tessellm.engine.sampler import (BITMASK_OP, GREEDY_OP, SAMPLE_OP, bitmask_kernel_query,
                                     greedy_kernel_query, sample_kernel_query)
from tessellm.graph.lowering import adopt_weight_layouts, select_all_kernels
from tessellm.kernels.profiler import token_bucket

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """The powers of two a step of up to `max_tokens` tokens can fall in."""
    buckets, b = [], 1
    while b < 2 * max_tokens:
        buckets.append(b)
        b *= 2
    return buckets


def _select_sample_kernels(parts: EngineParts, bucket: int) -> dict[str, str]:
    """The random-sampling, greedy and token-mask kernels for `bucket` rows (rows are sampled sequences,
    so buckets up to max_num_seqs), where the device has them; else the sampler runs the
    reference."""
    selector, vocab = parts.selector, parts.spec.vocab_size
    queries = []
    if selector.registry.has_op(selector.device_name, SAMPLE_OP):
        queries.append(sample_kernel_query(bucket, vocab))
    if selector.registry.has_op(selector.device_name, GREEDY_OP):
        queries += [greedy_kernel_query(bucket, vocab, dt)
                    for dt in dict.fromkeys((parts.dtype, torch.float32))]
    if selector.registry.has_op(selector.device_name, BITMASK_OP):
        queries.append(bitmask_kernel_query(bucket, vocab))
    return {q.bucket_key: selector.select(q).name for q in queries}


def choose_kernels(parts: EngineParts, sample_kernels: bool = True,
                   progress: StartupProgress | None = None) -> dict[str, str]:
    """Choose every kernel of the plan (and of the sampler) for every reachable bucket, then
    let weights take their kernels' layout; returns {bucket key: kernel name}. Every rank of
    a tensor-parallel engine does this for its own shard (a worker samples nothing)."""
    c = parts.config
    rows = max_step_rows(c)   # sampled rows (decodes, or a verify entry's rows)
    buckets = token_buckets(max(c.max_num_batched_tokens, rows))
    choices: dict[str, str] = {}
    if progress:
        progress.stage(f"choosing kernels for {len(buckets)} token buckets (cached decisions "
                       "are reused)")
    for i, b in enumerate(buckets):
        measured = parts.selector.profiled
        choices.update(select_all_kernels(parts.plan, b, rows))
        if sample_kernels and b <= token_bucket(rows):
            choices.update(_select_sample_kernels(parts, b))
        if progress and parts.selector.profiled > measured:
            progress.stage(f"profiled kernels for token bucket {b} ({i + 1}/{len(buckets)})")
    parts.selector.release_examples()
    adopted = adopt_weight_layouts(parts.plan, parts.weights)
    if adopted:
        log.info("%d weight(s) converted to their kernels' layout", adopted)
    # profiling is over: memory handed out lazily (the KV pool) may now be committed while
    # the engine serves, without disturbing a timing
    parts.device.allocator().commit_in_background()
    return choices


def prepare_kernels(engine: LLMEngine, progress: StartupProgress | None = None
                    ) -> dict[str, str]:
    """Choose every kernel for every reachable bucket, then (every rank ready) compile the
    device's padded step shapes; returns {bucket key: kernel name}."""
    choices = choose_kernels(engine.parts, progress=progress)
    engine.wait_for_ranks()
    runner = engine.runner
    if runner.graph_sizes or runner.static_shapes is not None:
        if progress:
            what = (f"decode graphs for batch sizes {runner.graph_sizes}" if runner.graph_sizes
                    else f"{len(runner.static_shapes.shapes())} static step shapes "
                         f"(tokens {list(runner.static_shapes.token_buckets)} x sequences "
                         f"{list(runner.static_shapes.seq_buckets)})")
            progress.stage(f"compiling {what}")
        runner.precompile()
    return choices
