"""The ModelRunner of an engine's parts: its limits, the sampler's kernel choosers (profiled
like any kernel, per bucket of rows), whether steps overlap, and who leads a tensor-parallel
group's device work."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tessellm.constraints.step_masks import StepMasks
from tessellm.engine.builder import EngineParts
from tessellm.engine.model_runner import ModelRunner, RunnerLimits, SamplerKernels
from tessellm.engine.step_rows import max_graph_rows, max_step_rows
from tessellm.engine.sampler import (BITMASK_OP, GREEDY_OP, SAMPLE_OP, SelectBitmaskKernel,
                                     SelectGreedyKernel, SelectSampleKernel,
                                     bitmask_kernel_query, greedy_kernel_query,
                                     sample_kernel_query)
from tessellm.errors import ConfigError
from tessellm.kernels.profiler import KernelSelector, token_bucket
from tessellm.parallel.pipe import StageLink


def sample_kernel_select(selector: KernelSelector) -> SelectSampleKernel | None:
    """The Sampler's kernel choice for random rows: the device's `sample_tokens` kernel for
    the rows' token bucket, chosen (profiled, cached) by the selector like any other op. A
    device with no kernel for the op (cpu) gets None: the Sampler then runs the torch
    reference (reference.sample_tokens) on the device, which is device-agnostic; this is the
    documented default, not an error. (sim registers every reference op as its own kernel,
    so it takes the selector path with the reference inside.)"""
    if not selector.registry.has_op(selector.device_name, SAMPLE_OP):
        return None

    def select(rows: int, vocab: int) -> Callable[..., torch.Tensor]:
        return selector.select(sample_kernel_query(token_bucket(rows), vocab)).fn

    return select


def greedy_kernel_select(selector: KernelSelector) -> SelectGreedyKernel | None:
    """The Sampler's kernel for greedy rows: the device's `greedy_tokens` kernel for the
    rows' token bucket and the logits' dtype, chosen like any other op (kernel_warmup chose
    it for every bucket up to max_num_seqs, in the model's dtype and in float32); None on a
    device with no such kernel, where the Sampler runs the reference (torch.max)."""
    if not selector.registry.has_op(selector.device_name, GREEDY_OP):
        return None

    def select(rows: int, vocab: int, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return selector.select(greedy_kernel_query(token_bucket(rows), vocab, dtype)).fn

    return select


def bitmask_kernel_select(selector: KernelSelector) -> SelectBitmaskKernel | None:
    """The Sampler's kernel for the token masks of constrained rows: the device's
    `apply_token_bitmask` kernel for the rows' token bucket (float32), chosen like any other
    op; None on a device with no such kernel, where the Sampler runs the reference."""
    if not selector.registry.has_op(selector.device_name, BITMASK_OP):
        return None

    def select(rows: int, vocab: int) -> Callable[..., None]:
        return selector.select(bitmask_kernel_query(token_bucket(rows), vocab)).fn

    return select


def async_scheduling_enabled(parts: EngineParts) -> bool:
    """config.async_scheduling, or (None) whether the device runs asynchronously. Raises
    ConfigError on a static-shape device (the feed would be a shape of its own per step);
    EngineConfig refuses it with tensor parallelism (workers replay host-staged ids)."""
    c, device = parts.config, parts.device
    wanted = c.async_scheduling
    static = device.static_shapes(c.max_num_batched_tokens, c.max_num_seqs) is not None
    if wanted is None:
        return device.asynchronous and parts.parallel is None and not static
    if wanted and static:
        raise ConfigError(f"async_scheduling is not supported on device {device.name!r}, "
                          "which compiles static step shapes")
    return wanted


def make_model_runner(parts: EngineParts) -> ModelRunner:
    """The runner of an engine's parts (on every rank of a tensor-parallel group; rank 0's
    sends its device work to the others)."""
    c = parts.config
    leads = parts.parallel is not None and parts.parallel.is_leader
    drafts = 0 if c.speculative_config is None else c.speculative_config.num_speculative_tokens
    if drafts and parts.device.static_shapes(c.max_num_batched_tokens, c.max_num_seqs):
        raise ConfigError(f"speculative_config is not supported on device "
                          f"{parts.device.name!r} yet, which compiles static step shapes "
                          "(verify steps would need shapes of their own)")
    limits = RunnerLimits(c.block_size, c.max_num_batched_tokens, max_step_rows(c),
                          math.ceil(parts.max_model_len / c.block_size))
    graph_rows = max_graph_rows(c)
    pipe = stage_link(parts)
    return ModelRunner(
        parts.device, parts.plan, parts.kv_caches, limits,
        host_kv_caches=parts.host_kv_caches,
        graph_sizes=() if c.enforce_eager or pipe is not None
        else parts.device.decode_graph_sizes(graph_rows),
        static_shapes=parts.device.static_shapes(c.max_num_batched_tokens, c.max_num_seqs),
        followers=parts.parallel.channel if leads else None,
        overlap=async_scheduling_enabled(parts),
        token_masks=StepMasks(parts.spec.vocab_size, c.max_num_seqs)
        if parts.tokenizer is not None else None,
        sampler_kernels=SamplerKernels(sample_kernel_select(parts.selector),
                                       greedy_kernel_select(parts.selector),
                                       bitmask_kernel_select(parts.selector)),
        pipe=pipe, layout=parts.kv_layout)


def stage_link(parts: EngineParts) -> StageLink | None:
    """Pipeline parallelism: this rank's links to its neighbour stages (None: one stage).
    A pipelined step runs eagerly: the stages' sends sit between plans, which decode graphs
    (captured whole) cannot hold."""
    group = parts.parallel
    if group is None or group.pipe_group is None:
        return None
    c = parts.config
    return StageLink(group.pipe_group, group.layout, group.rank, parts.spec.hidden_size,
                     parts.spec.vocab_size, parts.dtype,
                     torch.device(parts.device.torch_device_type),
                     c.pipeline_micro_batches or c.pipeline_parallel_size,
                     c.pipeline_micro_batch_tokens, c.distributed_timeout_s)
