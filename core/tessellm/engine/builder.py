"""Assemble an engine's parts from an EngineConfig: device, model graph, passes, kernels,
weights on the device, the KV cache and the ExecutionPlan."""
from __future__ import annotations

import logging
import math
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

import tessellm
from tessellm.config import EngineConfig
from tessellm.device import DevicePlugin
from tessellm.errors import ConfigError
from tessellm.graph.lowering import lower
from tessellm.graph.passes import GraphPass, PassReport, default_passes, run_passes
from tessellm.graph.plan import ExecutionPlan
from tessellm.kernels.profiler import KernelSelector, ProfileCache
from tessellm.kernels.registry import KernelRegistry
from tessellm.models.demo import DEMO_NOTICE, ensure_demo_model
from tessellm.models.hf_files import eos_token_ids, load_tokenizer, read_hf_config
from tessellm.models.loader import checkpoint_dtype, load_model
from tessellm.models.spec import ModelSpec
from tessellm.paths import cache_root
from tessellm.plugins import PluginManager

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 4 << 30  # like vLLM's CPU default; sized down to what can be used


@dataclass
class EngineParts:
    config: EngineConfig
    device: DevicePlugin
    spec: ModelSpec
    dtype: torch.dtype
    tokenizer: Any
    eos_token_ids: frozenset[int]
    plan: ExecutionPlan
    selector: KernelSelector
    pass_report: PassReport
    kv_caches: list[torch.Tensor]
    num_kv_blocks: int
    max_model_len: int
    is_demo: bool
    host_kv_caches: list[torch.Tensor] = field(default_factory=list)  # swap mode's host pool

    @property
    def num_host_kv_blocks(self) -> int:
        return self.host_kv_caches[0].shape[1] if self.host_kv_caches else 0


def model_dir_of(config: EngineConfig) -> tuple[str, bool]:
    if config.model is not None:
        return config.model, False
    log.info(DEMO_NOTICE)
    return str(ensure_demo_model(cache_root(config.cache_dir) / "demo-model")), True


def make_selector(config: EngineConfig, registry: KernelRegistry,
                  device: DevicePlugin) -> KernelSelector:
    identity = (f"{device.name}-{device.version}|torch={torch.__version__}"
                f"|tessellm={tessellm.__version__}|{platform.machine()}|threads={torch.get_num_threads()}")
    return KernelSelector(
        registry, device.name, device.torch_device_type, device.synchronize,
        policy=config.kernel_selection,
        cache=ProfileCache(cache_root(config.cache_dir) / "kernel_profile.json"),
        identity=identity)


def kv_block_count(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                   max_model_len: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = (2 * config.block_size * spec.num_kv_heads * spec.head_dim
                 * torch.empty((), dtype=dtype).element_size() * spec.num_layers)
    budget = config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    useful = config.max_num_seqs * math.ceil(max_model_len / config.block_size)
    return max(1, min(budget // per_block, useful))


def host_kv_block_count(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                        num_kv_blocks: int) -> int:
    """Host blocks for swap preemption: 0 in recompute mode; else num_host_kv_blocks, or as
    many as swap_space_bytes hold, or as many as the device pool."""
    if config.preemption_mode != "swap":
        return 0
    if config.num_host_kv_blocks is not None:
        return config.num_host_kv_blocks
    if config.swap_space_bytes is None:
        return num_kv_blocks
    per_block = (2 * config.block_size * spec.num_kv_heads * spec.head_dim
                 * torch.empty((), dtype=dtype).element_size() * spec.num_layers)
    return max(1, config.swap_space_bytes // per_block)


def build_engine_parts(config: EngineConfig, plugins: PluginManager | None = None,
                       extra_passes: list[GraphPass] | None = None) -> EngineParts:
    plugins = plugins or PluginManager().load()
    device = plugins.select_device(config.device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    registry = plugins.kernel_registry()
    model_dir, is_demo = model_dir_of(config)
    hf_config = read_hf_config(model_dir)
    dtype = config.torch_dtype(checkpoint_dtype(hf_config))
    loaded = load_model(model_dir, dtype, progress=config.load_progress,
                        extra_architectures=plugins.architectures(), config=hf_config)
    spec = loaded.spec
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's "
                          f"{spec.max_position_embeddings} positions")
    passes = default_passes() if config.graph_passes == "default" else []
    passes = passes[:-1] + list(plugins.graph_passes()) + (extra_passes or []) + passes[-1:]
    graph, report = run_passes(loaded.graph, passes, lambda op: registry.has_op(device.name, op))
    graph.weights.update({name: device.upload(w.contiguous(), tag="weights")
                          for name, w in graph.weights.items()})
    selector = make_selector(config, registry, device)
    plan = lower(graph, selector, dtype)
    num_blocks = kv_block_count(config, spec, dtype, max_model_len)
    alloc = device.allocator()
    # one more physical block than usable ones: block 0 is the KV manager's null block
    kv_caches = [alloc.allocate((2, num_blocks + 1, spec.num_kv_heads, config.block_size,
                                 spec.head_dim), dtype, tag="kv_cache")
                 for _ in range(spec.num_layers)]
    num_host = host_kv_block_count(config, spec, dtype, num_blocks)
    host = device.host_allocator()   # same per-layer layout; no null block on the host
    host_kv_caches = [host.allocate((2, num_host, spec.num_kv_heads, config.block_size,
                                     spec.head_dim), dtype)
                      for _ in range(spec.num_layers)] if num_host else []
    tokenizer = load_tokenizer(model_dir)
    return EngineParts(config, device, spec, dtype, tokenizer, eos_token_ids(hf_config, tokenizer),
                       plan, selector, report, kv_caches, num_blocks, max_model_len, is_demo,
                       host_kv_caches)
